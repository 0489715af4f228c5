"""`python -m marin.status [sweep or run]`: sweeps and runs at a glance.

With no argument: the newest sweeps (state, jobs ended, best loss) and runs (state, step N of
M, train and eval loss) under the output folder. A sweep (`marin.track.refs`: its name — the
newest of that name —, directory, a unique prefix of either, or its parent's run id or a prefix)
prints each job (the overrides that make it differ) with its MLflow state, Slurm state, step N
of M and its latest train and eval loss; a run (directory, name, id or unique prefix,
`<sweep>/<job>`) prints its own row. `--watch [SECONDS]` prints the table again every SECONDS
until Ctrl-C (`--count N`: N times).

The list, a sweep's table and a run's row are read from the run directories (record.json,
metrics.jsonl: marin.track.runfiles; a sweep's sweep.json and jobs.jsonl), without MLflow;
`--mlflow` asks the store instead (its status of a killed run, which the directory cannot know;
Slurm's view reconciled into it, which writes to the store).

A job Slurm has not started yet (squeue) shows PENDING; jobs a sweep expects that have no run
yet are counted under the table. Reconciles Slurm's view: a job that Slurm ended badly (CANCELLED,
OUT_OF_MEMORY, TIMEOUT, FAILED, …) while its MLflow run still says RUNNING never got to finish
its run, so the run is marked FAILED. The parent run is closed once every job has ended.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from marin import lineage
from marin.cli import Parser, fail
from marin.track import backend, record, refs, runfiles, runstate, sweep
from marin.track.errors import first_line
from marin.track.tracker import catch_up_command

SLURM_FAILED = ("CANCELLED", "OUT_OF_MEMORY", "TIMEOUT", "FAILED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")
LOSS = "train/loss"
EVAL_LOSS = "eval/macro_loss"  # the mean over every eval set (marin.train.components.Evaluator)
RECENT = 8                     # sweeps and runs listed without an argument


@dataclass
class Job:
    run_id: str
    label: str
    state: str
    slurm_job: str | None
    slurm_state: str | None
    step: int | None      # steps done (the last logged step: optimizer step n logs at n)
    loss: float | None
    total: int | None = None  # the run's last step (its horizon; train.stop_after stops short of it)
    eval_loss: float | None = None
    restarts: int = 0     # the job requeued itself after a task died (marin/launch/restarts.py)


def slurm_job_of(run) -> str | None:
    """The child's Slurm job: its slurm_job_id tag, else the newest in its record.json."""
    if run.data.tags.get("slurm_job_id"):
        return run.data.tags["slurm_job_id"]
    run_dir = run.data.tags.get("run_dir")
    try:
        jobs = json.loads((Path(run_dir) / record.INFO).read_text()).get("slurm_jobs") or []
    except (OSError, TypeError, ValueError):
        return None
    return str(jobs[-1]) if jobs else None


def _table(command: list[str]) -> dict[str, str]:
    """{job id: state} from a `JobID|State` listing (first word: "CANCELLED by 0" → CANCELLED)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in done.stdout.splitlines():
        job, _, state = line.partition("|")
        if state:
            states[job.strip()] = state.split()[0]
    return states


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: state}: squeue for the jobs still queued (accounting may not list a job that has
    not started: PENDING comes from squeue), sacct for the others; {} without Slurm."""
    if not job_ids:
        return {}
    states = _table(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(job_ids)])
    ended = [j for j in job_ids if j not in states]
    if ended:
        states.update(_table(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ended)]))
    return states


def _latest(client, run_id: str, key: str) -> tuple[int | None, float | None]:
    history = client.get_metric_history(run_id, key)
    if not history:
        return None, None
    last = max(history, key=lambda m: (m.step, m.timestamp))
    return last.step, last.value


