"""`python -m marin.diff <run A> <run B>`: the config leaves that differ between two runs, and
what came of them.

A run is named as every tool names it (`marin.track.refs`: its directory, its name under
outputs/runs/, its MLflow run id, a unique prefix of either, `<sweep>/<job>`). The resolved
configs are compared (what was trained); a leaf whose composed value was ``auto`` is marked
``(derived)``. Under them, each run's results: its state, last step, and latest train loss, eval
loss and tokens/s, read from its directory (record.json, metrics.jsonl: marin.track.runfiles),
without starting MLflow; `--mlflow` asks the store (its directory when the store does not answer).
Exit status: 0 the configs are the same, 1 they differ, 2 a run could not be opened (bad input).
"""
from __future__ import annotations

import sys

from omegaconf import OmegaConf

from marin.cli import Parser, fail
from marin.track import backend, record, runfiles
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


# The results compared under the config: (metric, format); "state" and "step" come first.
RESULTS = (("train/loss", "{:.4f}"), ("eval/macro_loss", "{:.4f}"), ("train/tokens_per_s", "{:,.0f}"))
LOSS = RESULTS[0][0]


def results(rec: record.RunRecord, from_store: bool = False) -> dict:
    """{"state", "step", metric: latest value} of a run: from its directory (record.json's status,
    metrics.jsonl); `from_store`: from its MLflow run, else its directory. Reads only."""
    if not from_store:
        return _results_from_files(rec)
    try:
        backend.check_reachable(rec.tracking_uri, create=False)   # a reader: never makes a store
        client = backend.client(rec.tracking_uri, create=False)
        run = client.get_run(rec.run_id)
        history = client.get_metric_history(rec.run_id, LOSS)
        return {"state": run.info.status, "step": max((m.step for m in history), default=None),
                **{key: run.data.metrics.get(key) for key, _ in RESULTS}}
    except Exception:  # the store is gone or elsewhere: the run directory keeps the same numbers
        return _results_from_files(rec)


def _results_from_files(rec: record.RunRecord) -> dict:
    run = runfiles.read(rec.run_dir)
    return {"state": run.state, "step": run.step, **{key: run.value(key) for key, _ in RESULTS}}


def print_results(a: dict, b: dict, out=None) -> None:
    """State, step and the metrics of A and B side by side, with B − A for the numbers."""
    out = out or sys.stdout
    width = max(len(key) for key, _ in RESULTS)
    print(f"\n{'result':<{width}}  {'A':>14}  {'B':>14}  {'B - A':>12}", file=out)
    print(f"{'state':<{width}}  {a['state']:>14}  {b['state']:>14}", file=out)
    for key, form in (("step", "{:d}"), *RESULTS):
        va, vb = a.get(key), b.get(key)
        cells = ["-" if v is None else form.format(v) for v in (va, vb)]
        delta = "" if va is None or vb is None else form.format(vb - va)
        if delta and not delta.startswith("-"):
            delta = "+" + delta
        print(f"{key:<{width}}  {cells[0]:>14}  {cells[1]:>14}  {delta:>12}", file=out)


def _short(value, width: int = 40) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.diff", description=__doc__.split("\n\n")[0],
                    epilog="exit status: 0 the configs are the same, 1 they differ, 2 a run could not be opened")
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--composed", action="store_true", help="compare the configs as composed (with auto)")
    parser.add_argument("--all", action="store_true", help="include run.*, tracking.* and control leaves")
    parser.add_argument("--tracking-uri", help="where to look MLflow run ids up (default: $MLFLOW_TRACKING_URI "
                        "or the project's sqlite store)")
    parser.add_argument("--out-dir", help="where run names and prefixes are looked up (default: the project's outputs/)")
    parser.add_argument("--mlflow", action="store_true", help="each run's results from its MLflow run "
                        "(default: from its directory, without starting MLflow)")
    args = parser.parse_args(argv)
    try:
        a = record.open(args.run_a, tracking_uri=args.tracking_uri, out_dir=args.out_dir)
        b = record.open(args.run_b, tracking_uri=args.tracking_uri, out_dir=args.out_dir)
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
    else:
        width = max(len(k) for k, *_ in rows)
        print(f"{'leaf':<{width}}  {'A':<40}  {'B':<40}")
        for key, va, vb, derived in rows:
            print(f"{key:<{width}}  {_short(va):<40}  {_short(vb):<40}{'  (derived)' if derived else ''}")
    print_results(results(a, args.mlflow), results(b, args.mlflow))
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
