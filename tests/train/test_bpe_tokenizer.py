"""A real BPE tokenizer end to end (issue 41 item 4): the suite's byte-level BPE (`marin.data.bpe`,
512 ids, trained on the built-in text) prepares the built-in mixture, trains a tiny model, resumes
it bit for bit, generates text and scores bits per byte, where the byte tokenizer's shortcuts (one
id = one byte) do not hold."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import compose_dict, new_store, signals_kept

pytestmark = pytest.mark.slow
TINY = ["model=micro", "train.seq_len=32", "train.global_batch=4", "train.steps=4", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint.every_steps=2", "optim.lr=1e-2"]


def gpt2_bytes() -> dict[str, int]:
    """The byte-level alphabet: the printable character that stands for each byte (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@pytest.fixture(scope="module")
def tokenizer_override(bpe_tokenizer, tmp_path_factory) -> str:
    """The BPE tokenizer, and one token cache for the module: the mixture is tokenized once."""
    return f"data.tokenizer={bpe_tokenizer} data.cache_dir={tmp_path_factory.mktemp('bpe_tokens')}"


def start(root, *overrides):
    from marin.launch.checks import load
    from marin.track import record

    overrides = [*TINY, *" ".join(overrides).split(), f"run.out_dir={root}", f"tracking.uri={new_store(root)}"]
    composed, cfg = load(compose_dict(*overrides))
    return cfg, record.create(composed, cfg, overrides)


def test_prepare_tokenizes_the_builtin_mixture_and_decodes_it_back(tmp_path, tokenizer_override):
    from marin.data import builtin
    from marin.data.prepare import main, prepare
    from marin.data.tokenizers import load_tokenizer
    from marin.launch.checks import load

    overrides = [*tokenizer_override.split(), "model=micro", f"run.out_dir={tmp_path}"]
    assert main(overrides) == 0
    cfg = load(compose_dict(*overrides))[1]
    shards, evals = prepare(cfg, progress=False)
    tok = load_tokenizer(cfg.data.tokenizer)
    docs = shards[0]
    first = np.asarray(docs.tokens[docs.offsets[0]:docs.offsets[1]])
    assert first[-1] == tok.eos_id and tok.eos_id not in first[:-1]
    assert tok.decode(first[:-1]) == next(builtin.documents("pydoc_data"))  # byte-level: lossless
    text_bytes = sum(len(d.encode()) for d in builtin.documents("pydoc_data"))
    assert docs.num_tokens - docs.documents < text_bytes / 1.5  # BPE: about 1.9 bytes a token here
    assert set(evals) == {e.name for e in cfg.data.eval_sets}


def test_bits_per_byte_counts_each_scored_tokens_bytes(tmp_path, tokenizer_override):
    """bytes per token by hand: each scored target's bytes through the byte-level alphabet (EOS: 0)."""
    from tokenizers import Tokenizer

    from marin.data.loader import Loader

    from marin.launch.checks import load

    cfg = load(compose_dict(*TINY, *tokenizer_override.split(), f"run.out_dir={tmp_path}"))[1]
    loader = Loader(cfg, progress=False)
    raw, alphabet = Tokenizer.from_file(cfg.data.tokenizer), gpt2_bytes()
    eos = loader.tokenizer.eos_id
    for name, batches in loader.eval_batches().items():
        targets = np.concatenate([b["targets"][b["loss_mask"] > 0] for b in batches])
        by_hand = sum(0 if t == eos else len(raw.id_to_token(int(t))) for t in targets)
        assert all(c in alphabet for t in set(targets.tolist()) if t != eos for c in raw.id_to_token(t))
        assert loader.eval_bytes_per_token()[name] == pytest.approx(by_hand / targets.size)
        assert loader.eval_bytes_per_token()[name] > 1.5  # the byte tokenizer's is below 1


def test_train_resume_and_generate(tmp_path, tokenizer_override):
    """A run stopped at step 2 and resumed ends with the uninterrupted run's losses, bit for bit; its
    checkpoint generates text the BPE tokenizer decodes."""
    from mlflow import MlflowClient

    from marin import generate
    from marin.launch.resume import resume
    from marin.train.loop import train

    def losses(rec):
        history = MlflowClient(rec.tracking_uri).get_metric_history(rec.run_id, "train/loss")
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    cfg, whole = start(tmp_path / "whole", tokenizer_override)
    with signals_kept():
        summary = train(cfg, whole)
        stopped_cfg, stopped = start(tmp_path / "stopped", tokenizer_override, "train.stop_after=2")
        train(stopped_cfg, stopped)
        resume([f"resume={stopped.run_dir}"])
    assert len(losses(whole)) == 4 and losses(stopped) == losses(whole)
    assert math.isfinite(summary["loss"])

    model = generate.load(whole)
    assert model.tokenizer.vocab_size == 512 and model.tokenizer.name == cfg.data.tokenizer
    ids = generate.prompt_ids(model.tokenizer, cfg.model.vocab_size, "def main():\n    ")
    assert len(ids) < len("def main():\n    ")  # merged: fewer ids than bytes
    new = generate.generate(model, ids, 8, stop_at_eos=False)
    assert len(new) == 8 and all(0 <= t < 512 for t in new)
    assert isinstance(model.tokenizer.decode(new), str)