def job_row(client, run, label: str, states: dict[str, str]) -> Job:
    """One run's row; a run whose Slurm job ended badly while MLflow says RUNNING is marked FAILED,
    one whose job has not started shows PENDING."""
    run_id, status = run.info.run_id, run.info.status
    slurm_job = slurm_job_of(run)
    slurm_state = states.get(slurm_job) if slurm_job else None
    if slurm_state in SLURM_FAILED and status not in sweep.TERMINAL:
        client.set_tag(run_id, "slurm_state", slurm_state)
        client.set_terminated(run_id, "FAILED")
        status = "FAILED"
    elif slurm_state == "PENDING" and status not in sweep.TERMINAL:
        status = "PENDING"  # submitted (its MLflow run made at submit time), not started
    step, loss = _latest(client, run_id, LOSS)
    status = runstate.state(status, run.data.tags)  # STOPPED: train.stop_after ended it short
    return Job(run_id, label, status, slurm_job, slurm_state, step, loss, runstate.last_step(run.data.params, run.data.tags),
               run.data.metrics.get(EVAL_LOSS), int(run.data.tags.get("restarts") or 0))


def file_row(run: runfiles.RunFiles, label: str, states: dict[str, str]) -> Job:
    """One run's row from its directory: as `job_row`, but shown only (nothing is written)."""
    slurm_job = run.slurm_jobs[-1] if run.slurm_jobs else None
    slurm_state = states.get(slurm_job) if slurm_job else None
    state = run.state
    if state not in sweep.TERMINAL and state != "STOPPED":
        state = "FAILED" if slurm_state in SLURM_FAILED else "PENDING" if slurm_state == "PENDING" else state
    return Job(run.run_id, label, state, slurm_job, slurm_state, run.step, run.value(LOSS), run.total,
               run.value(EVAL_LOSS), int(run.info.get("restarts") or 0))


def files_row(run_dir: Path, label: str) -> Job:
    run = runfiles.read(run_dir)
    job = run.slurm_jobs[-1] if run.slurm_jobs else None
    return file_row(run, label, slurm_states([job] if job else []))


def reconcile(client, parent) -> tuple[list[Job], str | None]:
    """The jobs of the sweep, after marking FAILED the runs whose Slurm job ended badly; and the
    status the parent was closed with (None if it stays open)."""
    kids = sweep.children(client, parent)
    states = slurm_states(sorted({j for j in map(slurm_job_of, kids) if j}))
    jobs = [job_row(client, kid, sweep.child_name(json.loads(kid.data.tags.get("sweep_overrides", "[]")))
                    or kid.info.run_name, states) for kid in kids]
    closed = sweep.close_if_done(client, parent.info.run_id)
    return jobs, closed


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def print_jobs(jobs: list[Job], out, head: str = "job") -> None:
    width = max([len(j.label) for j in jobs] + [len(head)])
    on_slurm = any(j.slurm_job for j in jobs)  # the Slurm column only for runs that use it
    slurm_head = f"{'slurm':<22}  " if on_slurm else ""
    restarted = any(j.restarts for j in jobs)  # the restarts column only when a job has restarted
    print(f"{head:<{width}}  {'state':<9}  {slurm_head}{'restarts  ' if restarted else ''}{'step':>11}  {'loss':>8}  "
          f"{'eval':>8}  run", file=out)
    for j in jobs:
        slurm = (f"{j.slurm_job} {j.slurm_state or ''}".strip() if j.slurm_job else "-") if on_slurm else ""
        slurm = (f"{slurm:<22}  " if on_slurm else "") + (f"{j.restarts:>8}  " if restarted else "")
        step = f"{'-' if j.step is None else j.step}/{'?' if j.total is None else j.total}"
        print(f"{j.label:<{width}}  {j.state:<9}  {slurm}{step:>11}  {_cell(j.loss):>8}  {_cell(j.eval_loss):>8}  "
              f"{j.run_id}", file=out)


def ended_of(ended: int, expected, made: int) -> str:
    """`N/M jobs ended`, as the sweep's header and its line in the list both say it: M the jobs
    the sweep expects (or the runs made, when more or when it does not say)."""
    return f"{ended}/{max(int(expected or 0), made)} jobs ended"


