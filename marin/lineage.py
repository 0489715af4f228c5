"""`python -m marin.lineage <run>`: the chain of forks a run descends from, and its stitched curve.

A fork (`launch.py fork=<run>@<step>`, marin/launch/fork.py) says `fork=<parent run id>@<step>`
and `train.init_from=<parent dir>@<step>` in its resolved.yaml; following those back gives the
lineage, oldest first: each run with the steps it was in force for and what it changed against
the run before. A metric of the lineage is stitched: each step takes its value from the run in
force at that step (spec §8), so `--metric train/loss` prints one curve across the cutovers.

`python -m marin.lineage mochi_hero` (a file under conf/lineage/, or `--published`) prints the
published lineage instead: the hero's seven production runs and their cutovers.
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from marin.cli import Parser, fail, setup_logging
from marin.config.paths import CONF_DIR
from marin.config.store import override, shell_join
from marin.track import record
from marin.track.tracker import read_metrics
from marin.train.init_from import Start, split

PUBLISHED_DIR = CONF_DIR / "lineage"


@dataclass
class Link:
    """One run of a lineage: in force for steps from_step+1 … to_step (to_step None: its end)."""
    run_id: str
    run_dir: Path
    name: str
    from_step: int
    to_step: int | None
    changes: dict = field(default_factory=dict)   # {key: [the run before's, this run's]}


def _resolved(run_dir: Path) -> dict:
    return record.load_config_file(run_dir / record.RESOLVED)


def _parent(run_dir: Path, resolved: dict, tracking_uri: str | None,
            out_dir: str | None = None) -> tuple[record.RunRecord, int] | None:
    """The run this one was forked from and the step, or None for a lineage's first run."""
    spec = resolved.get("fork")
    if not spec:
        return None
    ref, step = split(spec)
    parent_dir, _ = split((resolved.get("train") or {}).get("init_from") or "")
    for candidate in (parent_dir, ref):  # the directory as forked; else the run id in its store
        try:
            return record.open(candidate, tracking_uri=tracking_uri, out_dir=out_dir), step
        except record.RecordError:
            continue
    raise record.RecordError(f"{run_dir}: its parent {spec} is not found (neither {parent_dir} nor in the store)")


def last_step(run_dir: Path, key: str = "train/loss") -> int | None:
    steps = [row["step"] for row in read_metrics(run_dir) if row.get("key") == key]
    return max(steps) if steps else None


def chain(ref: str, tracking_uri: str | None = None, out_dir: str | None = None) -> list[Link]:
    """The lineage of the run `ref` (as `record.open` names runs, looked up under `out_dir`),
    oldest first."""
    rec = record.open(ref, tracking_uri=tracking_uri, out_dir=out_dir)
    links: list[Link] = []
    seen = set()
    while rec is not None and rec.run_id not in seen:
        seen.add(rec.run_id)
        resolved = _resolved(rec.run_dir)
        found = _parent(rec.run_dir, resolved, tracking_uri, out_dir)
        step = found[1] if found else 0
        changes = Start(found[0].run_dir / "checkpoints", step, step).changes(OmegaConf.create(resolved)) if found else {}
        links.append(Link(rec.run_id, rec.run_dir, (resolved.get("run") or {}).get("name", "?"), step, None, changes))
        rec = found[0] if found else None
    links.reverse()
    for before, after in zip(links, links[1:]):
        before.to_step = after.from_step
    links[-1].to_step = last_step(links[-1].run_dir)
    return links


def stitch(links: list[Link], key: str = "train/loss") -> list[tuple[int, float, str]]:
    """[(step, value, run id)] of `key` across the lineage: each step from the run in force then."""
    out = {}
    for link in links:
        for row in read_metrics(link.run_dir):
            step = row.get("step")
            if row.get("key") == key and step > link.from_step and (link.to_step is None or step <= link.to_step):
                out[step] = (step, row["value"], link.run_id)
    return [out[s] for s in sorted(out)]


def unlogged(links: list[Link], key: str, shown: int = 12) -> str:
    """Why `key` stitched to nothing: no run of the lineage logged it; the nearest keys they did."""
    logged = sorted({row["key"] for link in links for row in read_metrics(link.run_dir) if "key" in row})
    near = difflib.get_close_matches(key, logged, n=3, cutoff=0.5)
    listed = ", ".join(logged[:shown]) + (f" (+{len(logged) - shown} more)" if len(logged) > shown else "")
    return ("no run of the lineage logged it; " + (f"did you mean {' / '.join(near)}? " if near else "")
            + f"logged: {listed or 'nothing yet'}")


def describe(changes: dict) -> str:
    return "; ".join(f"{k}: {a} → {b}" for k, (a, b) in changes.items()) or "none"


