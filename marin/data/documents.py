"""Records of a source, read from its files: each a document or the reason it is not one.

- ``text``: one document per file (UTF-8; ``.gz`` is decompressed).
- ``jsonl``: one JSON object per line, its `text_field` is the document (``.gz`` too).
- ``parquet``: one document per row of the `text_field` column.
- ``builtin``: see `marin.data.builtin`.

`records` yields every record with its file and line; a bad one (`BAD_REASONS`: a file that cannot
be read on, bad UTF-8, bad JSON, a missing `text_field`, a null or a number) carries its reason
and no text, and reading goes on (`marin.data.prepare_tasks` counts them per shard). `documents`
keeps only the documents, counting the rest in `Counts.corrupt`.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from marin.data import builtin


class UnreadableSource(ValueError):
    """A file of a source (or the whole source) cannot be used."""


@dataclass
class Counts:
    documents: int = 0
    corrupt: int = 0


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


@dataclass(frozen=True)
class Record:
    """One input record of a source, good or bad: `text` is the document (None when bad), `reason`
    why it is not one (`BAD_REASONS`, or ``empty``: whitespace only, skipped and not bad), `where`
    its file and line (row of a Parquet file, 0: the whole file) for messages."""
    number: int
    where: str
    text: str | None
    reason: str | None = None


BAD_REASONS = ("unreadable", "invalid_utf8", "malformed_json", "missing_field", "not_text", "huge")


# A piece of a large uncompressed JSONL file: "<path>|bytes=<start>-<end>", the lines whose first
# byte is in [start, end) (`marin.data.prepare_tasks.group_files` cuts them, so a pool balances).
PIECE = "|bytes="


def piece(path, start: int, end: int) -> str:
    return f"{path}{PIECE}{start}-{end}"


def split_piece(item: str) -> tuple[str, int, int | None]:
    """(path, start, end) of an input: a piece's byte range, or a whole file's (0, None)."""
    path, sep, span = str(item).rpartition(PIECE)
    if sep and (parts := span.split("-")) and len(parts) == 2 and all(p.isdigit() for p in parts):
        return path, int(parts[0]), int(parts[1])
    return str(item), 0, None


def _lines(path: Path, start: int, end: int | None):
    """(line number, raw line) of a file's lines whose first byte is in [start, end); the number
    of a piece's lines counted from the file's start only when asked (a bad record's message)."""
    if end is None:
        with _open(path) as f:
            yield from ((n, raw) for n, raw in enumerate(f, 1))
        return
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()   # the line holding byte start - 1 is the previous piece's
        rel = 0
        while f.tell() < end and (raw := f.readline()):
            rel += 1
            yield _PieceLine(path, start, rel), raw


class _PieceLine:
    """A line number within a piece, formatted as the file's line number: the lines begun before
    the piece (one at 0, one after each newline before byte start - 1), counted on first use."""

    def __init__(self, path: Path, start: int, rel: int):
        self.path, self.start, self.rel = path, start, rel

    def __add__(self, n: int) -> "_PieceLine":
        return _PieceLine(self.path, self.start, self.rel + n)

    def __str__(self) -> str:
        before, left = 1, self.start - 1
        with open(self.path, "rb") as f:
            while left > 0 and (block := f.read(min(left, 1 << 22))):
                before += block.count(b"\n")
                left -= len(block)
        return str(before + self.rel) if self.start else str(self.rel)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _file_records(kind: str, path: Path, field: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(line, text, reason) of one file, or of a piece of one (`piece`); a file that cannot be read
    (any more) ends in one ``unreadable`` record."""
    path, start, end = split_piece(path)
    path = Path(path)
    line = 0 if end is None else _PieceLine(path, start, 0)
    try:
        if kind == "text":
            with _open(path) as f:
                raw = f.read()
            try:
                yield 1, raw.decode("utf-8"), None
            except UnicodeDecodeError:
                yield 1, None, "invalid_utf8"
        elif kind == "jsonl":
            for line, raw in _lines(path, start, end):
                    if not raw.strip():
                        continue
                    try:
                        obj = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError:
                        yield line, None, "invalid_utf8"
                        continue
                    except ValueError:
                        yield line, None, "malformed_json"
                        continue
                    if not isinstance(obj, dict) or field not in obj:
                        yield line, None, "missing_field"
                    elif not isinstance(obj[field], str):
                        yield line, None, "not_text"
                    else:
                        yield line, obj[field], None
        elif kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
                if field not in pf.schema_arrow.names:
                    yield 0, None, "missing_field"
                    return
                for batch in pf.iter_batches(columns=[field], batch_size=1024):
                    for value in batch.column(0).to_pylist():
                        line += 1
                        yield line, value, None if isinstance(value, str) else "not_text"
            except (pa.ArrowException, OSError):
                yield line + 1, None, "unreadable"
        else:
            raise ValueError(f"unknown source kind {kind!r}")
    except (OSError, EOFError):  # EOFError: a truncated .gz
        yield line + 1, None, "unreadable"


def records(kind: str, inputs, text_field: str) -> Iterator[Record]:
    """Every record of `inputs` (files, or built-in locations for ``builtin``), numbered from 0 in
    a fixed order: what a shard of a group of inputs is made of (`marin.data.prepare`)."""
    number = 0
    for item in inputs:
        if kind == "builtin":
            rows = ((i + 1, d, None) for i, d in enumerate(builtin.documents(item)))
        else:
            rows = _file_records(kind, Path(item), text_field)
        for line, text, reason in rows:
            if reason is None and not text.strip():
                reason, text = "empty", None
            # where: a bad record's file and line (a good one's only its input: no line formatted)
            where = f"{split_piece(item)[0]}:{line}" if reason is not None else str(item)
            yield Record(number, where, text if reason is None else None, reason)
            number += 1


def documents(kind: str, files: list[Path], text_field: str, counts: Counts,
              builtin_locations=()) -> Iterator[str]:
    """Every readable document of a source, in a fixed order; `counts` is updated as they go (a
    bad record counted in `corrupt`, an empty one skipped); a file that cannot be read (on) raises
    `UnreadableSource`. `marin.data.prepare` reads `records` instead, to count each reason."""
    for rec in records(kind, builtin_locations if kind == "builtin" else files, text_field):
        if rec.reason == "unreadable":
            raise UnreadableSource(f"reading failed at {rec.where}")
        if rec.text is not None:
            counts.documents += 1
            yield rec.text
        elif rec.reason != "empty":
            counts.corrupt += 1


def eval_subsets(eval_set, root: Path) -> list:
    """An eval set with `subsets` → one set per subset, named `<name>/<subset>`: the files its
    paths match, grouped by the first folder (or, directly there, the file's stem) below each
    path's fixed part (the folders before its first wildcard). Others: [eval_set]."""
    if not getattr(eval_set, "subsets", False) or eval_set.kind == "builtin":
        return [eval_set]
    groups: dict[str, list[str]] = {}
    for pattern in eval_set.paths:
        parts = Path(pattern).parts
        head = parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts) - 1)]
        fixed = Path(*head) if head else Path(".")
        base = fixed if fixed.is_absolute() else root / fixed
        full = pattern if os.path.isabs(pattern) else str(root / pattern)
        for f in sorted(glob.glob(os.path.expanduser(full), recursive=True)):
            rel = Path(f).relative_to(base)
            subset = rel.parts[0] if len(rel.parts) > 1 else rel.name.split(".")[0]
            groups.setdefault(subset, []).append(str(Path(f)))
    if not groups:
        raise UnreadableSource(f"eval set {eval_set.name!r}: no file matches {list(eval_set.paths)} under {root}")
    return [dataclasses.replace(eval_set, name=f"{eval_set.name}/{s}", paths=files, subsets=False)
            for s, files in sorted(groups.items())]
