"""`python -m marin.diff <run A> <run B>`: the config leaves that differ between two runs.

A run is a run directory (or its name under outputs/runs/) or an MLflow run id. The resolved
configs are compared (what was trained); a leaf whose composed value was ``auto`` is marked
``(derived)``. Exit status: 0 same config, 1 different, 2 a run could not be opened.
"""
from __future__ import annotations

import sys

from omegaconf import OmegaConf

from marin.cli import Parser, fail
from marin.track import record
from marin.track.errors import first_line
from marin.track.record import flatten

BOOKKEEPING = ("run.", "tracking.", "reproduce", "resume", "dry_run", "wait")


def leaves(rec: record.RunRecord, which: str) -> dict:
    config = rec.composed() if which == "composed" else rec.resolved()
    return flatten(OmegaConf.to_container(config, resolve=True))


def differences(a: record.RunRecord, b: record.RunRecord, which: str = "resolved",
                bookkeeping: bool = False) -> list[tuple[str, object, object, bool]]:
    """(key, value in A, value in B, derived) for every differing leaf, sorted by key."""
    la, lb = leaves(a, which), leaves(b, which)
    ca, cb = leaves(a, "composed"), leaves(b, "composed")
    missing = "<absent>"
    rows = []
    for key in sorted(set(la) | set(lb)):
        if not bookkeeping and key.startswith(BOOKKEEPING):
            continue
        va, vb = la.get(key, missing), lb.get(key, missing)
        if va != vb:
            rows.append((key, va, vb, ca.get(key) == "auto" or cb.get(key) == "auto"))
    return rows


def _short(value, width: int = 40) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.diff", description=__doc__.split("\n")[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--composed", action="store_true", help="compare the configs as composed (with auto)")
    parser.add_argument("--all", action="store_true", help="include run.*, tracking.* and control leaves")
    parser.add_argument("--tracking-uri", help="where to look MLflow run ids up (default: $MLFLOW_TRACKING_URI "
                        "or the project's sqlite store)")
    args = parser.parse_args(argv)
    try:
        a = record.open(args.run_a, tracking_uri=args.tracking_uri)
        b = record.open(args.run_b, tracking_uri=args.tracking_uri)
        rows = differences(a, b, "composed" if args.composed else "resolved", bookkeeping=args.all)
    except record.RecordError as err:
        fail(first_line(err))
    except (OSError, ValueError) as err:  # a damaged run directory
        fail(f"cannot read the runs' configs: {first_line(err)}")
    print(f"A: {a.run_dir.name}  ({a.run_id})")
    print(f"B: {b.run_dir.name}  ({b.run_id})")
    ga, gb = a.info().get("git", {}).get("commit"), b.info().get("git", {}).get("commit")
    if ga != gb:
        print(f"git commit: {str(ga)[:12]} vs {str(gb)[:12]}")
    if not rows:
        print("configs are identical")
        return 0
    width = max(len(k) for k, *_ in rows)
    print(f"{'leaf':<{width}}  {'A':<40}  {'B':<40}")
    for key, va, vb, derived in rows:
        print(f"{key:<{width}}  {_short(va):<40}  {_short(vb):<40}{'  (derived)' if derived else ''}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
