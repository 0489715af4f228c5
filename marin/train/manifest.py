"""Per-process content manifests of a checkpoint: every process hashes the files it wrote.

A step folder written by P processes carries `manifest.<p>.json` for p = 0 … P−1: the sha256 of
each file process p wrote, in 64 MiB chunks (so several threads share one large file), with its
size. Each process writes its own after orbax has committed the step (temporary file + rename:
a manifest is either whole or absent), hashing on a thread pool — hashlib and file reads release
the interpreter lock. A checkpoint counts only when all P manifests exist; the checkpoint's meta
records P (`"manifests"`), so one whose manifests went missing is known to have had them.

Which files a process wrote comes from orbax's on-disk layout after the commit, not from its
temporary names: OCDBT puts each process's shards in `…/ocdbt.process_<p>/` and its array
metadata in `…/array_metadatas/process_<p>`; everything else (the merged index, `_METADATA`,
the JSON meta) is process 0's. A process walks only its own subfolders, so on a 704-process run
none lists the others' shards. Were orbax to rename those folders, process 0 would hash them
all: slower, never wrong.

At restore the R restoring processes share the manifests (process r checks those with index
≡ r mod R): as many hashers as writers when R = P. Pure Python: no JAX, so tools may call it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALGORITHM = "sha256"
CHUNK = 64 << 20       # one hashing task; its digest is stored, so a chunk is the unit of parallel work
READ = 1 << 20         # one read: few system calls, and still in the CPU cache when it is hashed
LEGACY = "marin_manifest.json"   # the single manifest process 0 wrote (checkpoints before per-process manifests)
META_FILE = "meta/metadata"      # the checkpoint's JSON meta (Checkpointer's `meta` item, filename "metadata")
META_KEY = "manifests"           # in that meta: how many per-process manifests the checkpoint has
# Orbax rewrites these at the commit (time stamps, markers); they hold no train state.
UNHASHED = ("_CHECKPOINT_METADATA", "commit_success.txt")
_OWN_NAME = re.compile(r"manifest\.(\d+)\.json(\.tmp)?$")
_PROCESS_PART = re.compile(r"(?:^|\.)process_(\d+)$")


def name(process_index: int) -> str:
    return f"manifest.{process_index}.json"


def default_threads() -> int:
    """Hashing threads per process: the cores this process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def owner(relative: str, process_count: int) -> int:
    """The process that wrote a file of a step folder (by its path relative to the folder)."""
    for part in reversed(relative.split("/")):
        match = _PROCESS_PART.search(part)
        if match:
            index = int(match.group(1))
            return index if index < process_count else 0
    return 0


def _hashed(relative: str) -> bool:
    return relative not in UNHASHED and relative != LEGACY and not _OWN_NAME.fullmatch(relative)


def own_files(step_dir: Path, process_index: int, process_count: int) -> list[str]:
    """The files of `step_dir` that process `process_index` wrote (relative paths, sorted). Walks
    only its own process folders: the others' are pruned unread."""
    found = []
    for root, dirs, files in os.walk(step_dir):
        rel_root = os.path.relpath(root, step_dir)
        prefix = "" if rel_root == "." else rel_root.replace(os.sep, "/") + "/"
        dirs[:] = [d for d in dirs if owner(prefix + d, process_count) == process_index
                   or not _PROCESS_PART.search(d)]
        found += [prefix + f for f in files
                  if _hashed(prefix + f) and owner(prefix + f, process_count) == process_index]
    return sorted(found)


def _chunk_digest(path: Path, offset: int, length: int) -> str:
    digest = hashlib.new(ALGORITHM)
    buffer = memoryview(bytearray(min(READ, max(length, 1))))
    with path.open("rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left:
            n = f.readinto(buffer[:min(len(buffer), left)])
            if not n:
                break  # the file is shorter than its size said: the digest will not match
            digest.update(buffer[:n])
            left -= n
    return digest.hexdigest()


def _chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(chunk, size - start)) for start in range(0, size, chunk)] or [(0, 0)]


def hash_files(step_dir: Path, names: list[str], threads: int | None = None) -> dict[str, dict]:
    """{name: {"size", "sha256": [digest per CHUNK]}} for files of `step_dir`, hashed in parallel."""
    sizes = {n: (step_dir / n).stat().st_size for n in names}
    tasks = [(n, offset, length) for n in names for offset, length in _chunks(sizes[n], CHUNK)]
    with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="marin-hash") as pool:
        digests = list(pool.map(lambda t: _chunk_digest(step_dir / t[0], t[1], t[2]), tasks))
    out: dict[str, dict] = {n: {"size": sizes[n], ALGORITHM: []} for n in names}
    for (n, _, _), digest in zip(tasks, digests):
        out[n][ALGORITHM].append(digest)
    return out


