"""`python launch.py reproduce=<run> verify=true [verify_steps=a:b] [verify_rtol=r]`: replay a
recorded run and compare every metric it logs with the record.

The replay is an ordinary reproduction (marin/launch/reproduce.py: the saved config, this command
line's overrides on top): a new run directory and a new MLflow run, named `<the original's
run.name>-verify` unless `run.name=` is given, tagged `verification_of`
(the original's id) and, once compared, `verify_result`. With `verify_steps=a:b` it trains only
steps a…b, starting from the original's newest checkpoint at or below a (through
`train.init_from=<original>@<step>`, marin/train/init_from.py) and stopping at b.

The record compared against is the original's MLflow metric history, or, where that run cannot
be reached (a run directory copied from another machine), the `metrics.jsonl` its run directory
keeps. Every (metric, step) both hold is compared, earliest step first; wall-clock metrics
(tokens/s, FLOP/s, MFU) are left out. Exit 0 when all are equal (bit for bit, or within
`verify_rtol`), 1 at the first divergence, printed with both values and how the environment
differs (git commit, packages, device kind, XLA flags; from both runs' record.json). Bad input
(no reproduce=, a window outside the run or with no checkpoint to start from, a record without
metrics) is one line, exit 2, before anything is written.

    python -m marin.launch.verify <recorded run> <replay run> [--rtol R]

compares two finished runs the same way (a replay made elsewhere, e.g. on Slurm).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from marin.cli import Parser, config_errors, fail
from marin.config.store import override, override_key
from marin.config.validate import ConfigError
from marin.launch.distributed import apply_environment
from marin.launch.plan import print_plan
from marin.launch.reproduce import ReproduceError, lookup_uri, out_dir, recompose, replay_name
from marin.track import backend, record, secrets
from marin.track.errors import first_line
from marin.track.tracker import METRICS, metric_rows, tracked_name
from marin.train.checkpoint import checkpoint_dir, listed_steps

RESULT = "verify.json"
WALL_CLOCK = ("tokens_per_s", "model_flops_per_s", "mfu", "eval_s", "checkpoint_s")  # last name component: never equal twice
WATCHED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


class VerifyError(ValueError):
    """A verification that cannot start as asked; the message is one line naming the field."""


@dataclass
class Divergence:
    step: int
    key: str
    recorded: float | None
    replayed: float | None

    def line(self, rtol: float) -> str:
        if self.replayed is None:
            return f"step {self.step}: {self.key} = {self.recorded!r} recorded, not logged by the replay"
        rel = abs(self.recorded - self.replayed) / max(abs(self.recorded), abs(self.replayed), 1e-300)
        return (f"step {self.step}: {self.key} = {self.recorded!r} recorded vs {self.replayed!r} replayed "
                f"(relative difference {rel:.3g} > verify_rtol {rtol:g})")


@dataclass
class Plan:
    source: record.RunRecord
    reference: dict           # (key, step) -> value
    where: str                # where the reference came from
    first: int                # the first step compared (a window's replay trains from the checkpoint below it)
    last: int | None          # the step the window ends at (None: the whole run)
    overrides: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- the record

def is_wall_clock(key: str) -> bool:
    """Timings, and MLflow's system metrics (the machine sampled on its own clock): never compared."""
    return key.rsplit("/", 1)[-1] in WALL_CLOCK or key.startswith("system/")


def read_jsonl(path: Path) -> dict:
    """{(key, step): value} of a metrics.jsonl; a step logged twice (a resumed run) keeps the last."""
    return {(row["key"], row["step"]): float(row["value"]) for row in metric_rows(path)}


def _from_mlflow(uri: str, run_id: str) -> dict | None:
    """The run's metric histories, or None when the store or the run cannot be reached."""
    if not uri or secrets.REDACTED in uri:
        return None
    if backend.is_sqlite(uri) and not backend.sqlite_path(uri).exists():
        return None
    try:
        backend.check_reachable(uri, timeout=2.0)
        client = backend.client(uri)
        keys = list(client.get_run(run_id).data.metrics)
        out = {}
        for key in keys:
            for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
                out[(key, int(m.step))] = float(m.value)
        return out
    except Exception:  # no such run in that store (another machine's id), or the store is away
        return None


