"""A context-extension stage keeps every cell's read position across a change of seq_len (issue 40
item 6; spec §9 "Context launcher": each bucket resumes at its next shuffle window): with
`data.shuffle_window` a multiple of both lengths, each source's first new-length chunk starts where
the parent's last chunk ended, rounded up to a whole chunk of the new length; nothing is read twice
and nothing is skipped beyond that rounding."""
from __future__ import annotations

import numpy as np

from marin.data import sampling
from marin.data.loader import OFFSET_STREAM, Loader
from tests.data.mixtures import resolved, write_jsonl
from tests.data.test_mixture_swap import checkpoint_meta

OLD, NEW, B, N, END, WINDOW = 32, 64, 8, 11, 20, 128
WEIGHTS = (0.5, 0.3, 0.2)


def loader(tmp_path, seq_len: int, window: int = WINDOW) -> Loader:
    for i, x in enumerate("abc"):  # big enough that 20 steps stay inside every source's first epoch
        write_jsonl(tmp_path / f"{x}.jsonl", [x * (20 + (j * 7 + i) % 45) for j in range(600)])
    cfg = resolved(tmp_path, [dict(name=x, kind="jsonl", paths=[f"{x}.jsonl"], weights=[w])
                              for x, w in zip("abc", WEIGHTS)],
                   overrides=[f"train.seq_len={seq_len}"], shuffle_window=window)
    return Loader(cfg, progress=False)


def start_of(ld: Loader, s: int, drawn: int) -> int:
    """Where source s's `drawn`-th row ever (first epoch) starts in its stream."""
    chunk = ld._shuffled(np.asarray([drawn]), ld._chunks[s:s + 1], ld._ids[s:s + 1], np.asarray([0]))[0]
    offset = int(sampling.key(ld.seed, OFFSET_STREAM, ld._ids[s], 0)[0] % np.uint64(ld._num_tokens[s]))
    return int((offset + chunk * ld.seq_len) % ld._num_tokens[s])


def reads(ld: Loader, steps) -> dict[int, list[tuple[int, int]]]:
    """{source: [(its row index ever, start in the stream)]} over `steps`, in read order; the
    starts are the loader's own (`rows`), matched to the indices its position says come next."""
    out: dict[int, list[tuple[int, int]]] = {}
    for step in steps:
        counts, src, start = ld.rows(step)
        before = ld._rows_before(step)
        for s in range(len(counts)):
            expected = {start_of(ld, s, d): d for d in range(int(before[s]), int(before[s] + counts[s]))}
            got = start[src == s].tolist()
            assert sorted(got) == sorted(expected)  # the rows read are the next ones of the order
            out.setdefault(s, []).extend((expected[g], g) for g in got)
    return {s: sorted(v) for s, v in out.items()}


def stage(tmp_path, window: int = WINDOW):
    parent = loader(tmp_path, OLD, window)
    child = loader(tmp_path, NEW, window)
    child.resume(N, checkpoint_meta(parent, N))
    return parent, child


def test_each_cell_continues_at_its_next_whole_chunk_of_the_new_length(tmp_path):
    parent, child = stage(tmp_path)
    drawn = {x: sum(v for k, v in parent.position(N)["rows"].items() if k.startswith(f"{x}/")) for x in "abc"}
    before = reads(parent, range(N))
    after = reads(child, range(N, END))
    for s, x in enumerate("abc"):
        rows, T = drawn[x], parent._num_tokens[s]
        assert all(e < 1 for e in child.epochs_seen(END).values())  # the first epoch throughout
        assert int(child._rows_before(N)[s]) == -(-rows * OLD // NEW)  # the next whole chunk of 64 tokens
        last_end = (before[s][-1][1] + OLD) % T
        first = after[s][0][1]
        if -(-rows * OLD // NEW) * NEW % WINDOW:  # inside a window: the text goes on, after the rounding (0 or 32 tokens)
            assert (first - last_end) % T == (-rows * OLD) % NEW
        else:  # the window was done: a new window of the epoch's order begins
            offset = int(sampling.key(child.seed, OFFSET_STREAM, child._ids[s], 0)[0] % np.uint64(T))
            assert (first - offset) % T % WINDOW == 0


def test_nothing_is_read_twice_and_only_the_rounding_is_skipped(tmp_path):
    parent, child = stage(tmp_path)
    for s in range(3):
        T = int(parent._num_tokens[s])
        seen = np.zeros(T, np.int64)
        for ld, steps, length in ((parent, range(N), OLD), (child, range(N, END), NEW)):
            for _, start in reads(ld, steps).get(s, []):
                np.add.at(seen, (start + np.arange(length)) % T, 1)
        assert seen.max() == 1  # nothing re-read
        rows = sum(v for k, v in parent.position(N)["rows"].items() if k.startswith("abc"[s] + "/"))
        gap = (-rows * OLD) % NEW  # the rounding: under one new-length chunk
        extent = int(child._rows_before(END)[s]) * NEW  # the epoch's read order, covered up to here
        assert int(seen.sum()) == extent - gap


def test_without_a_window_each_source_keeps_its_share_of_the_epoch(tmp_path):
    parent, child = stage(tmp_path, window=0)
    for s, x in enumerate("abc"):
        rows = sum(v for k, v in parent.position(N)["rows"].items() if k.startswith(f"{x}/"))
        assert int(child._rows_before(N)[s]) == -(-rows * OLD // NEW)
    assert child.position(N)["seq_len"] == NEW
    assert sum(child.position(N)["rows"].values()) == int(child._rows_before(N).sum())
