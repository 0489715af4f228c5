"""Built-in sources, assembled offline from text every CPython install has.

- ``pydoc_data``: the prose of `pydoc_data.topics` (the language reference), one document per topic.
- ``stdlib``: the standard library's ``*.py`` files (tests and site-packages excluded), one
  document per file, in sorted order, capped so preparation stays fast.

A location is ``<name>`` (the training split) or ``<name>/heldout``. A stable hash of each
document's key puts one document in `HELDOUT_EVERY` in the held-out split, so evaluation sets
built from it never contain a training document.
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator

NAMES = ("pydoc_data", "stdlib")
SPLITS = ("train", "heldout")
HELDOUT_EVERY = 10
# Characters per split: the training split stays a few MB so preparing it takes about a second.
CAPS = {"train": 4_000_000, "heldout": 400_000}
VERSION = 1  # bump when the assembly changes: it is part of the cache key
STDLIB_SKIP = {"site-packages", "test", "tests", "idle_test", "__pycache__"}  # folders `stdlib` leaves out


def parse(location: str) -> tuple[str, str]:
    """``stdlib/heldout`` → (``stdlib``, ``heldout``); raises ValueError for an unknown one."""
    name, _, split = location.partition("/")
    split = split or "train"
    if name not in NAMES or split not in SPLITS:
        raise ValueError(f"unknown built-in source {location!r}: expected one of "
                         f"{', '.join(NAMES)}, optionally followed by /heldout")
    return name, split


def is_heldout(key: str) -> bool:
    return zlib.crc32(key.encode()) % HELDOUT_EVERY == 0


def _pydoc_topics() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield key, topics[key]


@functools.cache
def _stdlib_paths() -> tuple[tuple[str, Path], ...]:
    """(name relative to the standard library, path) of its `*.py` files, sorted; listed once a
    process, and without entering the skipped folders (the interpreter's site-packages and tests
    hold tens of thousands of entries: walking them was most of preparing the built-in mixture)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        subfolders[:] = [name for name in subfolders if name not in STDLIB_SKIP]
        found += [Path(folder, name) for name in files if name.endswith(".py")]
    return tuple((str(path.relative_to(root)), path) for path in sorted(found))


def _stdlib_files() -> Iterator[tuple[str, str]]:
    for rel, path in _stdlib_paths():
        try:
            yield rel, path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a stray non-UTF-8 file: not worth failing the built-in mixture


def documents(location: str) -> Iterator[str]:
    """The documents of a built-in location, in a fixed order, within the split's cap."""
    name, split = parse(location)
    source = _pydoc_topics() if name == "pydoc_data" else _stdlib_files()
    budget = CAPS[split]
    for key, text in source:
        if is_heldout(key) != (split == "heldout") or not text.strip():
            continue
        if budget <= 0:
            return
        budget -= len(text)
        yield text


def fingerprint(location: str) -> str:
    """Identifies the text a location yields (it changes with the Python version)."""
    name, split = parse(location)
    return f"builtin-v{VERSION}:{name}/{split}:python-{sys.version_info.major}.{sys.version_info.minor}." \
           f"{sys.version_info.micro}:{CAPS[split]}"


# A location's documents are prepared as groups of consecutive documents of about this many
# characters (`ranges`), so a process pool balances them; fixed by the text, never by the task count.
GROUP_CHARS = 500_000


@functools.cache
def sizes(location: str) -> tuple[int, ...]:
    """Characters of each document of `location`, in order."""
    return tuple(len(d) for d in documents(location))


def ranges(location: str, chars: int | None = None) -> list[tuple[int, int, int]]:
    """(first document, end, characters) of each group of `location`: consecutive documents, a new
    group begun once one holds `chars` characters (a larger document alone)."""
    chars = GROUP_CHARS if chars is None else chars
    out, start, held = [], 0, 0
    lengths = sizes(location)
    for i, n in enumerate(lengths):
        if held and held + n > chars:
            out.append((start, i, held))
            start, held = i, 0
        held += n
    out.append((start, len(lengths), held))
    return out
