"""The mixture as the run sees it: sources (or cells), phases, token budgets, epochs, and checks.

Pure Python (no JAX): `check` runs at validation time on every launch. It reads
nothing but file metadata, the first bytes of each data file and the small cells file; a dry
run skips the data files and the tokenizer (they are site-specific), training does not.

Paths: data files (source/eval-set `paths`, `data.cells_paths`) resolve against `data.root`;
`data.cells_file` and a `data.tokenizer` path are configuration and resolve against the project
root; `data.root` itself, when relative, resolves against the project root too.
"""
from __future__ import annotations

import codecs
import collections
import csv
import dataclasses
import glob
import gzip
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from marin.config.derive import phase_boundary_steps
from marin.config.paths import project_path
from marin.data import builtin
from marin.data.tokenizers import BYTE, check_vocab, load_tokenizer, tokenizer_path
from marin.model import accounting  # pure Python: FLOPs decide whether a run simulates epochs

KINDS = ("builtin", "text", "jsonl", "parquet")
DEFAULT_ROOT = "."  # data.root when no site is set (schema.DataConfig.root)
WEIGHT_TOLERANCE = 1e-6
LIST_AT_MOST = 8  # values quoted in one message
BINARY_FRACTION = 0.1  # undecodable share of a file's first bytes that makes it binary, not text


@dataclass(frozen=True)
class Source:
    """One source or cell, resolved from the config (weights: one per phase)."""
    name: str
    kind: str
    paths: tuple[str, ...]
    weights: tuple[float, ...]
    tokens: int | None
    text_field: str
    field: str  # the config field it came from, for messages


def data_root(cfg) -> Path:
    return config_path(cfg.data.root)


def config_path(path: str) -> Path:

    return project_path(path)


class SymlinkLoop(ValueError):
    """A `**` pattern whose folders hold a link back to a folder above it (the message names it)."""


def expand(patterns, root: Path) -> list[Path]:
    """Files (or globs, ``**`` included) → sorted paths, each file once (by the first of its names:
    a link to a folder the pattern also reaches itself would read its files twice); a pattern may
    match nothing. SymlinkLoop where `**` would go round a link loop."""
    found = set()
    for pattern in patterns:
        full = os.path.expanduser(pattern if os.path.isabs(pattern) else str(root / pattern))
        base = _fixed_part(full)
        if "**" in full and (loop := _symlink_loop(base, frozenset(map(str, Path(os.path.realpath(base)).parents)))):
            raise SymlinkLoop(f"a symbolic link loop under {base}: {loop}; {pattern!r} would read "
                              "the files below it again at every level: remove the link or name the folders")
        found.update(glob.glob(full, recursive=True))
    unique = {}
    for path in sorted(found):
        unique.setdefault(os.path.realpath(path), Path(path))
    return sorted(unique.values())


def _fixed_part(pattern: str) -> str:
    """The folders of a glob pattern before its first wildcard."""
    parts = Path(pattern).parts
    return str(Path(*parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]))


def _symlink_loop(folder: str, above: frozenset = frozenset()) -> str | None:
    """'<link> → <folder>' for a link below `folder` to a folder it is in, or to one of `above`
    (the folders `folder` is in), else None: glob's `**` follows links to folders, so it would go
    round, the paths growing until the system refuses them. One walk of the folders, as the glob's."""
    above = above | {os.path.realpath(folder)}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=True):
                continue
        except OSError:  # a link to itself: glob skips it too
            continue
        real = os.path.realpath(entry.path)
        if real in above:
            return f"{entry.path} → {real}"
        if loop := _symlink_loop(entry.path, above):
            return loop
    return None


# ----------------------------------------------------------------------------- the mixture

def num_phases(cfg) -> int:
    return len(cfg.data.phase_boundaries) + 1


def phase_name(cfg, phase: int) -> str:
    names = cfg.data.phase_names
    return names[phase] if phase < len(names) else f"phase{phase}"


