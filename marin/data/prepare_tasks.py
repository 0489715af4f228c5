"""Data preparation as tasks: the plan (sources → file groups → tasks) and what one task does.

A source's input files are cut into **groups**: consecutive files of at most `data.shard_tokens`
bytes together (a file larger is a group alone), fixed by the files alone. A group is tokenized
into shards ``<group>-<part>`` (`marin.data.shards`), each ≤ `data.shard_tokens` tokens, cut at
the first document that would not fit. A task is a list of groups (balanced by bytes); any number
of tasks gives the same shards, and a source's index lists them in group then part order.

Resuming: a group is made under a lock (`_group_lock`, flock), so two preparers of it take turns;
a group whose shards all verify is skipped; otherwise its tokenizing restarts at the
input record where its first missing (or damaged) shard began (each manifest records its records
``[start, end)``). The task that completes a source's last group writes its index.

Bad input (`marin.data.documents.Record`): each shard's manifest counts its records by reason; a
shard whose bad records exceed `data.max_bad_fraction` of its records is not written, and its
task fails with `BadInput` naming the first bad record's file and line.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from marin.data import shards
from marin.data.documents import BAD_REASONS, UnreadableSource, piece, records, split_piece
from marin.data.tokenizers import load_tokenizer, token_dtype

log = logging.getLogger("marin.data")
BATCH_CHARS = 4_000_000  # characters handed to the tokenizer at once
AUTO_SLURM_TASKS = 1000
# "<task>:<n>": that task kills itself (SIGKILL) at its n-th document, mid-shard: the fault the
# tests inject into a Slurm array, whose tasks run where a test cannot reach in.
KILL_VARIABLE = "MARIN_PREPARE_KILL_AT"


class BadInput(UnreadableSource):
    """A shard's input has more bad records than `data.max_bad_fraction` allows."""


@dataclass
class SourcePlan:
    """One source (or eval set) to prepare: picklable, for a process pool or a Slurm array."""
    field: str          # the config field, for messages
    name: str
    kind: str
    text_field: str
    key: str
    dir: str            # <cache>/<key>
    groups: list[list[str]]   # inputs (file paths; builtin: locations) of each group
    group_bytes: list[int]
    tokens: int | None = None  # available tokens, from the config (the cells' table)
    pointer: str = ""   # <cache>/by-config/<config key>.json: names this cache once it is indexed
    inputs: list = field(default_factory=list)   # the inputs record (files, sizes, mtimes) of `key`
    # per group: [first, end) of the records of its inputs it holds, or None (all of them): a large
    # input split into several groups (the built-in text, `marin.data.builtin.ranges`)
    group_records: list = field(default_factory=list)

    def records_of(self, g: int) -> tuple[int, int | None]:
        r = self.group_records[g] if g < len(self.group_records) else None
        return (0, None) if r is None else (r[0], r[1])

    @property
    def inputs_in_order(self) -> list[str]:
        """Every input once, in order (split inputs are named by several groups)."""
        return list(dict.fromkeys(f for g in self.groups for f in g))

    @property
    def files(self) -> list[str]:
        """Every input file once, in order (a split file's pieces counted as one)."""
        return list(dict.fromkeys(split_piece(f)[0] for g in self.groups for f in g))


@dataclass
class Plan:
    tokenizer: str
    shard_tokens: int
    max_bad_fraction: float
    sources: list[SourcePlan]
    tasks: list[list[tuple[int, int]]] = field(default_factory=list)  # (source, group) per task

    @property
    def units(self) -> list[tuple[int, int]]:
        return [(s, g) for s, src in enumerate(self.sources) for g in range(len(src.groups))]


# An uncompressed JSONL file larger than this is cut into pieces of this many bytes (each a group,
# its lines those beginning in it: `marin.data.documents.piece`), so a pool balances a corpus of a
# few large files; fixed by the files alone, never by the task count.
PIECE_BYTES = 64 << 20


def _pieces(f: Path, size: int, kind: str) -> list[tuple[str, int]]:
    if kind != "jsonl" or f.suffix == ".gz" or size <= PIECE_BYTES:
        return [(str(f), size)]
    return [(piece(f, a, min(a + PIECE_BYTES, size)), min(PIECE_BYTES, size - a)) for a in range(0, size, PIECE_BYTES)]


def group_files(files: list[Path], limit: int, kind: str = "") -> list[tuple[list[str], int]]:
    """Consecutive inputs of at most `limit` bytes together (a larger one alone): (inputs, bytes);
    a large uncompressed JSONL file's inputs are its pieces (`PIECE_BYTES`), each a group alone."""
    groups: list[tuple[list[str], int]] = []
    for f in files:
        pieces = _pieces(f, f.stat().st_size, kind)
        for item, size in pieces:
            if len(pieces) == 1 and groups and groups[-1][1] + size <= limit and not groups[-1][2]:
                groups[-1][0].append(item)
                groups[-1] = (groups[-1][0], groups[-1][1] + size, False)
            else:
                groups.append(([item], size, len(pieces) > 1))
    return [(g, b) for g, b, _ in groups]