def reference(source: record.RunRecord) -> tuple[dict, str]:
    """The recorded metrics of `source` and where they came from (MLflow first, then the file)."""
    info = source.info()

    def named_now(found: dict) -> dict:  # a run recorded before bookkeeping moved under usage/ (tracker.tracked_name)
        return {(tracked_name(k), s): v for (k, s), v in found.items()}

    for uri in dict.fromkeys([source.tracking_uri, info.get("tracking_uri")]):
        found = _from_mlflow(uri, source.run_id)
        if found:
            return named_now(found), f"MLflow run {source.run_id} ({secrets.safe_uri(uri)})"
    path = source.run_dir / METRICS
    if path.is_file():
        found = read_jsonl(path)
        if found:
            return named_now(found), str(path)
    raise VerifyError(f"reproduce: run {source.run_id} has no recorded metrics to compare with (its MLflow run "
                      f"cannot be reached and {path} does not exist)")


# ---------------------------------------------------------------------------- the window

def parse_window(text) -> tuple[int, int]:
    a, sep, b = str(text).partition(":")
    if not (sep and a.strip().isdigit() and b.strip().isdigit()) or int(a) >= int(b):
        raise VerifyError(f"verify_steps: must be a:b, whole steps with a < b (e.g. 100:120); got {text!r}")
    return int(a), int(b)


def run_start(source: record.RunRecord, recorded: dict) -> int:
    """The step the original run began at: 0, or where its train.init_from checkpoint was (in
    continue mode; runs recorded before train.init_from_mode existed all continued)."""
    init = source.info().get("init_from") or {}
    if init.get("mode", "continue") != "continue" or source.resolved().train.get("init_from_mode") == "weights":
        return 0  # it took the weights only and trained from step 0
    if init.get("step") is not None:
        return int(init["step"])
    if source.resolved().train.get("init_from"):
        return min(step for _, step in recorded) - 1  # optimizer step n logs at n
    return 0


def plan(cfg, new_overrides: list[str]) -> Plan:
    """Open the original run, read its record and choose the replay's start; writes nothing."""
    if cfg.get("resume"):
        raise VerifyError("verify: replays a run with reproduce=<run>, not resume=")
    if not cfg.get("reproduce"):
        raise VerifyError("verify: replays a recorded run: give reproduce=<run directory or MLflow run id>")
    rtol = cfg.get("verify_rtol") or 0.0
    if not (math.isfinite(rtol) and rtol >= 0):
        raise VerifyError(f"verify_rtol: must be a finite number ≥ 0 (0 = bit for bit); got {rtol}")
    window = parse_window(cfg.verify_steps) if cfg.get("verify_steps") is not None else None
    new = [o for o in new_overrides if override_key(o) != "reproduce"]
    try:
        source = record.open(str(cfg.reproduce), tracking_uri=lookup_uri(new), out_dir=out_dir(new))
    except record.RecordError as err:
        raise VerifyError(f"reproduce: {err}") from None
    recorded, where = reference(source)
    first = run_start(source, recorded)
    # The replay is named as one (`<name>-verify`), unless this command line names it
    named = [] if any(override_key(o) == "run.name" for o in new) else [
        override("run.name", replay_name(str(source.composed().run.name), 'verify'))]
    if window is None:
        return Plan(source, recorded, where, first, None, named)
    a, b = window
    last = max(step for _, step in recorded)
    if not first < a < b <= last:  # `first` is the state before the run's first update, step first + 1
        raise VerifyError(f"verify_steps: must lie within the steps of run {source.run_id}, {first + 1}:{last}; "
                          f"got {a}:{b}")
    # step a's metrics come from the update after checkpoint a − 1 (optimizer step n logs at n)
    steps = [s for s in listed_steps(checkpoint_dir(source.run_dir)) if first <= s < a]
    overrides = [*named, f"train.stop_after={b}"]
    if steps:  # restores steps[-1], the newest checkpoint below a
        overrides += [override("train.init_from", f"{source.run_dir}@{a - 1}"), "train.init_from_mode=continue"]
    elif a > first + 1:  # else the run's own beginning: its config starts there (fresh, or its own init_from)
        have = listed_steps(checkpoint_dir(source.run_dir))
        raise VerifyError(f"verify_steps: run {source.run_id} has no checkpoint below step {a} to start "
                          f"from (checkpoints: {', '.join(map(str, have)) or 'none'}); start the window at "
                          f"{first} (the run's start) or at a checkpoint")
    # Only the window is compared: the updates from the checkpoint up to step a − 1 are warm-up.
    window_values = {(k, s): v for (k, s), v in recorded.items() if a <= s <= b}
    return Plan(source, window_values, where, a, b, overrides)


