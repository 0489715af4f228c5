"""Batches: determinism, resumption, phase switching, per-process sharding, document packing,
under both `data.sampling` modes (epoch-specific properties: test_epoch_sampling.py)."""
from __future__ import annotations

import numpy as np
import pytest

from marin.data.loader import Loader
from tests.data.mixtures import resolved, write_jsonl
from tests.helpers import make_config

EOS = 256  # the byte tokenizer's end-of-document id


def letters(tmp_path, letter: str, docs: int = 50):
    """A source whose documents use one letter only: a batch's tokens tell which source it came from."""
    return write_jsonl(tmp_path / f"{letter}.jsonl", [letter * (5 + i % 17) for i in range(docs)])


@pytest.fixture(params=["epoch", "random"])
def two_phase(tmp_path, request):
    letters(tmp_path, "a"), letters(tmp_path, "b")
    return resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0, 0.0]),
                               dict(name="b", kind="jsonl", paths=["b.jsonl"], weights=[0.0, 1.0])],
                    boundaries=[0.5], names=["pretrain", "midtrain"], sampling=request.param)


@pytest.fixture(params=["epoch", "random"])
def mixed(tmp_path, request):
    letters(tmp_path, "a"), letters(tmp_path, "b"), letters(tmp_path, "c")
    return resolved(tmp_path, [dict(name=x, kind="jsonl", paths=[f"{x}.jsonl"], weights=[w])
                               for x, w in (("a", 0.5), ("b", 0.3), ("c", 0.2))], sampling=request.param)


def assert_same(b1: dict, b2: dict):
    assert b1.keys() == b2.keys()
    for k in b1:
        np.testing.assert_array_equal(b1[k], b2[k], err_msg=k)


def test_two_loaders_give_the_same_batches(mixed):
    first, second = Loader(mixed, progress=False), Loader(mixed, progress=False)
    for step in range(5):
        assert_same(first.batch(step), second.batch(step))
    assert not np.array_equal(first.batch(0)["inputs"], first.batch(1)["inputs"])


def test_the_seed_changes_the_batches(mixed):
    other = type(mixed.train)(**{**mixed.train.__dict__, "seed": 1})
    reseeded = type(mixed)(**{**mixed.__dict__, "train": other})
    assert not np.array_equal(Loader(mixed, progress=False).batch(0)["inputs"],
                              Loader(reseeded, progress=False).batch(0)["inputs"])


def test_restart_at_step_n_sees_the_uninterrupted_batches(mixed):
    uninterrupted = [Loader(mixed, progress=False).batch(s) for s in range(12)]
    restarted = Loader(mixed, progress=False)  # a fresh process, asked for step 7 first
    for step in (7, 8, 9, 10, 11):
        assert_same(restarted.batch(step), uninterrupted[step])


def test_phase_switches_at_the_boundary(two_phase):
    loader = Loader(two_phase, progress=False)
    a, b = ord("a"), ord("b")
    for step in range(two_phase.train.steps):
        batch = loader.batch(step)
        text = set(np.unique(batch["inputs"])) - {EOS}
        expected = a if step < 10 else b  # boundary 0.5 × 20 steps
        assert text == {expected}, step
        assert batch["source_counts"].tolist() == ([256, 0] if step < 10 else [0, 256])
    assert loader.tokens_seen(20) == {"a/pretrain": 2560, "b/midtrain": 2560}


def test_a_shortened_horizon_moves_the_boundary(tmp_path):
    letters(tmp_path, "a"), letters(tmp_path, "b")
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0, 0.0]),
                              dict(name="b", kind="jsonl", paths=["b.jsonl"], weights=[0.0, 1.0])],
                   boundaries=[0.5], overrides=["schedule.horizon_steps=12"])
    loader = Loader(cfg, progress=False)
    assert loader.boundaries == [6]
    assert loader.batch(5)["source_counts"][0] > 0 and loader.batch(6)["source_counts"][0] == 0


def test_processes_load_their_halves_of_the_global_batch(mixed):
    whole = Loader(mixed, progress=False)
    halves = [Loader(mixed, process_index=p, process_count=2, progress=False) for p in range(2)]
    for step in (0, 3, 19):
        full = whole.batch(step)
        parts = [h.batch(step) for h in halves]
        for key in ("inputs", "targets", "segment_ids", "loss_mask"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[key])
            assert parts[0][key].shape[0] == mixed.train.global_batch // 2
        np.testing.assert_array_equal(parts[1]["source_counts"], full["source_counts"])


def test_mixture_weights_are_realised(mixed):
    loader = Loader(mixed, progress=False)
    seen = loader.tokens_seen(mixed.train.steps)
    total = sum(seen.values())
    assert total == mixed.train.steps * mixed.train.global_batch * mixed.train.seq_len
    summed = sum(loader.batch(s)["source_counts"] for s in range(mixed.train.steps))
    assert seen == {f"{n}/p0": int(c) for n, c in zip("abc", summed) if c}
    many = np.asarray([int(v) for v in Loader(mixed, progress=False).tokens_seen(200).values()])
    # epoch: every step gives ⌊B·w⌋ or ⌈B·w⌉ rows, a few rows off in all; random: binomial noise.
    atol = 0.002 if mixed.data.sampling == "epoch" else 0.03
    np.testing.assert_allclose(many / many.sum(), [0.5, 0.3, 0.2], atol=atol)