# A mixture's cells file holds hundreds of cells (the hero's: 200). Far past that, every check and
# the loader's plan run per cell for minutes: refused, with the count, rather than a silent wait.
MAX_CELLS = 100_000
CELL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", re.ASCII)


def read_cells(cfg) -> tuple[list[Source], list[str]]:
    """The cells of `data.cells_file` (CSV) and the problems found reading it.

    Columns: ``name``, ``tokens`` (available tokens), ``weight_<phase name>`` per phase, plus any
    others (``topic``, ``quality``) that `data.cells_paths` may name as ``{topic}``; lines
    starting with ``#`` are comments.
    """
    data = cfg.data
    path = config_path(data.cells_file)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(line for line in f if not line.lstrip().startswith("#")))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        return [], [f"cannot read the cells file {path}: {err}"]
    weight_cols = [f"weight_{phase_name(cfg, p)}" for p in range(num_phases(cfg))]
    missing = [c for c in ["name", "tokens", *weight_cols] if rows and c not in rows[0]]
    if not rows:
        return [], [f"the cells file {path} lists no cells"]
    if missing:
        return [], [f"the cells file {path} lacks the column(s) {', '.join(missing)} "
                    f"(one weight column per phase in data.phase_names)"]
    if len(rows) > MAX_CELLS:
        return [], [f"the cells file {path} lists {len(rows)} cells; at most {MAX_CELLS} (each cell is a source "
                    f"the loader opens and plans; merge cells, or raise mixture.MAX_CELLS knowingly)"]
    cells, problems = [], []
    for line, row in enumerate(rows, start=2):
        if not CELL_NAME.fullmatch(str(row.get("name"))):   # a name is a metric key and a path part
            problems.append(f"{path.name} row {line} ({row.get('name')!r}): names are letters, digits, '_', '-' "
                            f"and '.' (ASCII), starting with a letter or digit")
            continue
        numbers = [row["tokens"], *(row[c] for c in weight_cols)]
        try:   # float() reads any script's digits ("٩١٢"): a table is ASCII
            if not all(isinstance(v, str) and v.isascii() for v in numbers):
                raise ValueError
            tokens = int(float(row["tokens"]))
            weights = tuple(float(row[c]) for c in weight_cols)
        except (TypeError, ValueError):
            problems.append(f"{path.name} row {line} ({row.get('name')}): tokens and weights must be numbers "
                            f"written in ASCII")
            continue
        try:
            location = data.cells_paths.format(**row)
        except KeyError as err:
            return [], [f"data.cells_paths names {err} but the cells file {path} has no such column"]
        cells.append(Source(row["name"], data.cells_kind, (location,), weights, tokens, "text",
                            "data.cells_file"))
    return cells, problems


def sources(cfg) -> list[Source]:
    """Every source of the mixture: `data.sources` then the cells of `data.cells_file`."""
    out = [Source(s.name, s.kind, tuple(s.paths), tuple(float(w) for w in s.weights), s.tokens,
                  s.text_field, f"data.sources[{i}]") for i, s in enumerate(cfg.data.sources)]
    if cfg.data.cells_file:
        out += read_cells(cfg)[0]
    return out


def run_steps(cfg) -> int:
    """Steps the mixture is planned over: the shortened horizon (failure plan) if set."""
    return cfg.schedule.horizon_steps or cfg.train.steps


def boundary_steps(cfg) -> list[int]:
    """First step of each phase after the first (the rule: marin.config.derive.phase_boundary_steps)."""
    return phase_boundary_steps(cfg)


def phase_tokens(cfg) -> list[int]:
    """Each phase's token budget: its share of the planned steps × tokens per step."""
    edges = [0, *boundary_steps(cfg), run_steps(cfg)]
    per_step = cfg.train.seq_len * cfg.train.global_batch
    return [max(0, b - a) * per_step for a, b in zip(edges, edges[1:])]


