"""What `launch.py` does with a composed config, in order:

validate (no JAX) → dry run, or → create the run record (directory + MLflow run) → train here
or submit to Slurm. A config error prints one line per bad field and exits with status 2, before
anything is written. Everything printed goes through marin.track.secrets (secrets masked). A
closed stdout (`launch.py dry_run=true | head -1`) ends quietly, as other command-line tools do.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from marin.cli import config_errors, fail, setup_logging
from marin.config import derive
from marin.config.store import name_options, override
from marin.config.validate import ConfigError
from marin.launch.checks import load
from marin.launch.compile_plan import run as compile_run
from marin.launch.distributed import apply_environment
from marin.launch.fork import fork
from marin.launch.memory import launch_refusal, out_of_memory_line
from marin.launch.plan import print_plan
from marin.launch.reproduce import ReproduceError, recompose
from marin.launch.resume import resume
from marin.launch.slurm import submit
from marin.launch.verify import verify
from marin.track import record, secrets
from marin.track.backend import TrackingUnavailable
from marin.track.errors import disk_full, out_of_memory

log = logging.getLogger("marin")


def overrides() -> list[str]:
    """The command-line overrides of this job (for the run record and reproduction)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main
        return []


def dispatch(cfg: DictConfig, job_overrides: list[str] | None = None) -> None:
    """Run the composed `cfg`; `job_overrides`: its command line's overrides (by default Hydra's,
    under launch.py; a caller that composed with marin.config.store.compose passes its own)."""
    try:
        _guarded(cfg, overrides() if job_overrides is None else job_overrides)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's exit-time flush
    except BrokenPipeError:
        # The reader went away (`| head -1`): no traceback, and no second error when Python
        # flushes stdout at exit (the documented recipe: point stdout at /dev/null).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, what a shell reports for tools killed by the closed pipe


RUN_REFERENCES = ("resume", "reproduce", "fork", "train.init_from")


def quote_run_references(args: list[str]) -> list[str]:
    """launch.py's arguments with each run reference that holds an `=` quoted for Hydra, whose
    grammar refuses a second unquoted `=`: a sweep's job pastes as `marin.status` prints it
    (`reproduce=router_ablation/router=qb`), and as its directory (`fork=…/grid-lr=0.001-…@3`).
    Such a value has only this meaning, and so has one naming a path that exists (a run directory
    pasted as `resume=<dir>`, `(`, `,` or `'` in it); any other is left to Hydra (in a multirun,
    `fork=a@3,b@3` sweeps)."""
    quoted = []
    for arg in args:
        key, sep, value = arg.partition("=")
        # `verify=<run>` too: refused then as the flag it is, with the command that replays that run
        if (sep and key.lstrip("+") in (*RUN_REFERENCES, "verify") and value and value[0] not in "'\""
                and ("=" in value or _names_a_path(value))):
            arg = override(key, value)
        quoted.append(arg)
    return quoted


def _names_a_path(value: str) -> bool:
    """Whether a run reference is a path here (`<dir>` or `<dir>@<step>`)."""
    head, at, step = value.rpartition("@")
    try:
        return Path(value).expanduser().exists() or bool(at and step.isdigit() and Path(head).expanduser().exists())
    except (OSError, ValueError):
        return False


def keep_run_references(cfg: DictConfig, job_overrides: list[str]) -> None:
    """A run reference as the command line typed it: an id prefix is hex, and Hydra's parser reads
    `resume=12e4` as the float 120000.0 (a run that is never found)."""
    for override in job_overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") in RUN_REFERENCES and value and value[0] not in "'\"[{":
            OmegaConf.update(cfg, key.lstrip("+"), value, merge=False)


def _guarded(cfg: DictConfig, job_overrides: list[str]) -> None:
    setup_logging()
    keep_run_references(cfg, job_overrides)
    if HydraConfig.initialized():  # under @hydra.main (tests compose with marin.config.store.compose)
        name_options(cfg, HydraConfig.get().runtime.choices)
    secrets.scan_overrides(job_overrides)
    try:
        _dispatch(cfg, job_overrides)
    except TrackingUnavailable as err:  # ours: one masked line, not Hydra's crash report (which prints the overrides)
        fail(str(err), code=1)
    except Exception as err:
        if full := disk_full(err):  # a checkpoint lost for want of space: one line, not the writes failing after it
            fail(full, code=1)
        if oom := out_of_memory(err):  # the run (if one was made) ended FAILED: one line naming the limit
            fail(out_of_memory_line(oom), code=1)
        raise


