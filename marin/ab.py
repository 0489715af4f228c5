"""`python -m marin.ab <run>@<step> <candidate overrides> [--steps 200] [--both hardware=slurm_cpu]`:
a paired A/B from one checkpoint, as production ran before every cutover (spec §8).

Two forks of the run at that step (marin/launch/fork.py) run as one two-job sweep (`launch.py -m`,
sweep `ab`: here one after the other, or one Slurm array with a Slurm hardware): the control with
no override, the candidate with the given ones, each for `--steps` steps (`train.stop_after`, so
the schedule is the parent's; from a finished parent's last step both go on past it, with
`train.steps` extended alike). The arms are the options `control` and `candidate` of a config
group `ab` written for this A/B under `<run.out_dir>/ab/<id>/` (the candidate's leaves: what its
overrides change), so the sweep machinery needs nothing new and each arm reproduces later.

Then, from the arms' metrics.jsonl: loss, eval loss, dropped fraction, tokens/s, MFU and peak
memory side by side with their differences, whether the control's losses equal the parent's own
at the same steps bit for bit (else the step where they diverge; past the parent's end, a line
or past a parent that stopped early,
a line saying there is nothing to compare), and one verdict line, the last thing printed. Exit 0
when the comparison holds, 1 when the control diverges from the parent or an arm failed, 2 for
bad input (before anything is written).
"""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from marin.cli import Parser, fail, setup_logging
from marin.config.paths import PROJECT_ROOT
from marin.config.store import override
from marin.launch import command_line
from marin.launch.fork import Fork, ForkError, compose
from marin.launch.reproduce import lookup_uri, out_dir
from marin.track import backend, record, secrets
from marin.track.record import flatten
from marin.track.tracker import read_metrics
from marin.train.init_from import InitFromError, split

ARMS = ("control", "candidate")
NOT_ARM_LEAVES = ("run.", "tracking.", "fork", "reproduce", "resume", "dry_run", "wait", "verify")
WARMUP = 1   # the arm's first step compiles: left out of the throughput means
# (label, metric key, how it is summarised over the window)
ROWS = (("loss", "train/loss", "mean"), ("eval loss", "eval/macro_loss", "last"),
        ("dropped fraction", "train/dropped_frac", "mean"), ("tokens/s", "train/tokens_per_s", "steady"),
        ("MFU", "train/mfu", "steady"), ("peak memory GiB", "train/peak_memory_gib", "max"))


@dataclass
class Arm:
    name: str
    run_id: str
    run_dir: Path


def series(run_dir: Path, key: str) -> dict[int, float]:
    """{step: value} of one metric in a run's metrics.jsonl."""
    return {int(row["step"]): row["value"] for row in read_metrics(run_dir) if row.get("key") == key}


def summary(values: dict[int, float], how: str, first: int, last: int) -> float | None:
    window = [values[s] for s in sorted(values) if first <= s <= last]
    if how == "steady":
        window = [values[s] for s in sorted(values) if first + WARMUP <= s <= last] or window
    if not window:
        return None
    return {"mean": sum(window) / len(window), "steady": sum(window) / len(window), "last": window[-1],
            "max": max(window)}[how]


def candidate_leaves(control: Fork, candidate: Fork) -> dict:
    """The composed leaves the candidate's overrides change: its arm of the `ab` group."""
    a, b = flatten(record.config_dict(control.composed)), flatten(record.config_dict(candidate.composed))
    return {k: b.get(k) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith(NOT_ARM_LEAVES)}


def write_arms(folder: Path, leaves: dict) -> None:
    """conf-style folder with group `ab`: control (nothing) and candidate (its leaves, global)."""
    (folder / "ab").mkdir(parents=True, exist_ok=True)
    # 0600, as every file that can hold a config's values (a candidate's hardware.env.* token)
    secrets.write_private(folder / "ab" / "control.yaml", "# @package _global_\n# the control: the parent's config as it was\n{}\n")
    tree: dict = {}
    for key, value in leaves.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    secrets.write_private(folder / "ab" / "candidate.yaml", "# @package _global_\n# the candidate: what its overrides "
                          "change\n" + record.to_yaml(tree))


