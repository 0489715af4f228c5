"""Compilation cache entries that are the program their key names.

JAX's persistent cache stores each compiled program as a file named by its key (a hash of the
program, devices and options) and loads whatever that file holds: an entry of another program
copied or renamed into place (another config's train step of the same shapes, the eval step) runs
as if it were this one, silently wrong or failing in every later run. Each entry marin writes gets a
record beside it, the SHA-256 of its key and contents; an entry whose record is missing or does not
match is not loaded but compiled again and replaced (a mismatch with one warning naming the file).
The record binds an entry to its key against accidents and swaps; against a writer who means harm
the folder's permissions are the guard (trainer.unsafe_cache_folder)."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)
RECORD = "-marin-sha256"   # the record's key: the entry's key with this suffix


def digest(key: str, value: bytes) -> bytes:
    return hashlib.sha256(key.encode() + b"\0" + value).digest()


class VerifiedEntries:
    """JAX's cache interface (get, put) over its file cache, checking each entry's record."""

    def __init__(self, base):
        self._base = base

    @property
    def _path(self):  # JAX logs the cache's path through this attribute
        return self._base._path

    def get(self, key: str) -> bytes | None:
        value = self._base.get(key)
        if value is None or key.endswith(RECORD):
            return value
        record = self._base.get(key + RECORD)
        if record == digest(key, value):
            return value
        self._discard(key, written_by_jax_alone=record is None)
        return None

    def put(self, key: str, value: bytes) -> None:
        """The record first, the entry after: a process reading meanwhile finds no entry rather
        than one without its record. A record left by an evicted entry is replaced (JAX's file
        cache keeps an existing file); an entry another process has just written is kept."""
        if self.get(key) is not None:
            return
        self._remove(key + RECORD)
        self._base.put(key + RECORD, digest(key, value))
        self._base.put(key, value)

    def clear(self):
        if hasattr(self._base, "clear"):
            self._base.clear()

    def _discard(self, key: str, written_by_jax_alone: bool) -> None:
        """Remove an entry that failed its check, so the compiled program's put replaces it. One
        without a record (written by JAX alone: the test suite's own processes, marin before
        records) is replaced quietly; one whose record does not match, with a warning."""
        path = self._folder() / f"{key}-cache"
        if written_by_jax_alone:
            log.debug("compilation cache entry %s has no record: compiling it again", path)
        else:
            log.warning("compilation cache entry %s not used: it is not the program its name says (its "
                        "record does not match); compiling it again", path)
        self._remove(key)
        self._remove(key + RECORD)

    def _folder(self) -> Path:
        return Path(str(getattr(self._base, "path", "")))

    def _remove(self, key: str) -> None:
        """The files JAX's file cache (jax._src.lru_cache) keeps for a key: the value, its access time."""
        for suffix in ("-cache", "-atime"):
            (self._folder() / f"{key}{suffix}").unlink(missing_ok=True)


def install() -> None:
    """From now on JAX's persistent cache checks every entry: the cache JAX opens next is wrapped,
    and so is one it has open already."""
    from jax._src import compilation_cache as cc

    if not getattr(cc.get_file_cache, "_marin_verified", False):
        opener = cc.get_file_cache

        def get_file_cache(path):
            opened = opener(path)
            return None if opened is None else (VerifiedEntries(opened[0]), opened[1])

        get_file_cache._marin_verified = True
        cc.get_file_cache = get_file_cache
    if cc._cache is not None and not isinstance(cc._cache, VerifiedEntries):
        cc._cache = VerifiedEntries(cc._cache)