def print_table(parent, jobs: list[Job], closed: str | None, out=None) -> None:
    out = out or sys.stdout
    tags = parent.data.tags
    expected = tags.get("expected_jobs")
    ended = sum(j.state in (*sweep.TERMINAL, "STOPPED") for j in jobs)
    print(f"sweep {tags.get('sweep')} ({tags.get('sweep_id')}): parent run {parent.info.run_id} "
          f"{parent.info.status}, {ended_of(ended, expected, len(jobs))}", file=out)
    print_jobs(jobs, out)
    if expected and int(expected) > len(jobs):
        print(f"{int(expected) - len(jobs)} job(s) pending: not started, no run made yet", file=out)
    if closed:
        print(f"every job has ended: parent run closed {closed}", file=out)


# ---------------------------------------------------------------------------- what is shown

def _client(uri: str, clients: dict):
    if uri not in clients:
        backend.check_reachable(uri, create=False)   # a reader: never makes a store
        clients[uri] = backend.client(uri, create=False)
    return clients[uri]


def show_sweep(ref: str, args, out) -> None:
    if not getattr(args, "mlflow", False):
        try:
            folder = refs.find_sweep(ref, args.out_dir)
        except refs.RefError:
            folder = None
        if isinstance(folder, Path):
            return show_sweep_from_files(folder, out)
    client, parent = refs.open_sweep(ref, args.tracking_uri, args.out_dir)
    jobs, closed = reconcile(client, parent)
    print_table(client.get_run(parent.info.run_id), jobs, closed, out)


def show_run(rec: record.RunRecord, out, from_store: bool = False) -> None:
    if from_store:
        client = _client(rec.tracking_uri, {})
        run = client.get_run(rec.run_id)
        job = slurm_job_of(run)
        row = job_row(client, run, rec.run_dir.name, slurm_states([job] if job else []))
    else:
        row = files_row(rec.run_dir, rec.run_dir.name)
    print(f"run {rec.run_dir}", file=out)
    print_jobs([row], out, head="run")
    show_lineage(rec, out)


def show_lineage(rec: record.RunRecord, out) -> None:
    """A fork's chain back to its first run and its loss stitched across it (marin.lineage)."""
    try:
        links = lineage.chain(str(rec.run_dir), rec.tracking_uri)
    except (record.RecordError, OSError, ValueError) as err:  # a parent gone, a damaged file: one line
        print(f"lineage: {first_line(err)}", file=out)
        return
    if len(links) < 2:
        return
    lineage.print_chain(links, out)
    points = lineage.stitch(links, LOSS)
    if points:
        step, value, run_id = points[-1]
        print(f"{LOSS} stitched across the lineage: {len(points)} steps, latest {value:.4f} at step {step} "
              f"(run {run_id})", file=out)


def show_recent(args, out, last: int = RECENT) -> None:
    """The newest sweeps and the newest runs outside a sweep, each with its state from its store."""
    clients: dict = {}
    sweeps = refs.sweep_dirs(args.out_dir)[:last]
    runs = [d for d in refs.run_dirs(args.out_dir) if not refs.read_json(d / record.INFO).get("sweep")][:last]
    if not sweeps and not runs:
        print(f"no sweeps or runs under {refs.out_root(args.out_dir)} yet", file=out)
        return
    from_store = getattr(args, "mlflow", False)
    if sweeps:
        print("sweeps (python -m marin.status <sweep> for its jobs):", file=out)
        width = max(len(d.name) for d in sweeps)
        for folder in sweeps:
            line = _sweep_line(folder, args, clients) if from_store else _sweep_line_from_files(folder)
            print(f"  {folder.name:<{width}}  {line}", file=out)
    if runs and not from_store:
        print("runs (python -m marin.status <run> for one; a unique prefix of its name or id will do):", file=out)
        rows = [files_row(run_dir, run_dir.name) for run_dir in runs]
        print_jobs(rows, out, head="run")
        for run_dir, row in zip(runs, rows):
            if row.state == "FAILED" and not refs.read_json(run_dir / record.INFO).get("status"):
                print(f"  ({run_dir.name}: its trainer was killed before it ended; MLflow shows it RUNNING until "
                      f"{catch_up_command(run_dir)})", file=out)
    elif runs:
        rows, notes = [], []
        for run_dir in runs:
            info = refs.read_json(run_dir / record.INFO)
            try:
                client = _client(args.tracking_uri or info.get("tracking_uri") or backend.default_uri(), clients)
                run = client.get_run(info["run_id"])
                job = slurm_job_of(run)
                rows.append(job_row(client, run, run_dir.name, slurm_states([job] if job else [])))
            except Exception as err:  # a store that is gone or does not know the run: its record's word
                rows.append(Job(info.get("run_id", "?"), run_dir.name, (info.get("status") or "?")[:9],
                                None, None, None, None))
                notes.append(f"{run_dir.name}: {first_line(err)}")
        print("runs (python -m marin.status <run> for one; a unique prefix of its name or id will do):", file=out)
        print_jobs(rows, out, head="run")
        for note in notes:
            print(f"  ({note})", file=out)