def divergence(parent: dict[int, float], control: dict[int, float], first: int, last: int) -> tuple[str, bool]:
    """(a line on the control against the parent at the same steps, whether the arms compare: False
    only when the control's loss differs from the parent's at a step both logged). A parent that
    stopped before the window (train.stop_after, Ctrl-C, a preempted job) has nothing to compare
    the control with: said so, and the verdict is still given on the arms."""
    steps = [s for s in range(first, last + 1) if s in control]
    shared = [s for s in steps if s in parent]
    if not shared:
        before = [s for s in parent if s < first]
        stopped = f" (it stopped at step {max(before)})" if before else ""
        return (f"control vs parent: the parent logged no loss at steps {first}…{last}{stopped}: nothing to "
                f"compare the control with"), True
    for s in shared:
        if parent[s] != control[s]:
            return (f"control vs parent: DIVERGE at step {s} (parent {parent[s]!r}, control {control[s]!r}); "
                    f"equal before it" if s > shared[0] else
                    f"control vs parent: DIVERGE at step {s}, the first step (parent {parent[s]!r}, control "
                    f"{control[s]!r})"), False
    more = f" (the parent has no loss past step {shared[-1]})" if len(shared) < len(steps) else ""
    return (f"control vs parent: train/loss bit-for-bit equal at steps {shared[0]}…{shared[-1]} "
            f"({len(shared)} step{'s' if len(shared) != 1 else ''}){more}"), True


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def table(arms: dict[str, Arm], first: int, last: int, out=None) -> dict[str, tuple]:
    """Print the side-by-side table; returns {label: (control, candidate)}."""
    out = out or sys.stdout
    got = {}
    print(f"{'metric':<24}  {'control':>12}  {'candidate':>12}  {'Δ':>12}  {'Δ%':>8}", file=out)
    for label, key, how in ROWS:
        a, b = (summary(series(arms[n].run_dir, key), how, first, last) for n in ARMS)
        got[label] = (a, b)
        delta = None if a is None or b is None else b - a
        pct = f"{100 * delta / a:+.2f}%" if delta is not None and a else "-"
        print(f"{label + ' (' + how + ')':<24}  {_cell(a):>12}  {_cell(b):>12}  "
              f"{'-' if delta is None else f'{delta:+.4g}':>12}  {pct:>8}", file=out)
    return got


def verdict(got: dict, equal: bool, tolerance: float) -> str:
    if not equal:
        return "verdict: inconclusive — the control does not repeat the parent (see above), so the arms do not compare"
    (a, b) = got["loss"]
    if a is None or b is None:
        return "verdict: inconclusive — an arm logged no loss"
    rel = (b - a) / abs(a)
    speed = got["tokens/s"]
    faster = f", tokens/s {100 * (speed[1] - speed[0]) / speed[0]:+.1f}%" if None not in speed and speed[0] else ""
    if rel > tolerance:
        return f"verdict: candidate worse — loss {100 * rel:+.3f}% vs control (tolerance {100 * tolerance:.3f}%){faster}"
    return f"verdict: candidate holds — loss {100 * rel:+.3f}% vs control (tolerance +{100 * tolerance:.3f}%){faster}"


def _arms(sweep_dir: Path) -> dict[str, Arm]:
    found = {}
    path = sweep_dir / "jobs.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        job = json.loads(line)
        for name in ARMS:
            if any(o.lstrip("+").endswith(f"ab={name}") for o in job.get("overrides") or []):
                found[name] = Arm(name, job["run_id"], Path(job["run_dir"]))
    return found


def _run_arms(command: list[str]) -> int:
    """Run the arms' sweep; its exit status. Its log and progress go to stderr; its stdout (each
    arm's fork line and end-of-run summary) to ours as it comes, so on stdout they come before
    the table and the verdict is the last line."""
    sys.stdout.flush()
    with subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=2, text=True) as done:
        for line in done.stdout:
            print(line, end="", flush=True)
    return done.returncode


