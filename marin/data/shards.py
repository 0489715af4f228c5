"""The on-disk format of a prepared source, and the class that reads it.

A source's folder (``<cache>/<key>/``) holds:

- ``<group>-<part>/`` shards, e.g. ``000003-0001/``: ``tokens.bin`` (flat uint16/uint32 ids, each
  document followed by the end-of-document id), ``offsets.npy`` (int64 start of each of its
  documents, from 0, plus its end) and ``manifest.json`` (what it holds, the blake2b of both files,
  its bad-input counts, the input records it covers). A group is a fixed run of the source's input
  files (by name and size, never by the task count); a part is the next ≤ `data.shard_tokens`
  tokens of its documents, so shard names and contents do not depend on which task made them.
- ``index.json`` (small, whatever the shard count): the source's totals, dtype and bad-input counts,
  and the name of its column table ``index-<hash>.npy``: int64 [shards, 4] of each shard's group,
  part, token start and document start in stream order (group, then part); and
  ``index-manifests.json``: each shard's id and manifest hash (for audits; opening does not read
  it). The index is written last, atomically, after its table: a source with an index is complete.
  Opening a source reads two small files, so start does not grow with the shard count.

A shard is written under a temporary name (``mkdtemp``: unique, created with O_EXCL), hashed, and
renamed into place (atomic); a preparer that finds the name taken keeps the shard already there if
it verifies. So two preparers at once never corrupt a shard (`marin.data.prepare_tasks` also makes
each group under a lock, so they do not repeat each other's work), and a killed one leaves only a
temporary folder (removed by the next preparer of that shard).

`ShardedSource` opens a source by reading its index and column table alone; a shard's files are memory-mapped the
first time a row reads them. Its `tokens` (indexable like an array) and `document_of` present the
shards as one stream; `offsets` (the whole stream's document starts) is built on first use, for
code that still searches it directly.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = 3   # 3: the index's per-shard numbers as a column table (2: a JSON entry per shard)
INDEX, MANIFEST, TOKENS, OFFSETS = "index.json", "manifest.json", "tokens.bin", "offsets.npy"
MANIFESTS = "index-manifests.json"
GROUP, PART, TOKEN_START, DOCUMENT_START = range(4)   # the columns of the index table
_HASH_BLOCK = 1 << 22


def shard_id(group: int, part: int) -> str:
    return f"{group:06d}-{part:04d}"


def file_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _dumps(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)


def manifest_hash(manifest: dict) -> str:
    return hashlib.blake2b(_dumps(manifest).encode(), digest_size=32).hexdigest()


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify_shard(folder: Path, full: bool = True) -> dict | None:
    """The shard's manifest if its files match it (sizes; with `full`, their hashes too), else None."""
    m = read_manifest(folder)
    if m is None or m.get("format") != FORMAT:
        return None
    itemsize = np.dtype(m["dtype"]).itemsize
    try:
        if (folder / TOKENS).stat().st_size != m["tokens"] * itemsize:
            return None
        if full and any(file_hash(folder / name) != digest for name, digest in m["hashes"].items()):
            return None
    except OSError:
        return None
    return m


