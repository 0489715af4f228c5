"""`data.sampling=epoch`: a source drawn e epochs shows min(e, 1) of its tokens, whole epochs
repeat in new orders, and batches stay a pure function of (seed, mixture, step)."""
from __future__ import annotations

import numpy as np
import pytest

from marin.config.validate import ConfigError
from marin.data import sampling
from marin.data.loader import Loader
from marin.launch.checks import load
from tests.data.mixtures import composed, resolved, write_jsonl

T, B = 32, 8  # tests/data/mixtures.py: train.seq_len, train.global_batch


def source(tmp_path, name: str, docs: int, length=lambda i: 20 + (i * 7) % 45):
    write_jsonl(tmp_path / f"{name}.jsonl", [chr(97 + i % 26) * length(i) for i in range(docs)])
    return dict(name=name, kind="jsonl", paths=[f"{name}.jsonl"])


def coverage(loader: Loader, steps: range) -> dict[int, np.ndarray]:
    """{source index: times each token of its stream was an input} over `steps`."""
    seen = {s: np.zeros(int(n), np.int64) for s, n in enumerate(loader._num_tokens)}
    for step in steps:
        _, src, start = loader.rows(step)
        for s, st in zip(src, start):
            np.add.at(seen[s], (st + np.arange(T)) % len(seen[s]), 1)
    return seen


@pytest.mark.parametrize("sampling_mode, expected", [("epoch", 0.78), ("random", 1 - np.exp(-0.78))])
def test_a_fraction_of_an_epoch_shows_that_fraction_of_distinct_tokens(tmp_path, sampling_mode, expected):
    cfg = resolved(tmp_path, [{**source(tmp_path, "a", 480), "weights": [1.0]}], sampling=sampling_mode,
                   overrides=["train.steps=100"])
    loader = Loader(cfg, progress=False)
    n = int(loader._num_tokens[0])
    steps = round(0.78 * n / (B * T))
    epochs = loader.epochs_seen(steps)["a"]
    assert epochs == pytest.approx(0.78, abs=0.01)
    distinct = (coverage(loader, range(steps))[0] > 0).mean()
    if sampling_mode == "epoch":  # every drawn token is new (≤ T overlap where the epoch wraps)
        assert epochs - T / n <= distinct <= epochs
    else:
        assert distinct == pytest.approx(expected, abs=0.05)


def test_whole_epochs_show_every_token_each_in_a_new_order(tmp_path):
    # 64 documents of 31 bytes + end of document: 2048 tokens = 64 chunks of T, 8 steps an epoch.
    a = source(tmp_path, "a", 64, length=lambda i: 31)
    loader = Loader(resolved(tmp_path, [{**a, "weights": [1.0]}]), progress=False)
    assert loader._num_tokens[0] == 64 * T
    counts = coverage(loader, range(20))[0]  # 160 rows = 2.5 epochs
    assert loader.epochs_seen(20) == {"a": 2.5}
    assert set(np.unique(counts)) == {2, 3} and (counts == 3).sum() == 32 * T
    for epoch in range(2):  # each epoch alone shows every token exactly once
        assert (coverage(loader, range(8 * epoch, 8 * epoch + 8))[0] == 1).all()
    first = [set(loader.rows(8 * e)[2] % loader._num_tokens[0]) for e in range(3)]
    assert first[0] != first[1] != first[2]  # a new permutation (and chunk offset) every epoch


def test_each_source_follows_its_own_epochs(tmp_path):
    small, large = source(tmp_path, "small", 40), source(tmp_path, "large", 400)
    cfg = resolved(tmp_path, [{**small, "weights": [0.5]}, {**large, "weights": [0.5]}],
                   overrides=["train.steps=50"])
    loader = Loader(cfg, progress=False)
    epochs = loader.epochs_seen(50)
    seen = coverage(loader, range(50))
    assert epochs["small"] > 3.5 and (seen[0] >= 3).all()  # every token, every full epoch
    assert 0.2 < epochs["large"] < 1
    assert (seen[1] > 0).mean() == pytest.approx(epochs["large"], abs=T / seen[1].size)
    assert (seen[1] > 1).sum() < T  # only where the epoch's last chunk wraps onto its first