def _sweep_jobs(folder: Path) -> list[dict]:
    """The jobs of a sweep directory's jobs.jsonl, one per run (a requeued job may add a line)."""
    jobs: dict = {}
    for job in runfiles.json_lines(folder / "jobs.jsonl"):
        try:
            if job.get("run_dir"):
                jobs[job["run_id"]] = job
        except (KeyError, TypeError, AttributeError):
            continue
    return list(jobs.values())


def sweep_from_files(folder: Path) -> tuple[dict, list[Job], str]:
    """A sweep's sweep.json, its jobs' rows from their run directories (Slurm's view shown, not
    written) and its state as its parent run would have it."""
    info = refs.read_json(folder / "sweep.json")
    runs = [(job, runfiles.read(job["run_dir"])) for job in _sweep_jobs(folder)]
    slurm = slurm_states(sorted({run.slurm_jobs[-1] for _, run in runs if run.slurm_jobs}))
    jobs = [file_row(run, sweep.child_name(job.get("overrides") or []) or Path(job["run_dir"]).name, slurm)
            for job, run in runs]
    ended = sum(j.state in (*sweep.TERMINAL, "STOPPED") for j in jobs)
    states = {j.state for j in jobs}
    state = ("RUNNING" if not jobs or ended < max(int(info.get("expected_jobs") or 0), len(jobs))
             else "FINISHED" if states <= {"FINISHED", "STOPPED"} else "FAILED" if "FAILED" in states else "KILLED")
    return info, jobs, state


def show_sweep_from_files(folder: Path, out) -> None:
    """`print_table`'s view from the sweep's directory: no MLflow start-up (`--mlflow` reconciles
    Slurm's view into the store)."""
    info, jobs, state = sweep_from_files(folder)
    ended = sum(j.state in (*sweep.TERMINAL, "STOPPED") for j in jobs)
    print(f"sweep {info.get('sweep')} ({info.get('sweep_id')}): parent run {info.get('parent_run_id')} {state}, "
          f"{ended_of(ended, info.get('expected_jobs'), len(jobs))}", file=out)
    print_jobs(jobs, out)
    expected = int(info.get("expected_jobs") or 0)
    if expected > len(jobs):
        print(f"{expected - len(jobs)} job(s) pending: not started, no run made yet", file=out)


def _sweep_line_from_files(folder: Path) -> str:
    """As `_sweep_line`, from the sweep's directory and its jobs' run directories."""
    info, jobs, state = sweep_from_files(folder)
    ended = sum(j.state in (*sweep.TERMINAL, "STOPPED") for j in jobs)
    best = min((j for j in jobs if j.loss is not None), key=lambda j: j.loss, default=None)
    best = f"  best loss {best.loss:.4f} ({best.label})" if best else ""
    return f"{state:<9}  {ended_of(ended, info.get('expected_jobs'), len(jobs))}{best}"