def phase_tokens_between(cfg, lo: int, hi: int) -> list[int]:
    """Each phase's tokens over the steps [lo, hi)."""
    edges = [0, *boundary_steps(cfg), run_steps(cfg)]
    per_step = cfg.train.seq_len * cfg.train.global_batch
    return [max(0, min(b, hi) - max(a, lo)) * per_step for a, b in zip(edges, edges[1:])]


def _cells_before(cfg) -> dict[str, tuple[float, ...]]:
    """{cell: weights} of `data.cells_before` (the mixture before a swap at `data.cells_from_step`)."""
    if not (cfg.data.cells_before and cfg.data.cells_from_step):
        return {}
    earlier = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cells_file=cfg.data.cells_before))
    return {c.name: c.weights for c in read_cells(earlier)[0]}


def simulated_fraction(cfg) -> float | None:
    """The share of each cell this run reads (`data.simulated_epoching`); None when it reads whole cells."""
    return accounting.simulated_epoch_fraction(cfg)


def simulated_summary(cfg, available: dict[str, int] | None = None) -> dict | None:
    """What `data.simulated_epoching` does to this run (the dry run's lines), None when unset: on or
    off and why, the share of each cell, and how many cells repeat (more than one epoch) and at most."""
    sim = cfg.data.simulated_epoching
    if sim.target_tokens is None:
        return None
    flops = accounting.train_flops(cfg, steps=run_steps(cfg))
    fraction = simulated_fraction(cfg)
    epochs = [sum(e) for e in epochs_per_source(cfg, available).values()]
    return {"on": fraction is not None, "fraction": fraction, "target_tokens": sim.target_tokens,
            "run_tokens": sum(phase_tokens(cfg)), "run_flops": float(flops), "below_flops": sim.below_flops,
            "cells": len(epochs), "cells_repeated": sum(e > 1 for e in epochs),
            "max_epochs": max(epochs, default=0.0)}


def epochs_per_source(cfg, available: dict[str, int] | None = None) -> dict[str, list[float]]:
    """{source: [epochs drawn in each phase]} = weight × phase tokens / available tokens.

    Only sources whose available tokens are known appear: from the config (`tokens`, the cells
    file) or from `available` (e.g. the prepared cache's counts). A cell swap at step S
    (`data.cells_from_step`, `data.cells_before`: the hero's at 108,000) counts the earlier weights
    over [0, S) and the current ones after: read positions continue across it. Under simulated
    epoching a cell's tokens are its share (`simulated_fraction`), so the epochs are the target's.
    """
    budgets = phase_tokens(cfg)
    share = simulated_fraction(cfg) or 1.0  # simulated epoching: each cell cut to this share of its tokens
    before = _cells_before(cfg)
    swap = cfg.data.cells_from_step if before else 0
    early, late = phase_tokens_between(cfg, 0, swap), phase_tokens_between(cfg, swap, run_steps(cfg))
    out = {}
    for src in sources(cfg):
        known = (available or {}).get(src.name, src.tokens)
        known = known and known * share
        if known and len(src.weights) == len(budgets):
            old = before.get(src.name, src.weights) if src.field == "data.cells_file" else src.weights
            out[src.name] = [(w0 * t0 + w * t) / known for w0, t0, w, t in zip(old, early, src.weights, late)]
    return out


# ----------------------------------------------------------------------------- checks

def _quote(pairs) -> str:
    text = ", ".join(f"{n}={v:g}" for n, v in pairs[:LIST_AT_MOST])
    return text + (f", … ({len(pairs) - LIST_AT_MOST} more)" if len(pairs) > LIST_AT_MOST else "")


def _weight_problems(cfg, srcs: list[Source]) -> list[tuple[str, str]]:
    problems = []
    field = "data.cells_file" if cfg.data.cells_file and not cfg.data.sources else "data.sources"
    for p in range(num_phases(cfg)):
        label = f"phase {p} ({phase_name(cfg, p)})"
        pairs = [(s.name, s.weights[p]) for s in srcs]
        negative = [(n, w) for n, w in pairs if w < 0 or not math.isfinite(w)]
        total = math.fsum(w for _, w in pairs)
        if negative:
            problems.append((field, f"{label} has negative or non-finite weights: {_quote(negative)}"))
        elif total == 0:
            problems.append((field, f"{label} weights are all zero: give at least one source a positive weight"))
        elif abs(total - 1.0) > WEIGHT_TOLERANCE:
            problems.append((field, f"{label} weights sum to {total:.6g}, not 1 (they are not "
                             f"normalised for you): {_quote(pairs)}"))
    return problems