def write(step_dir: Path, process_index: int, process_count: int, threads: int | None = None) -> Path:
    """Hash the files this process wrote into `manifest.<process_index>.json`, committed atomically."""
    files = hash_files(step_dir, own_files(step_dir, process_index, process_count), threads)
    body = {"algorithm": ALGORITHM, "chunk_bytes": CHUNK, "process_index": process_index,
            "process_count": process_count, "files": files}
    target = step_dir / name(process_index)
    tmp = target.with_name(target.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(body, f, indent=0)
        f.flush()
        os.fsync(f.fileno())   # the rename below must not commit a manifest whose bytes are not on disk
    os.replace(tmp, target)
    return target


def expected(step_dir: Path) -> int | None:
    """How many per-process manifests the checkpoint was written with: its meta's record, or (meta
    unreadable) what a surviving manifest says; None for a checkpoint from before them."""
    counts = []
    try:
        counts.append(int(json.loads((step_dir / META_FILE).read_text())[META_KEY]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for path in step_dir.glob("manifest.*.json"):
        own = _OWN_NAME.fullmatch(path.name)
        if not own:
            continue
        try:
            counts.append(int(json.loads(path.read_text())["process_count"]))
        except (OSError, ValueError, KeyError, TypeError):  # a damaged manifest still says it exists
            counts.append(int(own.group(1)) + 1)
    return max(counts) if counts else None


def missing(step_dir: Path) -> list[str]:
    """The per-process manifests a checkpoint lacks (empty: complete, or from before manifests)."""
    count = expected(step_dir)
    return [name(p) for p in range(count or 0) if not (step_dir / name(p)).is_file()]


def complete(step_dir: Path) -> bool:
    """Whether a checkpoint counts: every process's manifest is there (or it predates manifests)."""
    return not missing(step_dir)


def kind(step_dir: Path) -> str:
    """"per-process" (this version's manifests), "legacy" (process 0's single manifest) or "none"."""
    if expected(step_dir) is not None:
        return "per-process"
    return "legacy" if (step_dir / LEGACY).is_file() else "none"


def _compare(step_dir: Path, files: dict, chunk: int, threads: int | None) -> str | None:
    """What differs between `files` (a manifest's entries, hashed in `chunk`-byte pieces) and the
    bytes on disk."""
    for n, entry in files.items():
        path = step_dir / n
        if not path.is_file():
            return f"{n} is missing"
        if isinstance(entry, dict) and path.stat().st_size != entry.get("size"):
            return f"{n} has {path.stat().st_size} bytes, its manifest says {entry.get('size')}"
    wanted = [(n, offset, length, expect) for n, entry in files.items() if isinstance(entry, dict)
              for (offset, length), expect in zip(_chunks(entry["size"], chunk), entry[ALGORITHM], strict=True)]
    whole = [(n, entry) for n, entry in files.items() if isinstance(entry, str)]  # the legacy format

    def check(task):
        n, offset, length, expect = task
        return None if _chunk_digest(step_dir / n, offset, length) == expect else n

    def check_whole(item):
        n, expect = item
        with (step_dir / n).open("rb") as f:
            return None if hashlib.file_digest(f, ALGORITHM).hexdigest() == expect else n

    with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="marin-verify") as pool:
        bad = [n for n in list(pool.map(check, wanted)) + list(pool.map(check_whole, whole)) if n]
    return f"{bad[0]} does not match its {ALGORITHM}" if bad else None


def damage(step_dir: Path, process_index: int = 0, process_count: int = 1, threads: int | None = None) -> str | None:
    """What is wrong with this process's share of a checkpoint's bytes (None: they match).

    Process r checks the manifests with index ≡ r mod `process_count` (call `missing` first: a
    manifest that is absent is not damage). A legacy checkpoint is process 0's to check."""
    count = expected(step_dir)
    if count is None:
        if process_index != 0 or not (step_dir / LEGACY).is_file():
            return None
        mine = [step_dir / LEGACY]
    else:
        mine = [step_dir / name(p) for p in range(process_index, count, process_count)]
    for path in mine:
        try:
            body = json.loads(path.read_text())
            files, chunk = body["files"], int(body.get("chunk_bytes", CHUNK))
        except (ValueError, KeyError, OSError, TypeError) as err:
            return f"{path.name} is unreadable ({type(err).__name__})"
        problem = _compare(step_dir, files, chunk, threads)
        if problem:
            return problem
    return None