def print_chain(links: list[Link], out=None) -> None:
    out = out or sys.stdout
    print(f"lineage of run {links[-1].run_id}: {len(links)} run{'s' if len(links) != 1 else ''}", file=out)
    width = max(len(link.name) for link in links)
    for i, link in enumerate(links):
        steps = f"{link.from_step}–{'' if link.to_step is None else link.to_step}"
        what = "first run" if i == 0 else f"forked at {link.from_step}: {describe(link.changes)}"
        print(f"  {link.name:<{width}}  {link.run_id}  steps {steps:<13}  {what}", file=out)
        print(f"  {'':<{width}}  {link.run_dir}", file=out)


def published(name: str) -> dict | None:
    """The published lineage `name` (a file of conf/lineage/, by its stem; a path such as `../x`
    names none: no other YAML is read)."""
    if name not in {f.stem for f in PUBLISHED_DIR.glob("*.yaml")}:
        return None
    return yaml.safe_load((PUBLISHED_DIR / f"{name}.yaml").read_text())


def print_published(data: dict, out=None) -> None:
    out = out or sys.stdout
    runs = data["runs"]
    print(f"published lineage {data['name']}: {len(runs)} runs, each forked from a checkpoint step of the one "
          f"before (conf/lineage/{data['name']}.yaml)", file=out)
    width = max(len(r["run"]) for r in runs)
    for r in runs:
        steps = f"{r['from_step']:,}–{'' if r.get('to_step') is None else format(r['to_step'], ',')}"
        print(f"  {r['run']:<{width}}  steps {steps:<17}  {r['changed']}", file=out)
    print("as commands (each run ends at its cutover with a checkpoint there, train.stop_at, which the next "
          "forks):", file=out)
    print(f"  {data['launch']}{_stop_at(runs[0])}", file=out)
    for before, r in zip(runs, runs[1:]):
        print("  " + shell_join(["python", "launch.py", override("fork", f"{before['run']}@{r['from_step']}"),
                                 override("run.name", r["run"]), *(r.get("overrides") or [])]) + _stop_at(r), file=out)


def _stop_at(run: dict) -> str:
    """` train.stop_at=<to_step>`: the cutovers are not checkpoint steps (spec §9), so a run of the
    lineage stops, with a checkpoint, exactly where the next one forks; none for the last."""
    return "" if run.get("to_step") is None else f" train.stop_at={run['to_step']}"


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="python -m marin.lineage", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run (its directory, name, a unique prefix or MLflow run id); or a published "
                   "lineage (conf/lineage/<name>.yaml)")
    p.add_argument("--published", action="store_true", help="read `run` as a published lineage's name")
    p.add_argument("--metric", help="also print this metric stitched across the lineage (e.g. train/loss)")
    p.add_argument("--every", type=int, default=1, metavar="N",
                   help="with --metric: every Nth step (and the last), for a long run (default 1: every step)")
    p.add_argument("--csv", action="store_true", help="with --metric: only the stitched curve, as CSV "
                   "(step,value,run_id) on stdout, for a spreadsheet or a plot")
    p.add_argument("--tracking-uri", help="where to look MLflow run ids up (default: $MLFLOW_TRACKING_URI "
                   "or the project's)")
    p.add_argument("--out-dir", help="where run names and prefixes are looked up (default: the project's outputs/)")
    args = p.parse_args(argv)
    setup_logging()
    data = published(args.run)
    if args.published or (data is not None and not Path(args.run).exists()):
        if data is None:
            names = ", ".join(sorted(f.stem for f in PUBLISHED_DIR.glob("*.yaml"))) or "none"
            fail(f"lineage: no published lineage {args.run!r} (conf/lineage/: {names})")
        print_published(data)
        return
    if args.every < 1:
        fail(f"--every: must be a whole number ≥ 1; got {args.every}")
    if args.csv and not args.metric:
        fail("--csv: give the metric to write (--metric train/loss)")
    try:
        links = chain(args.run, args.tracking_uri, args.out_dir)
    except record.RecordError as err:
        fail(f"lineage: {err}")
    stitched = stitch(links, args.metric) if args.metric else []
    if args.metric and not stitched:
        fail(f"--metric {args.metric}: {unlogged(links, args.metric)}")
    points = thinned(stitched, args.every)
    if args.csv:
        print("step,value,run_id")
        for step, value, run_id in points:
            print(f"{step},{value!r},{run_id}")
        return
    print_chain(links)
    if args.metric:
        every = f", shown every {args.every} steps and the last" if args.every > 1 else ""
        print(f"{args.metric}, stitched: {len(stitched)} steps{every}")
        for step, value, run_id in points:
            print(f"  {step:>8}  {value!r:<22}  {run_id}")


def thinned(points: list, every: int) -> list:
    """Every `every`th point by step (steps divisible by it) and the last one."""
    if every <= 1:
        return points
    kept = [pt for pt in points if pt[0] % every == 0]
    return kept + [points[-1]] if points and (not kept or kept[-1] is not points[-1]) else kept


if __name__ == "__main__":
    main()
