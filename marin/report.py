"""`python -m marin.report <run or sweep>`: one self-contained HTML page about a run or a sweep.

The page and its figures are drawn by marin/track/report.py (what it shows is described there).
The loop writes a run's page at the end of every run (`<run dir>/report.html`, and the MLflow
artifact `report.html`); this command writes it again at any time (a sweep's goes to its sweep
directory and its parent run).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from marin.cli import Parser, fail, output_file
from marin.track import backend, record, refs, sweep
from marin.track.errors import first_line
from marin.track.report import REPORT, write_run_report, write_sweep_report

# ---------------------------------------------------------------------------- command line

def _open(ref: str, tracking_uri: str | None, out_dir: str | None):
    """("sweep", (client, parent)) or ("run", record) for a sweep or run reference (`marin.track.refs`)."""
    if refs.names_sweep(ref, out_dir):
        return "sweep", refs.open_sweep(ref, tracking_uri, out_dir)
    try:
        return "run", record.open(ref, tracking_uri=tracking_uri, out_dir=Path(out_dir) if out_dir else None)
    except record.RecordError as run_err:
        if not re.fullmatch(r"[0-9a-f]{32}", ref):
            raise
        try:  # a run id that is a sweep's parent (it has no run directory)
            return "sweep", sweep.open_parent(ref, tracking_uri, out_dir)
        except sweep.SweepNotFound:
            raise run_err from None


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="a run (its directory, its name under outputs/runs/ or its MLflow run id) "
                        "or a sweep (its name, directory or parent run id)")
    parser.add_argument("--out", type=Path, help="where to write the page (default: report.html in the run's "
                        "or sweep's directory)")
    parser.add_argument("--no-log", action="store_true", help="do not log the page to MLflow")
    parser.add_argument("--tracking-uri", help="default: the run's, $MLFLOW_TRACKING_URI or the project's")
    parser.add_argument("--out-dir", help="where run and sweep names are looked up (default: the project's outputs/)")
    args = parser.parse_args(argv)
    args.out = output_file(args.out, REPORT)
    try:
        kind, found = _open(args.target, args.tracking_uri, args.out_dir)
        if kind == "sweep":
            path = write_sweep_report(*found, out=args.out, log_to_mlflow=not args.no_log)
        else:
            path = write_run_report(found, out=args.out, log_to_mlflow=not args.no_log)
    except (record.RecordError, sweep.SweepNotFound, backend.TrackingUnavailable) as err:
        fail(first_line(err))
    except Exception as err:  # the store answered with an error, a damaged file
        fail(f"{args.target}: {type(err).__name__}: {first_line(err)}")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