def sweep_id_override(sid: str) -> str:
    """`run.sweep_id` for the arms' command line, quoted: Hydra reads an unquoted hex id such as
    99e73426 as a number (inf), and the arms would join another sweep than the one looked for."""
    return override("run.sweep_id", sid)


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="python -m marin.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="<run directory or MLflow run id>@<step>")
    p.add_argument("overrides", nargs="*", help="the candidate's overrides (key=value, group=option)")
    p.add_argument("--steps", type=int, default=200, help="steps each arm runs from the checkpoint (default 200)")
    p.add_argument("--both", action="append", default=[], metavar="OVERRIDE",
                   help="an override for both arms, e.g. hardware=slurm_cpu (a Slurm array) or tracking.uri=…")
    p.add_argument("--loss-tolerance", type=float, default=0.001,
                   help="relative loss increase the candidate may show and still hold (default 0.001 = 0.1%%)")
    p.add_argument("--tracking-uri", help="where to look MLflow run ids up (default: $MLFLOW_TRACKING_URI "
                   "or the project's)")
    p.add_argument("--out-dir", help="where run names and prefixes are looked up (default: the project's outputs/)")
    args = p.parse_intermixed_args(argv)  # options before, between or after the overrides
    setup_logging()
    command_line.refuse(["python -m marin.ab", *args.overrides, *args.both],
                        sweep_hint="an A/B compares one candidate: run one A/B for each")
    if args.steps < 1:
        fail(f"--steps: must be a whole number ≥ 1; got {args.steps}")
    if not args.overrides:
        fail("give the candidate's overrides (key=value …): the control is the parent as it was")
    try:
        _, step = split(args.checkpoint)
    except InitFromError as err:
        fail(f"ab: {err}")
    if step is None:
        fail(f"ab: give the checkpoint step: <run directory or MLflow run id>@<step> (got {args.checkpoint!r})")
    first, last = step + 1, step + args.steps
    try:
        parent = record.open(split(args.checkpoint)[0], tracking_uri=args.tracking_uri or lookup_uri(args.both),
                             out_dir=args.out_dir or out_dir(args.both))
    except record.RecordError as err:
        fail(f"ab: {err}")
    spec = f"{parent.run_dir}@{step}"  # found once: the arms' launch.py looks no name up again
    parent_cfg = parent.resolved()
    end = parent_cfg.schedule.horizon_steps or parent_cfg.train.steps
    past_end = step >= end  # from a finished run's last step the arms go on past it
    extend, note = [], None
    if past_end:  # both on one schedule laid out for the longer run (a paired comparison still)
        extend = [f"train.steps={last}"] + (["schedule.horizon_steps=null"] if parent_cfg.schedule.horizon_steps else [])
        note = (f"note: step {step} is run {parent.run_id}'s last: the arms run on past it, steps {first}…{last} "
                f"(train.steps={last} for both)")
    elif last > end:  # otherwise on the parent's schedule, so no further than its last step
        note = f"note: run {parent.run_id} ends at step {end}: the arms run steps {first}…{end}"
        last = end
    shared = [*args.both, *extend, f"train.stop_after={last}"]
    try:  # both arms validated (and the candidate's structure checked) before anything is written
        control = compose(spec, shared)
        candidate = compose(spec, [*shared, *args.overrides])
    except ForkError as err:
        fail(str(err).replace("fork: ", "ab: ", 1))
    if note:  # once the step is known to have a checkpoint
        print(note, file=sys.stderr)
    leaves = candidate_leaves(control, candidate)
    if not leaves:
        fail(f"ab: the candidate's overrides ({' '.join(args.overrides)}) change nothing in run "
             f"{control.parent.run_id}'s config")

    sid = uuid.uuid4().hex[:8]
    out = backend.out_dir(control.resolved)
    arms_dir = out / "ab" / sid
    write_arms(arms_dir, leaves)
    slurm = control.resolved.hardware.launcher == "slurm"
    command = [sys.executable, str(PROJECT_ROOT / "launch.py"), "-m", f"hydra.searchpath=[file://{arms_dir}]",
               "+ab=" + ",".join(ARMS), override("fork", spec), *shared, "run.sweep=ab", sweep_id_override(sid),
               *(["wait=true"] if slurm else [])]
    print(f"paired A/B from {control.parent.run_id}@{step}: {last - step} steps ({first}…{last}), "
          f"{'a Slurm array' if slurm else 'here, one arm after the other'}\n"
          f"  candidate: {' '.join(args.overrides)}\n  arms: {arms_dir / 'ab'}", flush=True)
    returncode = _run_arms(command)
    arms = _arms(out / "sweeps" / f"ab-{sid}")
    if returncode or set(arms) != set(ARMS):
        fail(f"ab: the sweep ab-{sid} did not finish both arms (exit status {returncode}; arms found: "
             f"{', '.join(arms) or 'none'}); see {out / 'sweeps' / f'ab-{sid}'}", code=returncode or 1)

    print(f"\npaired A/B from run {control.parent.run_id} at step {step}, steps {first}…{last}")
    for arm in arms.values():
        print(f"  {arm.name:<9}  run {arm.run_id}  {arm.run_dir}")
    got = table(arms, first, last)
    if past_end:  # said in place of the check, which has nothing to compare
        line, equal = (f"control vs parent: run {parent.run_id} ends at step {end}: no parent steps to compare the "
                       f"control with (the arms ran {first}…{last})"), True
    else:
        line, equal = divergence(series(control.parent.run_dir, "train/loss"),
                                 series(arms["control"].run_dir, "train/loss"), first, last)
    print(line)
    print(verdict(got, equal, args.loss_tolerance), flush=True)
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