def _simulated_problems(cfg) -> list[tuple[str, str]]:
    target, tokens = cfg.data.simulated_epoching.target_tokens, sum(phase_tokens(cfg))
    if simulated_fraction(cfg) is None:
        return []
    if cfg.data.sampling != "epoch":
        return [("data.simulated_epoching", f"cuts cells under data.sampling=epoch only, not "
                 f"{cfg.data.sampling}: set data.sampling=epoch, or unset target_tokens (null)")]
    if tokens <= target:
        return []
    return [("data.simulated_epoching.target_tokens", f"{target:,.0f} is less than the run's {tokens:,} tokens: "
             "simulated epoching only cuts cells to a smaller run's share; give a target of at least the "
             "run's tokens, or unset it (null)")]


def _epoch_problems(cfg) -> list[tuple[str, str]]:
    over = [(n, sum(e)) for n, e in epochs_per_source(cfg).items() if sum(e) > cfg.data.max_epochs]
    if not over:
        return []
    field = "data.cells_file" if cfg.data.cells_file and not cfg.data.sources else "data.sources"
    return [(field, f"{len(over)} source(s) would repeat more than data.max_epochs="
             f"{cfg.data.max_epochs:g} epochs over {sum(phase_tokens(cfg)):,} tokens: "
             f"{_quote(sorted(over, key=lambda x: -x[1]))}")]


def _head_problem(path: Path, kind: str) -> str | None:
    """Why a data file cannot be read, judged from its metadata and first bytes; else None."""
    if path.is_dir():
        return f"{path} is a directory, not a file"
    if not os.access(path, os.R_OK):
        return f"{path} is not readable (permissions)"
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            if kind == "parquet":
                f.seek(max(0, path.stat().st_size - 4))
                tail = f.read(4)
    except OSError as err:
        return f"{path} cannot be read: {err}"
    if kind == "parquet":
        if head[:4] != b"PAR1" or tail != b"PAR1":
            return f"{path} is not a Parquet file (no PAR1 magic)"
        return None
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rb") as f:
                head = f.read(4096)
        except (OSError, EOFError) as err:
            return f"{path} is not a readable gzip file: {err}"
    # A binary file, not a text file with a corrupt document (that one is skipped and counted).
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=False)
    if "\x00" in text or text.count("\ufffd") > BINARY_FRACTION * max(1, len(text)):
        return f"{path} is not UTF-8 text (its first bytes are binary)"
    return None


def location_problems(field: str, kind: str, paths, root: Path) -> list[tuple[str, str]]:
    """Missing, empty or unreadable files of one source or eval set."""
    if kind == "builtin":

        problems = []
        for loc in paths:
            try:
                builtin.parse(loc)
            except ValueError as err:
                problems.append((f"{field}.paths", str(err)))
        return problems
    try:
        files = expand(paths, root)
    except SymlinkLoop as err:
        return [(f"{field}.paths", str(err))]
    if not files:
        return [(f"{field}.paths", f"no file matches {[str(root / p) for p in paths]}")]
    problems = [(f"{field}.paths", msg) for p in files if (msg := _head_problem(p, kind))]
    if not problems and all(p.stat().st_size == 0 for p in files):
        problems.append((f"{field}.paths", f"the source is empty: its {len(files)} file(s) hold no bytes"))
    return problems