class ShardWriter:
    """One shard being written: under a temporary name in `source_dir` until `finish`."""

    def __init__(self, source_dir: Path, sid: str, dtype):
        source_dir.mkdir(parents=True, exist_ok=True)
        self.final = source_dir / sid
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{sid}.", dir=source_dir))
        self.dtype = np.dtype(dtype)
        self._out = open(self.tmp / TOKENS, "wb")
        self._hash = hashlib.blake2b(digest_size=32)   # hashed as written: a shard is not read back
        self.tokens, self.ends = 0, []

    def append(self, ids: np.ndarray) -> None:
        """One document's ids (its end-of-document id included)."""
        data = np.asarray(ids).astype(self.dtype).tobytes()
        self._out.write(data)
        self._hash.update(data)
        self.tokens += len(ids)
        self.ends.append(self.tokens)

    @property
    def documents(self) -> int:
        return len(self.ends)

    def finish(self, extra: dict) -> dict:
        """Hash, write the manifest (`extra` added to it) and rename into place; the manifest."""
        self._out.close()
        np.save(self.tmp / OFFSETS, np.asarray([0, *self.ends], np.int64))
        manifest = {"format": FORMAT, "shard": self.final.name, "dtype": self.dtype.name,
                    "tokens": self.tokens, "documents": self.documents,
                    "hashes": {TOKENS: self._hash.hexdigest(), OFFSETS: file_hash(self.tmp / OFFSETS)}, **extra}
        (self.tmp / MANIFEST).write_text(_dumps(manifest))
        try:
            os.rename(self.tmp, self.final)
        except OSError:  # the name is taken: another preparer's copy (kept if whole) or a damaged one
            if verify_shard(self.final) is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return read_manifest(self.final)
            stale = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.stale.", dir=self.final.parent))
            os.rename(self.final, stale / "old")
            os.rename(self.tmp, self.final)
            shutil.rmtree(stale, ignore_errors=True)
        return manifest

    def abort(self) -> None:
        self._out.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def remove_temporaries(source_dir: Path, sid: str) -> None:
    """Leftovers of a preparer killed while writing shard `sid` (or replacing it)."""
    for p in source_dir.glob(f".{sid}.*"):
        shutil.rmtree(p, ignore_errors=True)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _parse_id(sid: str) -> tuple[int, int]:
    group, part = sid.split("-")
    return int(group), int(part)


def write_index(source_dir: Path, name: str, manifests: list[dict], extra: dict) -> dict:
    """The source's index over `manifests` (in stream order): its column table and manifest list
    first, then ``index.json`` naming the table, each written atomically. Returns the index."""
    table = np.zeros((len(manifests), 4), np.int64)
    if manifests:
        table[:, [GROUP, PART]] = [_parse_id(m["shard"]) for m in manifests]
        table[:, TOKEN_START] = np.cumsum([0, *(m["tokens"] for m in manifests[:-1])])
        table[:, DOCUMENT_START] = np.cumsum([0, *(m["documents"] for m in manifests[:-1])])
    buf = io.BytesIO()
    np.save(buf, table)
    data = buf.getvalue()
    table_name = f"index-{hashlib.blake2b(data, digest_size=8).hexdigest()}.npy"   # content-named: a
    _atomic_write(source_dir / table_name, data)   # rewrite never changes a table an index names
    listing = _dumps([[m["shard"], manifest_hash(m)] for m in manifests]).encode()
    _atomic_write(source_dir / MANIFESTS, listing)
    index = {"format": FORMAT, "name": name, "dtype": manifests[0]["dtype"] if manifests else "uint16",
             "tokens": int(sum(m["tokens"] for m in manifests)),
             "documents": int(sum(m["documents"] for m in manifests)), **extra,
             "shards": len(manifests), "table": table_name,
             "manifests": hashlib.blake2b(listing, digest_size=32).hexdigest()}
    _atomic_write(source_dir / INDEX, _dumps(index).encode())
    return index


def read_index(source_dir: Path) -> dict | None:
    try:
        index = json.loads((source_dir / INDEX).read_text())
    except (OSError, ValueError):
        return None
    return index if index.get("format") == FORMAT else None


def read_table(source_dir: Path, index: dict) -> np.ndarray:
    """The index's column table: int64 [shards, 4] (`GROUP`, `PART`, `TOKEN_START`, `DOCUMENT_START`)."""
    table = np.load(source_dir / index["table"])
    if table.shape != (index["shards"], 4):
        raise ValueError(f"{source_dir / index['table']}: shape {table.shape}, expected ({index['shards']}, 4)")
    return table