def assign(plan: Plan, count: int) -> None:
    """`plan.tasks`: its groups over `count` tasks (at most one per group), the largest groups
    first to the task with the fewest bytes (ties: the fewest groups, then the lower task); every
    task's groups in order."""
    units = plan.units
    count = max(1, min(count, len(units)))
    load, tasks = [0] * count, [[] for _ in range(count)]
    size = {u: plan.sources[u[0]].group_bytes[u[1]] for u in units}
    for u in sorted(units, key=lambda u: (-size[u], u)):
        t = min(range(count), key=lambda i: (load[i], len(tasks[i]), i))   # sizes unknown (built-in): by count
        tasks[t].append(u)
        load[t] += size[u]
    plan.tasks = [sorted(t) for t in tasks if t]


# ----------------------------------------------------------------------------------- one group

def _existing(src_dir: Path, group: int, full: bool = True, first: int = 0) -> tuple[list[dict], int, bool]:
    """The group's shards already made that verify (`full`: their hashes too, else their sizes),
    in order, until the first missing or damaged one: (manifests, record to restart at (`first`, its
    first record, when none is made), whether the group is complete)."""
    done, part = [], 0
    while (m := shards.verify_shard(src_dir / shards.shard_id(group, part), full)) is not None:
        done.append(m)
        if m["last"]:
            return done, m["records"][1], True
        part += 1
    return done, (done[-1]["records"][1] if done else first), False


def _adopt(src_dir: Path, group: int, done: list[dict]) -> bool:
    """Append to `done` the verified shards already there that continue it; whether they
    complete the group."""
    while (m := shards.verify_shard(src_dir / shards.shard_id(group, len(done)))) is not None \
            and m["records"][0] == done[-1]["records"][1]:
        done.append(m)
        if m["last"]:
            return True
    return False


def _encoded(stream, tok, eos):
    """(record, ids or None) in order, the good documents encoded in batches."""
    batch, chars = [], 0
    for rec in stream:
        batch.append(rec)
        chars += len(rec.text) if rec.text is not None else 0
        if chars >= BATCH_CHARS:
            yield from _encode(batch, tok, eos)
            batch, chars = [], 0
    yield from _encode(batch, tok, eos)


def _encode(batch, tok, eos):
    good = [r for r in batch if r.text is not None]
    ids = iter(tok.encode_batch([r.text for r in good]) if good else [])
    for rec in batch:
        yield rec, (np.concatenate([next(ids), eos]) if rec.text is not None else None)


class _Part:
    """The shard being written and its input counts."""

    def __init__(self, src_dir: Path, group: int, part: int, start: int, dtype):
        shards.remove_temporaries(src_dir, shards.shard_id(group, part))
        self.writer = shards.ShardWriter(src_dir, shards.shard_id(group, part), dtype)
        self.group, self.part, self.start = group, part, start
        self.counts = dict.fromkeys((*BAD_REASONS, "empty"), 0)
        self.records, self.first_bad = 0, None

    def finish(self, plan: Plan, source: SourcePlan, end: int, last: bool) -> dict:
        bad = sum(self.counts[r] for r in BAD_REASONS)
        if bad > plan.max_bad_fraction * self.records:
            self.writer.abort()
            raise BadInput(f"{bad} of {self.records} input records of shard {self.writer.final.name} are bad "
                           f"({', '.join(f'{r} {n}' for r, n in self.counts.items() if n and r != 'empty')}), "
                           f"over data.max_bad_fraction={plan.max_bad_fraction:g}; the first: {self.first_bad}")
        return self.writer.finish({"source": source.name, "group": self.group, "part": self.part,
                                   "inputs": source.groups[self.group], "records": [self.start, end],
                                   "counts": self.counts, "first_bad": self.first_bad, "last": last})


