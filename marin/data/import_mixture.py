"""Convert a published Marin mixture (JSON) into the project's cells table (`data.cells_file`).

    python -m marin.data.import_mixture MIXTURE.json [--available-from LAUNCH.json] [-o CELLS.csv]

The published format (marin-community/marin, `experiments/grug/moe_hero_ep/*.json`) holds, per
cell `cNNqK` (topic NN, quality K), `phase0_weights`, `phase1_weights` and, in a launch mixture,
`available_tokens`; a later mixture (e.g. `best_mixture_*.json`) has weights only, and takes its
available tokens from the launch file (`--available-from`). The table has one row per cell:
``name, topic, quality, tokens, weight_<phase>``, the values exactly as published (each float
written as its shortest round-trip text, so reading it back gives the same double). Nothing is
normalised: the launch checks then require each phase to sum to 1.

Pure Python, no JAX. Bad input: one line naming what is wrong, exit 2.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import re
import sys
from pathlib import Path

PHASE_KEYS = ("phase0_weights", "phase1_weights")
DEFAULT_PHASE_NAMES = ("pretrain", "midtrain")  # conf/data/mochi_hero.yaml data.phase_names
CELL = re.compile(r"^c(\d+)q(\d+)$")


class MixtureFormatError(ValueError):
    """A published file that cannot be converted (its message is the one line printed)."""


def _read(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:   # ValueError: not JSON, or an integer of over 4300 digits
        raise MixtureFormatError(f"cannot read the mixture {path}: {err}") from err
    except RecursionError as err:
        raise MixtureFormatError(f"cannot read the mixture {path}: nested too deeply to be a mixture") from err
    if not isinstance(data, dict):
        raise MixtureFormatError(f"{path} is not a published mixture: expected a JSON object")
    return data


def _table(data: dict, key: str, path: Path, number, kind: str) -> dict:
    table = data.get(key)
    if not isinstance(table, dict) or not table:
        raise MixtureFormatError(f"{path} has no {key!r} table (a published mixture has "
                           f"{', '.join(PHASE_KEYS)} and, at launch, available_tokens)")
    bad = [name for name, v in table.items() if not number(v)]
    if bad:
        raise MixtureFormatError(f"{path}: {key} must hold {kind}; not for {', '.join(bad[:4])}")
    return table


def rows(mixture: Path, available_from: Path | None = None,
         phase_names=DEFAULT_PHASE_NAMES) -> list[dict]:
    """The cells table of a published mixture: one dict per cell, in the file's order."""
    data = _read(mixture)
    # 1e999 reads as inf; token counts are int64 downstream
    is_float = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63  # noqa: E731
    weights = [_table(data, key, mixture, is_float, "finite numbers") for key in PHASE_KEYS]
    if len(phase_names) != len(PHASE_KEYS):
        raise MixtureFormatError(f"--phase-names needs {len(PHASE_KEYS)} names (one per published phase)")
    source = available_from or mixture
    counts = data if available_from is None else _read(available_from)
    if "available_tokens" not in counts:
        raise MixtureFormatError(f"{source} has no 'available_tokens': give --available-from the launch mixture")
    tokens = _table(counts, "available_tokens", source, is_int, "whole numbers from 0 to 2**63 - 1")
    names = list(weights[0])
    for key, table in zip(PHASE_KEYS, weights):
        if set(table) != set(names):
            raise MixtureFormatError(f"{mixture}: {key} and {PHASE_KEYS[0]} name different cells: "
                               f"{', '.join(sorted(set(table) ^ set(names))[:4])}")
    if missing := [n for n in names if n not in tokens]:
        raise MixtureFormatError(f"{source}: available_tokens lacks {len(missing)} cell(s) of the mixture: "
                           f"{', '.join(missing[:4])}")
    if bad := [n for n in names if not CELL.match(n)]:
        raise MixtureFormatError(f"{mixture}: cell names are cNNqK (topic NN, quality K); got {', '.join(bad[:4])}")
    out = []
    for name in names:
        topic, quality = CELL.match(name).groups()
        row = {"name": name, "topic": f"c{topic}", "quality": int(quality), "tokens": tokens[name]}
        for phase, table in zip(phase_names, weights):
            row[f"weight_{phase}"] = float(table[name])
        out.append(row)
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def to_csv(table: list[dict], mixture: Path, available_from: Path | None = None) -> str:
    """The cells file's text: provenance comments, then the table (floats as `repr`: exact)."""
    out = io.StringIO()
    out.write(f"# Converted by `python -m marin.data.import_mixture` from {Path(mixture).name} "
              f"(sha256 {_digest(mixture)}…)")
    if available_from is not None:
        out.write(f", available tokens from {Path(available_from).name} (sha256 {_digest(available_from)}…)")
    out.write(".\n# Published by marin-community/marin (Apache-2.0), experiments/grug/moe_hero_ep/. "
              "Values exactly as published.\n")
    writer = csv.DictWriter(out, fieldnames=list(table[0]), lineterminator="\n")
    writer.writeheader()
    for row in table:
        writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m marin.data.import_mixture", description=__doc__.split("\n\n")[0])
    parser.add_argument("mixture", type=Path, help="a published mixture JSON (phase0_weights, phase1_weights)")
    parser.add_argument("--available-from", type=Path, default=None,
                        help="the launch mixture JSON whose available_tokens to use (for a mixture without them)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="the cells CSV to write (default: stdout)")
    parser.add_argument("--phase-names", default=",".join(DEFAULT_PHASE_NAMES),
                        help="the weight columns' phase names, as in data.phase_names (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        table = rows(args.mixture, args.available_from, tuple(args.phase_names.split(",")))
        text = to_csv(table, args.mixture, args.available_from)
    except MixtureFormatError as err:
        print(f"error: {err}", file=sys.stderr)  # as every tool words a refusal
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        try:
            args.output.write_text(text, encoding="utf-8")
        except OSError as err:
            print(f"error: -o: cannot write {args.output}: {err}", file=sys.stderr)
            return 2
        print(f"{args.output}: {len(table)} cells", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