def _sweep_line(folder: Path, args, clients: dict) -> str:
    """A sweep's parent state, jobs ended of expected and its best (lowest) latest loss."""
    info = refs.read_json(folder / "sweep.json")
    try:
        client = _client(args.tracking_uri or info.get("tracking_uri") or backend.default_uri(), clients)
        parent = client.get_run(info["parent_run_id"])
        kids = sweep.children(client, parent)
    except Exception as err:
        return f"? ({first_line(err)})"
    ended = sum(k.info.status in sweep.TERMINAL for k in kids)
    expected = parent.data.tags.get("expected_jobs")
    losses = [(k.data.metrics[LOSS], k) for k in kids if LOSS in k.data.metrics]
    best = ""
    if losses:
        value, kid = min(losses, key=lambda pair: pair[0])
        best = f"  best loss {value:.4f} ({sweep.child_name(json.loads(kid.data.tags.get('sweep_overrides', '[]'))) or kid.info.run_name})"
    return f"{parent.info.status:<9}  {ended_of(ended, expected, len(kids))}{best}"


def render(args) -> str:
    """One table as text (raises what the lookups raise)."""
    out = io.StringIO()
    if args.target is None:
        show_recent(args, out, args.last)
    elif not args.target.strip():  # Path("") would be the working directory
        raise record.RecordError("the run or sweep is empty: give its name, directory or id (none: every run)")
    elif refs.names_sweep(args.target, args.out_dir):
        show_sweep(args.target, args, out)
    else:
        try:
            rec = record.open(args.target, tracking_uri=args.tracking_uri, out_dir=args.out_dir)
        except record.RecordError as run_err:
            try:  # not a run here: a sweep's parent id, or a name that is neither (the sweep's message)
                show_sweep(args.target, args, out)
            except sweep.SweepNotFound as sweep_err:
                if (Path(args.target).expanduser() / record.INFO).is_file():
                    raise run_err from None   # a run directory whose files are damaged: the run's message
                if Path(args.target).expanduser().is_dir():
                    raise record.RecordError(f"{args.target}: neither a run directory ({record.INFO}) nor a "
                                             "sweep directory (sweep.json)") from None
                if "/" in args.target or "give more of it" in str(run_err):  # a job of a sweep; an ambiguous prefix
                    raise run_err from None
                if refs.FULL_ID.fullmatch(args.target):
                    raise sweep_err from None
                raise record.RecordError(f"{args.target}: no sweep or run of that name, or a unique prefix of one, "
                                         f"under {refs.out_root(args.out_dir)}") from None
        else:
            show_run(rec, out, getattr(args, "mlflow", False))
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.status", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", help="a sweep (its name, directory or parent run id, or a unique prefix) "
                        "or a run (directory, name, run id or a unique prefix; <sweep>/<job>); none: the newest of both")
    parser.add_argument("--watch", nargs="?", type=float, const=10.0, metavar="SECONDS",
                        help="print the table again every SECONDS (default 10) until Ctrl-C")
    parser.add_argument("--count", type=int, help="with --watch: stop after this many tables")
    parser.add_argument("--last", type=int, default=RECENT, help=f"without an argument: how many sweeps and runs (default {RECENT})")
    parser.add_argument("--tracking-uri", help="default: the sweep's or run's, $MLFLOW_TRACKING_URI or the project's")
    parser.add_argument("--out-dir", help="where names are looked up (default: the project's outputs/)")
    parser.add_argument("--mlflow", action="store_true", help="the list and a run's row from the MLflow store "
                        "(default: from the run directories, without starting MLflow); a sweep's table from the store, Slurm's "
                        "view of its jobs reconciled into it")
    args = parser.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        fail(f"--watch: the interval must be more than 0 seconds; got {args.watch:g}")
    shown = 0
    try:
        while True:
            try:
                text = render(args)
            except (sweep.SweepNotFound, record.RecordError, backend.TrackingUnavailable) as err:
                fail(first_line(err))
            except Exception as err:  # the store answered with an error
                fail(f"{args.target or refs.out_root(args.out_dir)}: {first_line(err)}")
            if args.watch is not None and sys.stdout.isatty():
                print("\033[H\033[2J", end="")  # a refreshed screen, not a scrolling log
            elif shown:
                print()
            print(text, end="", flush=True)
            shown += 1
            if args.watch is None or (args.count is not None and shown >= args.count):
                return 0
            print(f"(every {args.watch:g} s; Ctrl-C ends; {time.strftime('%H:%M:%S')})", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