@pytest.fixture
def phased(tmp_path):
    srcs = [source(tmp_path, x, n) for x, n in (("a", 60), ("b", 90), ("c", 30), ("unused", 5))]
    weights = [[0.5, 0.1], [0.3, 0.0], [0.2, 0.9], [0.0, 0.0]]
    return resolved(tmp_path, [{**s, "weights": w} for s, w in zip(srcs, weights)], boundaries=[0.4],
                    names=["pretrain", "midtrain"], overrides=["train.steps=30"])


def test_resumed_or_repeated_steps_are_identical_across_a_phase_switch(phased):
    uninterrupted = Loader(phased, progress=False)
    batches = [uninterrupted.batch(s) for s in range(30)]
    assert uninterrupted.boundaries == [12]
    assert batches[11]["source_counts"][1] > 0 and batches[12]["source_counts"][1] == 0
    for k in (3, 12, 13, 29):  # a fresh process resuming at step k (the closed form, not the memo)
        resumed = Loader(phased, progress=False)
        for step in range(k, min(k + 3, 30)):
            for key, value in resumed.batch(step).items():
                np.testing.assert_array_equal(value, batches[step][key], err_msg=f"{key} at {step}")
    again = Loader(phased, progress=False)
    for step in (20, 5, 20, 19, 20):
        for key, value in again.batch(step).items():
            np.testing.assert_array_equal(value, batches[step][key], err_msg=f"{key} at {step}")
    summed = {}
    for step, b in enumerate(batches):
        assert b["source_counts"][3] == 0
        for name, tokens in zip("abc", b["source_counts"]):
            phase = "pretrain" if step < 12 else "midtrain"
            if tokens:
                summed[f"{name}/{phase}"] = summed.get(f"{name}/{phase}", 0) + int(tokens)
    fresh = Loader(phased, progress=False)
    assert fresh.tokens_seen(30) == summed
    assert set(fresh.epochs_seen(30)) == {"a", "b", "c"}  # "unused" is never prepared


def test_processes_partition_the_global_batch(phased):
    whole = Loader(phased, progress=False)
    parts = [Loader(phased, process_index=p, process_count=4, progress=False) for p in range(4)]
    for step in (0, 11, 12, 25):
        full = whole.batch(step)
        for key in ("inputs", "segment_ids", "loss_mask"):
            np.testing.assert_array_equal(np.concatenate([p.batch(step)[key] for p in parts]), full[key])
        # The global rows: each source's share, each row a distinct chunk of its stream.
        counts, src, start = whole.rows(step)
        assert counts.tolist() == np.bincount(src, minlength=4).tolist()
        assert len(set(zip(src.tolist(), start.tolist()))) == B


def test_rows_per_source_have_a_closed_form():
    edges = sampling.boundaries([0.37, 0.0, 0.13, 0.5], 8)
    running = np.zeros(4, np.int64)
    for m in range(600):
        if m % 97 == 0:
            np.testing.assert_array_equal(sampling.rows_before(edges, m, 12345), running)
        step = np.diff(sampling.points_below(edges, sampling.theta(m, 12345)))
        assert step.sum() == 8 and step[1] == 0
        assert (np.floor(8 * np.array([0.37, 0, 0.13, 0.5])) <= step).all()
        running += step
    assert np.abs(running - 600 * 8 * np.array([0.37, 0, 0.13, 0.5])).max() <= 2


def test_permute_is_a_bijection():
    for size in (1, 2, 3, 7, 64, 1000):
        out = sampling.permute(np.arange(size), size, np.uint64(size))
        assert sorted(out.tolist()) == list(range(size))
    assert sampling.permute(np.arange(100), 100, np.uint64(1)).tolist() != list(range(100))


def test_an_unknown_sampling_mode_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(composed(tmp_path, [{**source(tmp_path, "a", 5), "weights": [1.0]}], sampling="shuffled"))
    assert dict(err.value.problems)["data.sampling"] == "must be one of epoch, random; got 'shuffled'"
