"""A mixture change at resume keeps every read position (issue 18 item 5; spec §8, the hero's swap
at step 108,000): each source continues where the checkpoint left it, under the new weights."""
from __future__ import annotations

import json

import numpy as np
import pytest

from marin.data.loader import Loader
from tests.data.mixtures import resolved, write_jsonl

T, B, SWAP, END = 32, 8, 10, 20  # tests/data/mixtures.py: train.seq_len, train.global_batch
A = (0.5, 0.3, 0.2)
B_WEIGHTS = (0.125, 0.25, 0.625)


def mixture(tmp_path, weights, sampling="epoch"):
    for i, x in enumerate("abc"):  # big enough that 20 steps stay inside every source's first epoch
        write_jsonl(tmp_path / f"{x}.jsonl", [x * (20 + (j * 7 + i) % 45) for j in range(400)])
    return resolved(tmp_path, [dict(name=x, kind="jsonl", paths=[f"{x}.jsonl"], weights=[w])
                               for x, w in zip("abc", weights)], sampling=sampling)


def checkpoint_meta(loader: Loader, step: int) -> dict:
    """What the Trainer saves (marin.train.trainer.Trainer.meta), through JSON as orbax stores it."""
    return json.loads(json.dumps({"tokens_seen": loader.tokens_seen(step), "data": loader.position(step)}))


def coverage(pieces) -> dict[int, np.ndarray]:
    """{source: times each token of its stream was an input} over (loader, steps) pieces."""
    seen = {}
    for loader, steps in pieces:
        for step in steps:
            _, src, start = loader.rows(step)
            for s, st in zip(src, start):
                c = seen.setdefault(int(s), np.zeros(int(loader._num_tokens[s]), np.int64))
                np.add.at(c, (st + np.arange(T)) % len(c), 1)
    return seen


@pytest.fixture
def swap(tmp_path):
    """(run on A, the same run resumed on B at step SWAP, B started from scratch)."""
    on_a = Loader(mixture(tmp_path, A), progress=False)
    on_b = Loader(mixture(tmp_path, B_WEIGHTS), progress=False)
    on_b.resume(SWAP, checkpoint_meta(on_a, SWAP))
    return on_a, on_b, Loader(mixture(tmp_path, B_WEIGHTS), progress=False)


def test_no_document_is_read_twice_across_the_swap(swap):
    on_a, on_b, fresh_b = swap
    assert all(e < 1 for e in on_b.epochs_seen(END).values())  # still every source's first epoch
    seen = coverage([(on_a, range(SWAP)), (on_b, range(SWAP, END))])
    assert all(c.max() == 1 for c in seen.values())  # each token an input once: no chunk twice
    drawn = {s: int(c.sum()) // T for s, c in seen.items()}
    assert drawn == {i: sum(v for k, v in on_b.position(END)["rows"].items() if k.startswith(f"{x}/"))
                     for i, x in enumerate("abc")}
    # Positions from the current weights' formula (the behaviour this replaces) re-read chunks:
    stale = coverage([(on_a, range(SWAP)), (fresh_b, range(SWAP, END))])
    assert any(c.max() > 1 for c in stale.values())


def test_tokens_after_the_swap_follow_the_new_weights(swap):
    on_a, on_b, _ = swap
    before = on_a.tokens_seen(SWAP)
    after = on_b.tokens_seen(END)
    assert on_b.tokens_seen(SWAP) == before
    per_step = []
    for step in range(SWAP, END):
        counts = on_b.batch(step)["source_counts"] // T
        per_step.append(counts)
        assert (np.floor(B * np.asarray(B_WEIGHTS)) <= counts).all() and (counts <= np.ceil(B * np.asarray(B_WEIGHTS))).all()
    gained = {x: after[f"{x}/p0"] - before.get(f"{x}/p0", 0) for x in "abc"}
    assert gained == {x: int(n) * T for x, n in zip("abc", np.sum(per_step, axis=0))}
    total = (END - SWAP) * B * T
    for x, w in zip("abc", B_WEIGHTS):
        assert gained[x] == pytest.approx(w * total, abs=2 * T)  # a discrepancy of a row or two


def test_a_resume_on_the_same_mixture_sees_the_uninterrupted_batches(tmp_path):
    uninterrupted = Loader(mixture(tmp_path, A), progress=False)
    resumed = Loader(mixture(tmp_path, A), progress=False)
    resumed.resume(SWAP, checkpoint_meta(uninterrupted, SWAP))
    assert resumed._anchor is not None and not resumed._anchor[2].any()
    for step in (SWAP, SWAP + 1, SWAP + 7, SWAP + 6):
        b1, b2 = uninterrupted.batch(step), resumed.batch(step)
        for k in b1:
            np.testing.assert_array_equal(b1[k], b2[k], err_msg=k)
    assert resumed.tokens_seen(END) == uninterrupted.tokens_seen(END)


def test_a_second_resume_on_b_continues_the_first(swap, tmp_path):
    """Batches are a pure function of (seed, mixture history, step): resuming again at step 15 on
    B (positions saved by the resumed run) changes nothing."""
    _, on_b, _ = swap
    again = Loader(mixture(tmp_path, B_WEIGHTS), progress=False)
    again.resume(15, checkpoint_meta(on_b, 15))
    for step in (15, 16, 19):
        np.testing.assert_array_equal(on_b.rows(step)[2], again.rows(step)[2])
    assert again.position(END) == on_b.position(END)


def test_positions_of_another_row_length_are_converted_not_dropped(tmp_path):
    """Rows saved at twice this length continue at twice as many rows of this one (a context
    stage's positions: tests/data/test_stage_positions.py), not at the current mixture's formula."""
    on_a = Loader(mixture(tmp_path, A), progress=False)
    meta = checkpoint_meta(on_a, SWAP)
    meta["data"]["seq_len"] = 2 * T
    on_b = Loader(mixture(tmp_path, B_WEIGHTS), progress=False)
    on_b.resume(SWAP, meta)
    saved = [sum(v for k, v in meta["data"]["rows"].items() if k.startswith(f"{x}/")) for x in "abc"]
    assert on_b._rows_before(SWAP).tolist() == [2 * r for r in saved]
    fresh = Loader(mixture(tmp_path, B_WEIGHTS), progress=False)
    assert on_b._rows_before(SWAP).tolist() != fresh._rows_before(SWAP).tolist()