@contextlib.contextmanager
def _group_lock(src_dir: Path, group: int):
    """Held while a group is checked and made: a second preparer of it waits, then finds it made
    (and temporaries found under the lock are a dead preparer's). The kernel drops it when its
    process dies; the file stays (unlinking a lock others may wait on would let two hold it)."""
    src_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(src_dir / f".lock-{group:06d}", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


def run_group(plan: Plan, s: int, g: int, tok, progress=None) -> list[dict]:
    """The manifests of group `g` of source `s`: its verified shards kept, the rest made now."""
    with _group_lock(Path(plan.sources[s].dir), g):
        return _run_group(plan, s, g, tok, progress)


def _run_group(plan: Plan, s: int, g: int, tok, progress) -> list[dict]:
    source = plan.sources[s]
    src_dir = Path(source.dir)
    first, end = source.records_of(g)
    done, start, complete = _existing(src_dir, g, first=first)
    if complete:
        return done
    dtype = token_dtype(tok.vocab_size)
    eos = np.asarray([] if tok.eos_id is None else [tok.eos_id], np.uint32)
    part = _Part(src_dir, g, len(done), start, dtype)
    position = {"from": start}   # records before it are in shards already made (read, not tokenized)
    inputs = records(source.kind, source.groups[g], source.text_field)
    if end is not None:   # the group's share of a split input
        inputs = itertools.takewhile(lambda r: r.number < end, inputs)
    stream = (r for r in inputs if r.number >= position["from"])
    try:
        for rec, ids in _encoded(stream, tok, eos):
            if rec.number < position["from"]:
                continue
            reason = rec.reason
            if ids is not None and len(ids) > plan.shard_tokens:
                reason = "huge"
            if ids is not None and reason is None and part.writer.tokens + len(ids) > plan.shard_tokens:
                done.append(part.finish(plan, source, rec.number, last=False))
                if _adopt(src_dir, g, done):   # the rest was made before (a damaged shard redone)
                    return done
                position["from"] = done[-1]["records"][1]
                part = _Part(src_dir, g, len(done), position["from"], dtype)
                if rec.number < position["from"]:
                    continue
            part.records += 1
            if reason is None:
                part.writer.append(ids)
                if progress is not None:
                    progress(len(ids))
            else:
                part.counts[reason] += 1
                if reason != "empty" and part.first_bad is None:
                    part.first_bad = f"{rec.where}: {reason.replace('_', ' ')}"
        done.append(part.finish(plan, source, part.start + part.records, last=True))
    except BaseException:
        part.writer.abort()
        raise
    return done


# ----------------------------------------------------------------------------------- a task

def finalize(plan: Plan, s: int) -> bool:
    """Write source `s`'s index if all its groups are complete; whether it is (now) indexed.

    Raises `UnreadableSource`, naming the source's config field, when it holds no readable document."""
    source = plan.sources[s]
    src_dir = Path(source.dir)
    manifests = []
    for g in range(len(source.groups)):
        done, _, complete = _existing(src_dir, g, full=False, first=source.records_of(g)[0])   # their tasks hashed them
        if not complete:
            return False
        manifests += done
    counts: dict[str, int] = {}
    for m in manifests:
        for r, n in m["counts"].items():
            counts[r] = counts.get(r, 0) + n
    corrupt = sum(counts.get(r, 0) for r in BAD_REASONS)
    if not any(m["documents"] for m in manifests):
        first = next((m["first_bad"] for m in manifests if m["first_bad"]), None)
        raise UnreadableSource(f"{source.field} ({source.name}): the source is empty: no readable document "
                               f"({corrupt} corrupt skipped){'; the first: ' + first if first else ''}")
    inputs = write_inputs(src_dir, source.inputs)
    index = shards.write_index(src_dir, source.name, manifests,
                               {"key": source.key, "kind": source.kind, "tokenizer": plan.tokenizer,
                                "corrupt": corrupt, "counts": counts, "inputs": inputs})
    write_pointer(source, index)
    if corrupt:
        log.warning("source %s: skipped %d bad input record(s) of %d", source.name, corrupt,
                    corrupt + sum(m["documents"] for m in manifests))
    return True


INPUTS = "inputs.json"


def write_inputs(src_dir: Path, inputs: list) -> str:
    """The inputs record (every file's path, size and modification time, as the cache key hashed
    them) beside the index; its hash, which the index and the source's pointer both hold."""
    data = json.dumps(inputs).encode()
    shards._atomic_write(src_dir / INPUTS, data)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def write_pointer(source: SourcePlan, index: dict) -> None:
    """Point the source's config key at this (indexed) cache: what a training process opens
    without planning (`marin.data.prepare.open_prepared`)."""
    if not source.pointer:
        return
    pointer = Path(source.pointer)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": source.key, "dir": source.dir, "inputs": index.get("inputs"), "name": source.name}
    try:
        if json.loads(pointer.read_text()) == record:
            return
    except (OSError, ValueError):
        pass
    shards._atomic_write(pointer, json.dumps(record, indent=1).encode())


def run_task(plan: Plan, task: int, progress=None) -> int:
    """Task `task` of the plan: its groups, then the index of every source it completed; returns
    the tokens of its groups. What a pool worker and a Slurm array task run."""
    tok = load_tokenizer(plan.tokenizer)
    progress = _with_fault(task, progress)
    tokens, touched = 0, []
    for s, g in plan.tasks[task]:
        try:
            tokens += sum(m["tokens"] for m in run_group(plan, s, g, tok, progress))
        except UnreadableSource as err:
            raise type(err)(f"{plan.sources[s].field} ({plan.sources[s].name}): {err}") from err
        if s not in touched:
            touched.append(s)
    for s in touched:
        finalize(plan, s)
    return tokens


def _with_fault(task: int, progress):
    """`progress`, and the kill `KILL_VARIABLE` asks of this task."""
    at = os.environ.get(KILL_VARIABLE, "")
    if not at or int(at.split(":")[0]) != task:
        return progress
    left = [int(at.split(":")[1])]

    def count(n: int) -> None:
        left[0] -= 1
        if left[0] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if progress is not None:
            progress(n)
    return count


def estimated_shards(source: SourcePlan, tokens: float | None, shard_tokens: int) -> int:
    """Shards a source will have: its groups, more where its tokens overflow them."""
    by_tokens = math.ceil(tokens / shard_tokens) if tokens else 0
    return max(len(source.groups), by_tokens, 1)