def _structure_problems(cfg) -> list[tuple[str, str]]:
    data = cfg.data
    phases = num_phases(cfg)
    problems = []
    bounds = list(data.phase_boundaries)
    for b in bounds:
        if not 0.0 < b < 1.0:
            problems.append(("data.phase_boundaries", "a phase boundary is a fraction of the run "
                             f"strictly between 0 and 1; got {b}"))
    if any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
        problems.append(("data.phase_boundaries", f"must increase; got {bounds}"))
    if len(data.phase_names) != phases:
        problems.append(("data.phase_names", f"needs one name per phase ({phases}: one more than "
                         f"data.phase_boundaries); got {list(data.phase_names)}"))
    if not data.max_epochs > 0:
        problems.append(("data.max_epochs", f"must be > 0; got {data.max_epochs}"))
    if not data.sources and not data.cells_file:
        problems.append(("data.sources", "the mixture is empty: give at least one source or a cells file"))
    for i, s in enumerate(data.sources):
        field = f"data.sources[{i}]"
        if s.kind not in KINDS:
            problems.append((f"{field}.kind", f"must be one of {', '.join(KINDS)}; got {s.kind!r}"))
        if len(s.weights) != phases:
            problems.append((f"{field}.weights", f"needs one weight per phase ({phases}); got {list(s.weights)}"))
        if not s.paths:
            problems.append((f"{field}.paths", f"source {s.name!r} has no location: give files, globs "
                             "or a built-in name"))
        if s.kind == "builtin":  # not site-specific: checked in dry runs too
            problems += location_problems(field, s.kind, s.paths, Path("."))
        if s.tokens is not None and s.tokens <= 0:
            problems.append((f"{field}.tokens", f"available tokens must be > 0 or null; got {s.tokens}"))
    for i, e in enumerate(data.eval_sets):
        if e.kind not in KINDS:
            problems.append((f"data.eval_sets[{i}].kind", f"must be one of {', '.join(KINDS)}; got {e.kind!r}"))
        if not e.paths:
            problems.append((f"data.eval_sets[{i}].paths", f"eval set {e.name!r} has no location"))
        if e.kind == "builtin":
            problems += location_problems(f"data.eval_sets[{i}]", e.kind, e.paths, Path("."))
    for what, names in (("data.sources", [s.name for s in data.sources]),
                        ("data.eval_sets", [e.name for e in data.eval_sets])):
        dup = sorted(n for n, k in collections.Counter(names).items() if k > 1)
        if dup:
            problems.append((what, f"names must be unique; repeated: {', '.join(dup)}"))
    return problems


def _cells_problems(cfg) -> list[tuple[str, str]]:
    data = cfg.data
    if not config_path(data.cells_file).is_file():
        return [("data.cells_file", f"no cells file at {config_path(data.cells_file)}")]
    if data.cells_kind not in KINDS[1:]:
        return [("data.cells_kind", f"must be one of {', '.join(KINDS[1:])}; got {data.cells_kind!r}")]
    try:
        data.cells_paths.format(name="x", topic="x", quality="x")
    except (KeyError, IndexError, ValueError) as err:
        return [("data.cells_paths", f"may name {{name}}, {{topic}}, {{quality}}; got {data.cells_paths!r} ({err})")]
    cells, messages = read_cells(cfg)
    problems = [("data.cells_file", m) for m in messages]
    if data.cells_before is not None and not config_path(data.cells_before).is_file():
        problems.append(("data.cells_before", f"no cells file at {config_path(data.cells_before)}"))
    elif data.cells_before is not None and not messages:
        earlier = {c.name for c in read_cells(dataclasses.replace(cfg, data=dataclasses.replace(
            data, cells_file=data.cells_before)))[0]}
        if earlier != {c.name for c in cells}:
            problems.append(("data.cells_before", "must list the same cells as data.cells_file (a swap "
                             f"changes weights, not cells): {len(earlier ^ {c.name for c in cells})} differ"))
    names = [c.name for c in cells]
    dup = sorted(n for n, k in collections.Counter(names).items() if k > 1)   # one pass (count() per name: n²)
    if dup:
        problems.append(("data.cells_file", f"cells must be unique; repeated: {', '.join(dup[:LIST_AT_MOST])}"))
    if data.cells_expected is not None and len(set(names)) != data.cells_expected and not messages:
        problems.append(("data.cells_file", f"must list every cell: expected {data.cells_expected}, "
                         f"found {len(set(names))}"))
    bad_tokens = [(c.name, c.tokens) for c in cells if c.tokens <= 0]
    if bad_tokens:
        problems.append(("data.cells_file", f"available tokens must be > 0: {_quote(bad_tokens)}"))
    return problems