# ---------------------------------------------------------------------------- comparing

def same(a: float, b: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b if rtol == 0 else math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def compare(recorded: dict, replayed: dict, rtol: float = 0.0) -> tuple[Divergence | None, int]:
    """(the first divergence, earliest step first, or None; how many values were compared).

    Compared: every (metric, step) both hold. A recorded metric that the replay never logs, at
    a step within the replay's span, is a divergence too (the code logs something else now);
    single missing steps are not (a window's edges log on their own cadence)."""
    if not replayed:
        return None, 0
    names = {k for k, _ in replayed}
    low, high = min(s for _, s in replayed), max(s for _, s in replayed)
    keys = sorted(((k, s) for k, s in recorded if not is_wall_clock(k)
                   and ((k, s) in replayed or (k not in names and low <= s <= high))), key=lambda ks: (ks[1], ks[0]))
    compared = 0
    for key, step in keys:
        if (key, step) not in replayed:
            return Divergence(step, key, recorded[(key, step)], None), compared
        compared += 1
        if not same(recorded[(key, step)], replayed[(key, step)], rtol):
            return Divergence(step, key, recorded[(key, step)], replayed[(key, step)]), compared
    return None, compared


def _diff_text(run: record.RunRecord) -> str:
    path = run.path(record.DIFF)
    return path.read_text() if path.is_file() else ""


def environment_differences(source: record.RunRecord, replay: record.RunRecord) -> list[str]:
    """What differs between two runs' records: git commit and uncommitted changes, packages,
    devices, XLA flags (environment and hardware.xla_flags), Python."""
    was, now = source.info(), replay.info()
    out = []
    commit_was, commit_now = (was.get("git") or {}).get("commit"), (now.get("git") or {}).get("commit")
    if commit_was != commit_now:
        out.append(f"git commit {(commit_was or '?')[:12]} → {(commit_now or '?')[:12]}")
    if _diff_text(source) != _diff_text(replay):
        out.append(f"uncommitted changes differ (compare the {record.DIFF} of both run directories)")
    pw, pn = was.get("packages") or {}, now.get("packages") or {}
    changed = sorted((p for p in set(pw) | set(pn) if pw.get(p) != pn.get(p)), key=lambda p: (p not in WATCHED, p))
    if changed:
        shown = [f"{p} {pw.get(p, 'absent')} → {pn.get(p, 'absent')}" for p in changed[:8]]
        out.append("packages: " + ", ".join(shown) + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else ""))
    dw, dn = was.get("devices") or {}, now.get("devices") or {}
    for name in ("device_kind", "device_count", "backend"):
        if dw.get(name) != dn.get(name):
            out.append(f"{name.replace('_', ' ')} {dw.get(name)} → {dn.get(name)}")
    flags = ((was.get("env") or {}).get("XLA_FLAGS", ""), (now.get("env") or {}).get("XLA_FLAGS", ""))
    if flags[0] != flags[1]:
        out.append(f"XLA_FLAGS {flags[0]!r} → {flags[1]!r}")
    xla_was, xla_now = _xla_flags(source), _xla_flags(replay)
    if xla_was != xla_now:
        out.append(f"hardware.xla_flags {xla_was!r} → {xla_now!r}")
    if was.get("python") != now.get("python"):
        out.append(f"python {was.get('python')} → {now.get('python')}")
    return out