def test_rows_respect_document_boundaries(mixed):
    batch = Loader(mixed, progress=False).batch(3)
    inputs, targets, seg, mask = (batch[k] for k in ("inputs", "targets", "segment_ids", "loss_mask"))
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert (seg[:, 0] == 1).all()
    # A new segment starts right after each end-of-document input...
    np.testing.assert_array_equal(seg[:, 1:] - seg[:, :-1], (inputs[:, :-1] == EOS).astype(int))
    # ...and (data.loss_targets=causal, production's) the target crossing into it is scored too:
    # every position but the row's last.
    assert mask[:, :-1].all() and not mask[:, -1].any()


def test_the_document_rule_scores_no_target_across_a_boundary(tmp_path):
    letters(tmp_path, "a")
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])], loss_targets="document")
    batch = Loader(cfg, progress=False).batch(3)
    np.testing.assert_array_equal(batch["loss_mask"], (batch["inputs"] != EOS).astype(np.float32))


# One row of T = 8 from [T+1]-token windows: document 1 = "a b EOS", document 2 = "c d e EOS",
# then padding (document index -1). Position i's input is window[i], its target window[i+1].
WINDOW = np.array([[97, 98, EOS, 99, 100, 101, EOS, 0, 0]])
DOC = np.array([[1, 1, 1, 2, 2, 2, 2, -1, -1]])


def test_two_documents_give_each_rules_masks():
    from marin.data.loader import _pack

    causal, document = (_pack(WINDOW, DOC, 8, rule) for rule in ("causal", "document"))
    # targets:            b  EOS  c  d  e  EOS pad pad
    assert causal["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]     # c after EOS scored
    assert document["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 0, 0]]   # c after EOS not
    for batch in (causal, document):
        assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2, 0]]
        assert batch["targets"].tolist() == [WINDOW[0, 1:].tolist()]


def test_causal_drops_the_rows_last_position_only():
    from marin.data.loader import _pack

    full = np.arange(9)[None] % 5 + 97
    one_doc = _pack(full, np.ones_like(full), 8, "causal")["loss_mask"]
    assert one_doc.tolist() == [[1] * 7 + [0]]                              # T - 1 scored targets
    assert _pack(full, np.ones_like(full), 8, "document")["loss_mask"].tolist() == [[1] * 8]


def test_default_run_uses_the_builtin_mixture():
    cfg = make_config()
    loader = Loader(cfg, progress=False)
    batch = loader.batch(0)
    assert batch["inputs"].shape == (cfg.train.global_batch, cfg.train.seq_len)
    assert loader.source_names == ["python_docs", "python_stdlib"]
    assert loader.vocab_size <= cfg.model.vocab_size
    evals = loader.eval_batches()
    assert set(evals) == {"python_docs_heldout", "python_stdlib_heldout"}
    for batches in evals.values():
        assert len(batches) == cfg.train.eval_batches
        assert all(b["loss_mask"].sum() > 0 for b in batches)
        assert all(b["inputs"].shape == (cfg.train.eval_batch_size, cfg.train.seq_len) for b in batches)
    assert loader.eval_batches() is evals  # prepared once


@pytest.mark.parametrize("rule, first_row", [("causal", 31), ("document", 30)])
def test_eval_batches_pad_a_small_set(tmp_path, rule, first_row):
    write_jsonl(tmp_path / "a.jsonl", ["x" * 40] * 20)
    write_jsonl(tmp_path / "held.jsonl", ["held out text"] * 3)
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])],
                   eval_sets=[dict(name="held", kind="jsonl", paths=["held.jsonl"])], loss_targets=rule)
    (batch,) = Loader(cfg, progress=False).eval_batches()["held"]
    # 3 × (13 bytes + end of document) = 42 tokens: row 0 holds 32 inputs (causal: all but its last
    # position scored; document: not the 2 that cross a boundary), row 1 the last 10 (9 with a
    # target), the other rows of the eval batch (64 per rack) are padding.
    rows = cfg.train.eval_batch_size
    assert rows == 64 and batch["loss_mask"].shape == (rows, 32)
    assert batch["loss_mask"].sum(axis=1).tolist() == [first_row, 9] + [0] * (rows - 2)
    assert (batch["segment_ids"][1] > 0).sum() == 10 and (batch["segment_ids"][2:] == 0).all()


def test_every_batch_of_a_set_by_default_the_last_padded(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x" * 40] * 20)
    write_jsonl(tmp_path / "held.jsonl", ["held out text " * 20] * 30)   # 30 × 281 tokens: 264 rows of 32
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])],
                   eval_sets=[dict(name="held", kind="jsonl", paths=["held.jsonl"])],
                   overrides=["train.eval_batches=null", "train.eval_batch_size=16"])
    loader = Loader(cfg, progress=False)
    batches = loader.eval_batches()["held"]
    tokens = loader.eval_shards["held"].num_tokens
    rows = -(-(tokens - 1) // 32)
    assert len(batches) == -(-rows // 16) > 2                    # every batch, not train.eval_batches' old 2
    last = batches[-1]
    padding = len(batches) * 16 - rows
    assert padding > 0 and (last["segment_ids"][16 - padding:] == 0).all()
    assert (last["loss_mask"][16 - padding:] == 0).all() and last["loss_mask"][: 16 - padding].sum() > 0
    # the two processes of a job each load their half of every batch
    halves = [Loader(cfg, process_index=p, process_count=2, progress=False).eval_batches()["held"] for p in (0, 1)]
    for whole, a, b in zip(batches, *halves):
        np.testing.assert_array_equal(whole["inputs"], np.concatenate([a["inputs"], b["inputs"]]))


def test_tokens_seen_resumes_from_saved_totals(mixed):
    uninterrupted = Loader(mixed, progress=False)
    saved = uninterrupted.tokens_seen(7)
    restarted = Loader(mixed, progress=False)
    restarted.resume_tokens_seen(7, saved)
    assert restarted.tokens_seen(15) == uninterrupted.tokens_seen(15)