def check(cfg) -> list[tuple[str, str]]:
    """Every problem with `cfg.data` (resolved config) as (field, message); [] when it is sound."""
    problems = _structure_problems(cfg)
    if cfg.data.cells_file:
        problems += _cells_problems(cfg)
    if problems:
        return problems
    srcs = sources(cfg)
    problems += _weight_problems(cfg, srcs)
    problems += _simulated_problems(cfg) or _epoch_problems(cfg)
    root = data_root(cfg)
    # A dry run checks what a launch checks where that is cheap and the data is here: relative
    # paths when data.root exists on this machine, absolute ones when their folder does, the cells
    # only when data.root is also set (the hero's cells live at a site's path: its plan prints
    # anywhere; so do eval sets' relative paths), the tokenizer when its file exists.
    def here(paths):
        return list(paths) if not cfg.dry_run else [p for p in paths if _folder_here(p, root)]

    for i, s in enumerate(cfg.data.sources):
        if s.kind != "builtin" and (paths := here(s.paths)):
            problems += location_problems(f"data.sources[{i}]", s.kind, paths, root)
    cells = srcs[len(cfg.data.sources):]
    site_here = not cfg.dry_run or (root.is_dir() and cfg.data.root != DEFAULT_ROOT)
    if not site_here:
        cells = []
    bad_cells = [(s.name, m) for s in cells for _, m in location_problems("data.cells", s.kind, s.paths, root)]
    if bad_cells:  # one line for all cells: 200 near-identical lines would hide the point
        listed = "; ".join(f"{n}: {m}" for n, m in bad_cells[:3])
        problems.append(("data.cells_paths", f"{len({n for n, _ in bad_cells})} of {len(cells)} cells cannot "
                         f"be read under data.root={root}: {listed}" + (" …" if len(bad_cells) > 3 else "")))
    for i, e in enumerate(cfg.data.eval_sets):
        # relative paths under the default data.root are, as the cells, a site's (the hero's Paloma)
        site = [p for p in e.paths if site_here or Path(os.path.expanduser(p)).is_absolute()]
        if e.kind != "builtin" and (paths := here(site)):
            problems += location_problems(f"data.eval_sets[{i}]", e.kind, paths, root)
    problems += _tokenizer_problems(cfg)
    return problems


def _folder_here(pattern: str, root: Path) -> bool:
    """Whether the data a path names would be on this machine: its folder (before any glob) exists;
    relative paths are under data.root."""
    full = Path(os.path.expanduser(pattern))
    if not full.is_absolute():
        return root.is_dir()
    parts = full.parts
    magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    fixed = Path(*parts[:magic])  # the folder a glob starts from, or the file itself
    return (fixed if magic < len(parts) else fixed.parent).is_dir()


def _tokenizer_problems(cfg) -> list[tuple[str, str]]:

    if cfg.dry_run and cfg.data.tokenizer != BYTE and not tokenizer_path(cfg.data.tokenizer).is_file():
        return []  # a site's tokenizer.json, not on this machine: a plan is printed without it
    try:
        tok = load_tokenizer(cfg.data.tokenizer)
    except (FileNotFoundError, ValueError) as err:
        return [("data.tokenizer", str(err).removeprefix("data.tokenizer: "))]
    msg = check_vocab(tok, cfg.model.vocab_size, cfg.data.tokenizer,
                      refuse_padding=not cfg.data.allow_vocab_mismatch)
    return [("data.tokenizer", msg)] if msg else []
