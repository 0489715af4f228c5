"""`python -m marin.ctl checkpoint <run>`: ask a running run for a checkpoint now; it goes on training.

The run's processes listed themselves in `<run dir>/processes/` (marin.train.preempt.announce).
Under Slurm the job's tasks get SIGUSR1 from `scancel --signal=USR1 <job>` (every task of its
steps, not the batch shell, which would die of it); a process on this machine gets it from
`kill`. A listed process is signalled only if it is still the one that wrote the file (same host,
same kernel start time, and it holds the file open), so a reused pid or an entry naming another
program is never hit. At the next step boundary the run writes
a checkpoint, verifies it against its manifests and says so (`forced checkpoint at step N written
and verified`) on process 0's stderr (the Slurm task's log) and in run.log where process 0 keeps it
(a local run), with the MLflow tag `checkpoint.forced` (marin.train.components.confirm_forced).

A run that is not running (finished, or its processes gone) is one `error:` line, exit 2.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from marin.cli import Parser, fail
from marin.track import record
from marin.track.errors import first_line
from marin.train.preempt import CHECKPOINT_SIGNAL, PROCESSES, holds, process_start


def listed(run_dir: Path) -> list[dict]:
    """The process entries the run wrote (unreadable ones are skipped: a write in flight), each
    with the file it came from (`path`)."""
    entries = []
    for path in sorted((run_dir / PROCESSES).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(entry, dict):
            entries.append({**entry, "path": path})
    return entries


def slurm_running(job: str) -> bool:
    try:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.split()[:1] == ["RUNNING"]


def alive_here(entry: dict) -> bool:
    """The listed process runs on this machine, is the one that wrote the entry (pid, start time)
    and is this run's trainer: it still holds its entry open (preempt.announce). A pid, host and
    start time can be copied into the file from any process; the open file cannot."""
    pid = entry.get("pid")
    return (entry.get("host") == socket.gethostname() and isinstance(pid, int) and entry.get("started") is not None
            and process_start(pid) == entry["started"] and "path" in entry and holds(pid, entry["path"]))


def ask_checkpoint(run_dir: Path) -> str:
    """Signal the run's processes; returns what was signalled. Raises LookupError when none runs."""
    entries = listed(run_dir)
    jobs = sorted({e["slurm_job"] for e in entries if e.get("slurm_job")})
    running = [job for job in jobs if slurm_running(job)]
    if running:
        for job in running:
            done = subprocess.run(["scancel", f"--signal={CHECKPOINT_SIGNAL.name.removeprefix('SIG')}", job],
                                  capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise LookupError(f"scancel --signal=USR1 {job} failed: {done.stderr.strip() or done.returncode}")
        return f"Slurm job {', '.join(running)} (scancel --signal=USR1)"
    pids = [e["pid"] for e in entries if not e.get("slurm_job") and alive_here(e)]
    if not pids:
        raise LookupError(f"{run_dir}: no running process of this run (none listed in {PROCESSES}/ is alive"
                          f"{' on this machine' if entries else ''}); a checkpoint needs a running run")
    for pid in pids:
        os.kill(pid, CHECKPOINT_SIGNAL)
    return f"process{'es' if len(pids) > 1 else ''} {', '.join(map(str, pids))} ({signal.Signals(CHECKPOINT_SIGNAL).name})"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.ctl", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    ask = commands.add_parser("checkpoint", help="a checkpoint at the next step boundary, verified and logged; "
                              "the run continues")
    ask.add_argument("run", help="its directory, its name under outputs/runs/ or its MLflow run id")
    ask.add_argument("--tracking-uri", help="where a run id is looked up (default: $MLFLOW_TRACKING_URI or the project's)")
    ask.add_argument("--out-dir", help="where run names are looked up (default: the project's outputs/)")
    args = parser.parse_args(argv)
    try:
        rec = record.open(args.run, tracking_uri=args.tracking_uri, out_dir=Path(args.out_dir) if args.out_dir else None)
        signalled = ask_checkpoint(Path(rec.run_dir))
    except (record.RecordError, LookupError) as err:
        fail(first_line(err))
    except Exception as err:  # noqa: BLE001 — the store answered with an error: one line
        fail(f"{args.run}: {type(err).__name__}: {first_line(err)}")
    print(f"asked {rec.run_dir} for a checkpoint: {signalled}; at the next step boundary it is written, verified "
          f"and logged (\"forced checkpoint at step N\", MLflow tag checkpoint.forced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
