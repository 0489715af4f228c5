"""Test helpers: compose a config as launch.py does (Hydra's compose API and its override code)."""
from __future__ import annotations

import copy
import fcntl
import os
import signal
from contextlib import contextmanager
from pathlib import Path

from marin.config.store import compose
from marin.launch.checks import load
from marin.launch.distributed import FORCED_DEVICES_FLAG
from marin.train import manifest

ROOT = Path(__file__).resolve().parents[1]
# The suite's own XLA flags (tests/conftest.py puts them in XLA_FLAGS; marin passes the environment's
# XLA_FLAGS on to every process of a run): LLVM at -O0 and XLA:CPU's older (non-MLIR) fusion code
# generator cut a tiny train step's compile, which is most of the suite's CPU, to a quarter to a
# sixth of XLA's defaults, and slow its few steps about 3x; code generated as one LLVM module, not
# split for parallel threads, takes 8-22 % less compile CPU again (tiny steps and the hero alike),
# and on a machine the suite keeps busy no core is idle to take the split parts (benchmarks/test_flags.py).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")


# The suite's site folder ($MARIN_SITE for every test, tests/conftest.py): settings every run of the
# suite shares (tests/site/local/site.yaml).
SUITE_SITE = ROOT / "tests" / "site"

_MEMO: dict = {}


def _memoised(key, make):
    """make(), once per process per key; each caller gets its own copy. Not under another site
    folder than the suite's: the site tests change their file between composes."""
    if os.environ.get("MARIN_SITE") != str(SUITE_SITE):
        return make()
    if key not in _MEMO:
        _MEMO[key] = make()
    return copy.deepcopy(_MEMO[key])


def compose_dict(*overrides: str):
    """The composed config (a DictConfig) of these overrides, as launch.py composes it.

    Hydra composes in two parts: the defaults list (the options chosen: `model=tiny`,
    `experiment=...`), then each value override (`train.steps=5`) set on the result in order, by
    its `ConfigLoaderImpl._apply_overrides_to_config`. A compose reads every YAML file again (about
    0.12 CPU-s; the suite asks for about a thousand configs that differ only in values), so the
    first part is composed once per process and options chosen (memoised), and the values are set
    on a copy of it by that same Hydra function (about 0.01 s). tests/config/test_compose.py
    checks that both ways give the same config and the same errors."""
    options, values = _split_overrides(overrides)
    if not values:
        return _memoised(("composed", overrides), lambda: compose(overrides))
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    cfg = compose_dict(*options)
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg


def _split_overrides(overrides: tuple[str, ...]) -> tuple[tuple[str, ...], list]:
    """(what Hydra needs to compose: options chosen and anything unusual, the plain value
    overrides parsed as Hydra parses them), keeping each part's order. A value override is
    `key=value` on a key of the config (not a group, not under `hydra.`, no `+`, `~` or sweep)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from marin.config.paths import CONF_DIR

    try:
        parsed_all = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 (a malformed override: Hydra's compose gives its own error)
        return overrides, []
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()} | {"sweep"}
    options, values = [], []
    for line, parsed in zip(overrides, parsed_all):
        key = parsed.key_or_group
        plain = (parsed.package is None and not parsed.is_sweep_override() and not parsed.is_add()
                 and not parsed.is_force_add() and not parsed.is_delete())
        on_a_value = "/" not in key and key.split(".")[0] != "hydra" and ("." in key or key not in groups)
        if plain and on_a_value:
            values.append(parsed)
        else:
            options.append(line)
    return tuple(options), values


def make_config(*overrides: str):
    """The resolved `Config` for these overrides (validation included), memoised."""
    return _memoised(("resolved", overrides), lambda: load(compose_dict(*overrides))[1])


def launch_here(*overrides: str) -> int:
    """`python launch.py <overrides>` run in this process instead: composed as launch.py composes
    them, then launch.py's dispatch. Its exit status (0 when it returns). For a test that checks
    what a command says or leaves: no new interpreter to import JAX, MLflow and Hydra into (about
    a second of CPU each), and a run it trains compiles once per worker. What only a process shows
    (Hydra's own errors, the exit status the shell sees) stays with subprocess tests."""
    from marin.launch.entry import dispatch, quote_run_references

    overrides = tuple(quote_run_references(list(overrides)))  # as launch.py does before Hydra parses them
    with signals_kept():
        try:
            dispatch(compose_dict(*overrides), list(overrides))
        except SystemExit as end:
            return 0 if end.code is None else end.code
    return 0


def launch_here_acting(out_dir: Path, act, *overrides: str) -> int:
    """`launch_here(*overrides)`, with `act(run_dir)` called from another thread once the run under
    `out_dir` has logged its first step: how a test sends this process what a shell's Ctrl-C, a
    `kill` or `marin.ctl` would. A run that ends first is not acted on. The run is outside Slurm
    (the SLURM_ variables of a suite run inside a job are hidden from it)."""
    import threading
    import time
    from unittest import mock

    ended = threading.Event()

    def act_once_a_step_is_logged() -> None:
        while not ended.is_set():
            if logged := [m for m in Path(out_dir).glob("runs/*/metrics.jsonl") if "train/loss" in m.read_text()]:
                act(logged[0].parent)
                return
            time.sleep(0.1)

    actor = threading.Thread(target=act_once_a_step_is_logged, daemon=True)
    actor.start()
    try:
        with mock.patch.dict(os.environ):
            for name in [k for k in os.environ if k.startswith("SLURM_")]:
                del os.environ[name]
            return launch_here(*overrides)
    finally:
        ended.set()
        actor.join()


@contextmanager
def signals_kept():
    """For training in a test's process: the handlers the trainer installs for preemption, stop
    and checkpoint signals are put back afterwards (pytest's own, for Ctrl-C)."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


@contextmanager
def locked(path: Path):
    """An exclusive fcntl lock on `path` (created), released on exit or when the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fake_run_dir(out_dir, resolved_yaml: str, name: str = "probe") -> str:
    """A run directory under `out_dir/runs/` as record.create leaves it (record.json, the saved
    configs), with no training behind it, for tools that only look a run up; returns its run id."""
    import json

    run_dir = out_dir / "runs" / f"{name}-0a0a0a0a-20261201-100000-abcdef"
    run_dir.mkdir(parents=True)
    run_id = "a1b2c3d4" * 4
    (run_dir / "record.json").write_text(json.dumps({"run_id": run_id, "tracking_uri": "sqlite:///x",
                                                     "experiment": "default"}))
    (run_dir / "composed.yaml").write_text(f"run: {{name: {name}}}\n")
    (run_dir / "resolved.yaml").write_text(resolved_yaml)
    return run_id


def checkpoint_sealed(run_dir: Path, step: int | None = None) -> bool:
    """Whether a run has a checkpoint a restart would resume from (what the Slurm tests wait for
    before they preempt or kill a job), or that of `step`: a step's folder whose every per-process
    manifest is there. Stricter than `listed_steps`, which also counts a folder with neither meta
    nor manifests (from before manifests), as a step just committed and not yet sealed looks for a moment."""
    return any(p.name.isdigit() and (step is None or int(p.name) == step) and manifest.kind(p) == "per-process"
               and manifest.complete(p) for p in (Path(run_dir) / "checkpoints").glob("*"))


def subprocess_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """The environment of a `python -m tests.…` child that forces `devices` host devices."""
    flags = TEST_XLA_FLAGS + (f" {FORCED_DEVICES_FLAG}={devices}" if devices > 1 else "")
    return dict(os.environ, XLA_FLAGS=flags, PJRT_NPROC=str(max(16, 2 * devices)), JAX_PLATFORMS="cpu",
                PYTHONPATH=str(ROOT), **extra)


def new_store(folder: Path, name: str = "mlflow.db") -> str:
    """The URI of a sqlite MLflow store at folder/name, new and empty unless already there: a copy
    of an empty store made once per checkout (MLflow's migrations take about 2 CPU-s a store, and
    the suite makes dozens). The runs' experiments are marin's own, as in any new store."""
    import shutil
    import subprocess
    import sys
    from importlib.metadata import version

    path = Path(folder) / name
    if not path.exists():
        template = ROOT / "outputs" / "cache" / f"mlflow-empty-{version('mlflow')}.db"
        with locked(template.with_suffix(".lock")):
            if not template.exists():
                made = template.with_suffix(".tmp")
                made.unlink(missing_ok=True)
                subprocess.run([sys.executable, "-c", "import sys; from mlflow import MlflowClient; "
                                "MlflowClient(sys.argv[1]).search_experiments()", f"sqlite:///{made}"],
                               check=True, capture_output=True)
                made.replace(template)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
    return f"sqlite:///{path}"