# What a command line starts from, besides conf/: one at most (verify= goes with reproduce=).
STARTS = {"resume": "continues a run", "fork": "starts a new run from a checkpoint",
          "reproduce": "runs a saved config again"}


def _dispatch(cfg: DictConfig, job_overrides: list[str]) -> None:
    if len(given := [key for key in STARTS if cfg.get(key)]) > 1:  # one would be ignored, silently
        fail(f"{' and '.join(f'{key}=' for key in given)}: give one of them ("
             + "; ".join(f"{key}= {STARTS[key]}" for key in given) + ")")
    if cfg.get("verify"):  # replay a recorded run and compare its metrics (marin/launch/verify.py)
        verify(cfg, job_overrides)
        return
    if cfg.get("resume"):  # continue a run: its own config, dir and MLflow run (marin/launch/resume.py)
        resume(job_overrides, dry_run=cfg.get("dry_run"), wait=bool(cfg.get("wait")), ref=str(cfg.resume))
        return
    if cfg.get("fork"):  # a new run from another run's checkpoint, with its lineage (marin/launch/fork.py)
        fork(cfg, job_overrides)
        return
    try:
        if cfg.get("reproduce"):  # the saved run's config, with this command line's overrides on top
            try:
                composed, resolved, job_overrides = recompose(cfg.reproduce, job_overrides)
            except ReproduceError as err:
                fail(f"reproduce: {err}")
        else:
            composed, resolved = load(cfg)
    except ConfigError as err:
        fail(config_errors(err))
    if resolved.dry_run in ("compile", "compile_json"):  # compile one replica's real steps (marin/launch/compile_plan.py)
        compile_run(resolved, as_json=resolved.dry_run == "compile_json")
        return
    if resolved.dry_run == "config":  # the resolved config as YAML: every auto replaced by its value
        print(_resolved_yaml(resolved), end="")
        print("# derived from the fields above (marin.config.derive), held by no field:\n"
              f"#   warmup steps: {derive.warmup_steps(resolved)}  (schedule.warmup_frac × train.steps)\n"
              f"#   data phase boundaries: {derive.phase_boundary_steps(resolved)}  (data.phase_boundaries × steps, "
              "on mixture-block edges)")
        return
    if resolved.dry_run:
        print_plan(resolved, as_json=resolved.dry_run == "json")
        return
    if resolved.hardware.launcher == "slurm":
        if resolved.train.init_from:  # as run_local does: a checkpoint the model cannot take, before submitting
            from marin.train.init_from import structure_problem  # JAX

            if (problem := structure_problem(resolved)) is not None:
                fail(problem)
        submit(composed, resolved, job_overrides)
        return
    if (problem := launch_refusal(resolved)) is not None:  # a CPU run bigger than this machine, as Slurm's
        fail(problem)
    from marin.launch.local import run_local  # JAX: the trainer's imports stay off the dry-run path

    apply_environment(resolved.hardware)  # XLA_FLAGS etc. before JAX starts (local_cpu8's 8 devices)
    run_local(composed, resolved, job_overrides)


def _resolved_yaml(resolved, package: str | None = None) -> str:
    return secrets.mask(_yaml(OmegaConf.create(secrets.redact(record.config_dict(resolved))), package))


def _yaml(tree: DictConfig, package: str | None) -> str:
    """`tree`, or its node at the dotted `package`, as YAML (a leaf: its value)."""
    node = OmegaConf.select(tree, package) if package else tree
    if node is None:
        fail(f"--package {package}: not in the config")
    return OmegaConf.to_yaml(node) if isinstance(node, (DictConfig, ListConfig)) else f"{node}\n"


def show(cfg: DictConfig, resolve: bool, package: str | None = None) -> None:
    """`launch.py --cfg job [--resolve] [--package P]`: the composed config with each group's
    `name` filled in as a run gets it (Hydra's own --cfg prints them `???`), or, resolved, every
    `auto` filled in as `dry_run=config` prints it (Hydra's --resolve fills interpolations only)."""
    setup_logging()
    if HydraConfig.initialized():
        name_options(cfg, HydraConfig.get().runtime.choices)
    if not resolve:
        print(_yaml(cfg, package), end="")
        return
    try:
        _, resolved = load(cfg)
    except ConfigError as err:
        fail(config_errors(err))
    print(_resolved_yaml(resolved, package), end="")