class _Tokens:
    """The source's tokens as one array-like stream: `view[idx]` for int, slice or integer arrays."""

    def __init__(self, source: "ShardedSource"):
        self._s = source
        self.dtype = np.dtype(source.index["dtype"])
        self.shape = (source.num_tokens,)
        self.ndim = 1

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx):
        if len(self._s._token_starts) == 1:   # one shard: its memory map as it is
            return self._s._shard(0)[0][idx]
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        flat = np.asarray(idx, np.int64)
        scalar = flat.ndim == 0
        flat = flat.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        out = np.empty(flat.shape, self.dtype)
        which = np.searchsorted(self._s._token_starts, flat, side="right") - 1
        for k in np.unique(which):
            sel = which == k
            out[sel] = self._s._shard(int(k))[0][flat[sel] - self._s._token_starts[k]]
        return out[0] if scalar else out.reshape(np.shape(idx))

    def __array__(self, dtype=None, copy=None):
        whole = self[slice(None)]
        return whole if dtype is None else whole.astype(dtype)


@dataclass
class ShardedSource:
    """A prepared source (see the module docstring); drop-in for the former one-shard `Shard`."""
    name: str
    path: Path
    index: dict = field(repr=False)
    _open: dict = field(default_factory=dict, repr=False)
    _offsets: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def open(cls, name: str, path: Path) -> "ShardedSource":
        index = read_index(path)
        if index is None:
            raise FileNotFoundError(f"{path / INDEX}: no index of format {FORMAT}")
        return cls(name, Path(path), index)

    def __post_init__(self):
        table = read_table(self.path, self.index)
        self._table = table
        self._token_starts = table[:, TOKEN_START].copy() if len(table) else np.zeros(1, np.int64)
        self._doc_starts = table[:, DOCUMENT_START].copy() if len(table) else np.zeros(1, np.int64)
        self._token_ends = np.append(self._token_starts[1:], self.num_tokens)
        self.tokens = _Tokens(self)

    @property
    def num_tokens(self) -> int:
        return int(self.index["tokens"])

    @property
    def documents(self) -> int:
        return int(self.index["documents"])

    @property
    def corrupt(self) -> int:
        return int(self.index.get("corrupt", 0))

    @property
    def shard_ids(self) -> list[str]:
        return [shard_id(int(g), int(p)) for g, p in self._table[:, [GROUP, PART]]]

    @property
    def shard_tokens(self) -> np.ndarray:
        """int64 [shards]: each shard's tokens."""
        return self._token_ends - self._token_starts if len(self._table) else np.zeros(0, np.int64)

    def _shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard k's (tokens, offsets), memory-mapped on first use."""
        if k not in self._open:
            folder = self.path / shard_id(int(self._table[k, GROUP]), int(self._table[k, PART]))
            size = int(self._token_ends[k] - self._token_starts[k])
            tokens = np.memmap(folder / TOKENS, dtype=self.index["dtype"], mode="r", shape=(size,)) if size \
                else np.zeros(0, self.index["dtype"])   # an empty file cannot be mapped (a piece with no line)
            self._open[k] = (tokens, np.load(folder / OFFSETS, mmap_mode="r"))
        return self._open[k]

    def document_of(self, idx) -> np.ndarray:
        """For token positions `idx`: 1 + the index of the document holding each (the stream's
        document starts searched with side="right"), without reading other shards' offsets."""
        flat = np.asarray(idx, np.int64).reshape(-1)
        out = np.empty(flat.shape, np.int64)
        which = np.searchsorted(self._token_starts, flat, side="right") - 1
        for k in np.unique(which):
            sel = which == k
            local = np.searchsorted(self._shard(int(k))[1], flat[sel] - self._token_starts[k], side="right")
            out[sel] = self._doc_starts[k] + local
        return out.reshape(np.shape(idx))

    @property
    def offsets(self) -> np.ndarray:
        """int64 [documents + 1]: every document's start in the stream, plus its end (all shards'
        offsets read; a one-shard source's are its memory-mapped file)."""
        if self._offsets is None:
            n = int(self.index["shards"])
            if n == 1:
                self._offsets = self._shard(0)[1]
            else:
                parts = [np.zeros(1, np.int64)]
                parts += [np.asarray(self._shard(k)[1][1:]) + self._token_starts[k] for k in range(n)]
                self._offsets = np.concatenate(parts)
        return self._offsets