def report(source: record.RunRecord, recorded: dict, where: str, replay: record.RunRecord, rtol: float,
           changed: list[str] = ()) -> int:
    """Compare, print the verdict on stdout, keep it in the replay's directory and MLflow run;
    returns the exit status (0 identical, 1 diverged)."""
    replayed = read_jsonl(replay.run_dir / METRICS) if (replay.run_dir / METRICS).is_file() else {}
    first, compared = compare(recorded, replayed, rtol)
    env = environment_differences(source, replay)
    tolerance = "bit for bit" if rtol == 0 else f"within verify_rtol {rtol:g}"
    if first is None and compared == 0:
        verdict, status = f"verify: nothing to compare: the replay logged no metric that {where} holds", 1
    elif first is None:
        steps = sorted({s for (k, s) in replayed if (k, s) in recorded})
        verdict = (f"verify: identical ({tolerance}): {compared} values of "
                   f"{len({k for k, s in replayed if (k, s) in recorded and not is_wall_clock(k)})} metrics at "
                   f"steps {steps[0]}–{steps[-1]} match {where}")
        status = 0
    else:
        verdict, status = f"verify: first divergence at {first.line(rtol)} (record: {where})", 1
    lines = [verdict, "environment differences: " + ("; ".join(env) if env else "none (git commit, packages, "
                                                     "device kind, XLA flags and Python as recorded)")]
    if changed:
        lines.append("replayed with overrides: " + " ".join(changed))
    print("\n".join(lines), flush=True)
    result = {"verification_of": source.run_id, "result": "identical" if status == 0 else "diverged",
              "compared": compared, "rtol": rtol, "record": where, "environment": env,
              "first_divergence": None if first is None else first.__dict__}
    (replay.run_dir / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    try:
        client = backend.client(replay.tracking_uri)
        client.set_tag(replay.run_id, "verify_result", result["result"])
        if first is not None:
            client.set_tag(replay.run_id, "verify_first_divergence", f"step {first.step} {first.key}")
    except Exception:  # the verdict is printed and in verify.json; the tag is a convenience
        pass
    return status


def _xla_flags(run: record.RunRecord) -> str:
    try:
        return str(run.resolved().hardware.get("xla_flags") or "")
    except Exception:
        return ""


# ---------------------------------------------------------------------------- launch.py

def verify(cfg, job_overrides: list[str]) -> None:
    """launch.py with verify=true: plan, recompose, replay here, compare; exits 0, 1 or 2."""
    try:
        chosen = plan(cfg, job_overrides)
        composed, resolved, overrides = recompose(str(cfg.reproduce), job_overrides, added=chosen.overrides)
    except (VerifyError, ReproduceError) as err:
        fail(str(err) if isinstance(err, VerifyError) else f"reproduce: {err}")
    except ConfigError as err:
        fail(config_errors(err))
    window = f"steps {chosen.first}–{chosen.last}" if chosen.last is not None else "the whole run"
    print(f"verify: replaying {window} of run {chosen.source.run_id}; {len(chosen.reference)} recorded values "
          f"({chosen.where})", file=sys.stderr)
    if resolved.dry_run:
        print_plan(resolved, as_json=resolved.dry_run == "json")
        return
    if resolved.hardware.launcher != "local":
        fail(f"verify: replays in this process (hardware.launcher=local); got {resolved.hardware.launcher}: "
             "run reproduce=<run> there, then python -m marin.launch.verify <run> <replay>")
    from marin.launch.local import run_local  # JAX: the trainer's imports stay off the dry-run path

    apply_environment(resolved.hardware)
    replay = run_local(composed, resolved, overrides)
    changed = [o for o in job_overrides if override_key(o) not in
               ("reproduce", "verify", "verify_steps", "verify_rtol", "tracking.uri", "run.out_dir")]
    sys.exit(report(chosen.source, chosen.reference, chosen.where, replay, resolved.verify_rtol, changed))


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.launch.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("recorded", help="the original run: run directory or MLflow run id")
    parser.add_argument("replay", help="its replay: run directory or MLflow run id")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (0 = bit for bit)")
    args = parser.parse_args(argv)
    try:
        source, replay = record.open(args.recorded), record.open(args.replay)
        recorded, where = reference(source)
    except (record.RecordError, VerifyError) as err:
        fail(first_line(err))
    return report(source, recorded, where, replay, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
