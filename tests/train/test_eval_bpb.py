"""Bits per byte per eval set (issue 18 item 7): the loss over the set's scored tokens, in bits,
divided by their UTF-8 bytes; checked against a hand count on a tiny set."""
from __future__ import annotations

import math

import numpy as np
import pytest

from marin.data.loader import Loader
from marin.train.components import Evaluator
from tests.data.mixtures import resolved, write_jsonl

V = 258  # the byte tokenizer's vocabulary


class Tracker:
    def __init__(self):
        self.rows = {}

    def log_metrics(self, row, step):
        self.rows.update(row)


def uniform_eval_step(state, batch):
    """A model that spreads its probability evenly over the vocabulary: ln V nats per token."""
    mask = np.asarray(batch["loss_mask"])
    return {"loss": float((mask * math.log(V)).sum() / mask.sum()),
            "loss_dropped": float((mask * 2 * math.log(V)).sum() / mask.sum())}


def tiny_sets(tmp_path, rule: str) -> Loader:
    write_jsonl(tmp_path / "tiny.jsonl", ["ab", "é"])
    write_jsonl(tmp_path / "ascii.jsonl", ["abc"])  # a b c EOS: scored b c EOS = 3 tokens, 2 bytes
    write_jsonl(tmp_path / "train.jsonl", ["x" * 50] * 20)
    cfg = resolved(tmp_path, [dict(name="t", kind="jsonl", paths=["train.jsonl"], weights=[1.0])],
                   eval_sets=[dict(name="tiny", kind="jsonl", paths=["tiny.jsonl"]),
                              dict(name="ascii", kind="jsonl", paths=["ascii.jsonl"])], loss_targets=rule)
    return Loader(cfg, progress=False)


@pytest.fixture
def loader(tmp_path):
    # Set "tiny": documents "ab" and "é" (2 UTF-8 bytes) → a b EOS c3 a9 EOS. Scored targets by
    # data.loss_targets=document (the target in the input's document): b (1 byte), EOS (0), a9 (1),
    # EOS (0); c3 starts a new document after EOS and is not scored. 4 tokens, 2 bytes.
    return tiny_sets(tmp_path, "document")


def test_bytes_per_scored_token_by_hand(loader):
    assert loader.eval_bytes_per_token() == {"tiny": 2 / 4, "ascii": 2 / 3}


def test_bytes_per_scored_token_by_hand_causal(tmp_path):
    # causal (production's): c3 after the EOS is scored too: b c3 a9 = 3 bytes over 5 tokens.
    assert tiny_sets(tmp_path, "causal").eval_bytes_per_token() == {"tiny": 3 / 5, "ascii": 2 / 3}


def test_a_padded_batch_weighs_its_scored_tokens(loader):
    """The set's loss is the mean over its scored tokens: batches weighed by their counts."""
    batches = [{"loss_mask": np.ones((1, 4))}, {"loss_mask": np.array([[1.0, 0, 0, 0]])}]
    loader._eval = {"tiny": batches}
    losses = iter([1.0, 6.0])
    step = lambda state, batch: {"loss": next(losses), "scored": float(batch["loss_mask"].sum())}  # noqa: E731
    out = Evaluator(loader.cfg, step, loader, lambda b: b, Tracker(), lambda line: None, stop=20).run(20, None)
    assert out["eval/tiny/loss"] == pytest.approx((4 * 1.0 + 1 * 6.0) / 5)


def test_bits_per_byte_per_set_and_their_macro_average(loader):
    tracker = Tracker()
    evaluator = Evaluator(loader.cfg, uniform_eval_step, loader, lambda b: b, tracker, lambda line: None, stop=20)
    out = evaluator.run(20, None)
    bits = math.log2(V)  # per token
    assert out["eval/tiny/loss"] == pytest.approx(math.log(V))
    assert out["eval/tiny/bpb"] == pytest.approx(bits * 4 / 2)
    assert out["eval/ascii/bpb"] == pytest.approx(bits * 3 / 2)
    assert out["eval/tiny/bpb_dropped"] == pytest.approx(2 * bits * 4 / 2)
    assert out["eval/macro_bpb"] == pytest.approx((bits * 2 + bits * 1.5) / 2)
    assert out["eval/macro_loss"] == pytest.approx(math.log(V))
    # with drops too (eval.with_drops): published eval/macro_loss; the headline is the dropless one
    assert out["eval/macro_loss_dropped"] == pytest.approx(2 * math.log(V))
    assert out["eval/macro_bpb_dropped"] == pytest.approx(2 * (bits * 2 + bits * 1.5) / 2)
    assert tracker.rows["eval/tiny/bpb"] == out["eval/tiny/bpb"]


def test_evaluation_lands_on_every_registered_forecast_point(loader):
    evaluator = Evaluator(loader.cfg, uniform_eval_step, loader, lambda b: b, Tracker(), lambda line: None, stop=20)
    evaluator.every, evaluator.check.points = 6, {5: {}, 10: {}}
    assert [s for s in range(1, 21) if evaluator.due(s)] == [5, 6, 10, 12, 18]


def test_a_folder_of_subsets_is_one_set_each_with_its_macro_average(tmp_path):
    """A site's Paloma copy plugs in: `paths: [paloma/*/*.jsonl]`, `subsets: true`."""
    for subset, texts in (("c4_en", ["ab", "é"]), ("wikitext", ["abc"])):
        (tmp_path / "paloma" / subset).mkdir(parents=True)
        write_jsonl(tmp_path / "paloma" / subset / "val.jsonl", texts)
    write_jsonl(tmp_path / "train.jsonl", ["x" * 50] * 20)
    cfg = resolved(tmp_path, [dict(name="t", kind="jsonl", paths=["train.jsonl"], weights=[1.0])],
                   eval_sets=[dict(name="paloma", kind="jsonl", paths=["paloma/*/*.jsonl"], subsets=True)],
                   loss_targets="document")   # the hand counts of `loader`
    loader = Loader(cfg, progress=False)
    assert loader.eval_bytes_per_token() == {"paloma/c4_en": 2 / 4, "paloma/wikitext": 2 / 3}
    out = Evaluator(cfg, uniform_eval_step, loader, lambda b: b, Tracker(), lambda line: None, stop=20).run(20, None)
    bits = math.log2(V)
    assert out["eval/paloma/c4_en/bpb"] == pytest.approx(bits * 2)
    assert out["eval/paloma/macro_bpb"] == pytest.approx(bits * (2 + 1.5) / 2)
    assert out["eval/paloma/macro_loss"] == pytest.approx(math.log(V))
    assert out["eval/paloma/macro_loss_dropped"] == pytest.approx(2 * math.log(V))
    assert out["eval/macro_bpb"] == out["eval/paloma/macro_bpb"]
    assert cfg.eval.headline == "eval/paloma/macro_loss"   # production's headline (spec §9)
