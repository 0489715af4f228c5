"""Text from a checkpoint: greedy is deterministic and agrees with the full forward, sampling
repeats with its seed, the QB router bias is applied, and bad input is one line, exit 2."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin import generate
from marin.model import transformer
from tests.trained import tiny_run, untrained_run

N = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


@pytest.fixture(scope="module")
def model(run):
    rec, _ = run
    return generate.load(rec)


def prompt(model, text="def main():\n    "):
    return generate.prompt_ids(model.tokenizer, model.cfg.model.vocab_size, text)


def test_greedy_is_deterministic_and_of_the_asked_length(model):
    ids = prompt(model)
    first = generate.generate(model, ids, N, stop_at_eos=False)
    assert first == generate.generate(model, ids, N, stop_at_eos=False)
    assert len(first) == N
    assert all(0 <= t < model.tokenizer.vocab_size and t != model.tokenizer.pad_id for t in first)


def test_greedy_tokens_are_the_argmax_of_the_full_forward(model):
    """The padded, re-run-per-token window gives what one forward over the whole text gives."""
    ids = prompt(model)
    new = generate.generate(model, ids, N, stop_at_eos=False)
    text = jnp.asarray([ids + new], jnp.int32)
    forward = jax.jit(lambda params, bias, batch: transformer.forward(params, batch, bias, model.cfg, train=False)[0])
    logits = forward(model.params, model.router_bias, {"inputs": text, "segment_ids": jnp.ones_like(text)})
    allowed = np.array(logits[0, len(ids) - 1:-1, :model.tokenizer.vocab_size])
    allowed[:, model.tokenizer.pad_id] = -np.inf
    assert list(allowed.argmax(-1)) == new


def test_sampling_repeats_with_its_seed(model):
    ids = prompt(model)
    a = generate.generate(model, ids, N, temperature=1.0, top_k=50, seed=1, stop_at_eos=False)
    assert a == generate.generate(model, ids, N, temperature=1.0, top_k=50, seed=1, stop_at_eos=False)
    assert a != generate.generate(model, ids, N, temperature=1.0, top_k=50, seed=2, stop_at_eos=False)


def test_the_checkpoints_qb_bias_is_applied(run, model):
    _, cfg = run
    assert cfg.router.kind == "qb" and model.step == cfg.train.steps
    assert float(jnp.max(jnp.abs(model.router_bias))) > 0  # the pending betas of the last step


def test_command_line_prints_the_same_ids(run, model, capsys):
    rec, _ = run
    ids = prompt(model)
    assert generate.main([str(rec.run_dir), "--prompt", "def main():\n    ", "--max-new-tokens", str(N),
                          "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == ids
    assert out["new_ids"] == generate.generate(model, ids, N, stop_at_eos=False)
    assert out["text"].startswith("def main():")


def test_text_is_streamed_and_the_checkpoint_step_named(run, model, capsys):
    rec, cfg = run
    ids = prompt(model)
    assert generate.main([str(rec.run_dir), "--prompt", "def main():\n    ", "--max-new-tokens", str(N),
                          "--temperature", "1.0", "--top-k", "50", "--seed", "1", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    new = generate.generate(model, ids, N, 1.0, 50, seed=1, stop_at_eos=False)  # test_sampling's: compiled once
    assert out.out == model.tokenizer.decode(ids + new) + "\n"
    assert f"checkpoint: step {cfg.train.steps} of run {rec.run_dir.name}" in out.err


def test_the_stream_writes_each_token_and_waits_out_half_a_character(model):
    class Out:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    tok = model.tokenizer
    ids = [int(i) for i in tok.encode_batch(["ab é"])[0]]
    out = Out()
    stream = generate.Stream(tok, ids[:1], out)
    for i in ids[1:]:
        stream(i)
    stream.end()
    assert "".join(out.writes) == "ab é\n" and len(out.writes) >= 4   # streamed, not one write at the end
    assert not any("\ufffd" in w for w in out.writes)                 # é's first byte alone is not shown


@pytest.mark.parametrize("args, says", [
    (["--prompt-ids", "72,105,9999"], "outside the model's vocabulary"),
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "hi", "--max-new-tokens", "100000000000"], "--max-new-tokens must be 1 to 100,000"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature"),
])
def test_bad_prompts_and_options_are_one_line_exit_2(run, capsys, args, says):
    rec, _ = run
    before = sorted(p.name for p in rec.run_dir.rglob("*"))
    with pytest.raises(SystemExit, match="^2$"):
        generate.main([str(rec.run_dir), *args])
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err
    assert sorted(p.name for p in rec.run_dir.rglob("*")) == before


def test_a_run_without_checkpoints_is_one_line_exit_2(tmp_path_factory, tmp_path, capsys):
    rec = untrained_run(tmp_path_factory)
    before = sorted(p.name for p in rec.run_dir.rglob("*"))
    capsys.readouterr()  # MLflow's own log lines while the run was made
    with pytest.raises(SystemExit, match="^2$"):
        generate.main([str(rec.run_dir), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no checkpoint" in err
    assert sorted(p.name for p in rec.run_dir.rglob("*")) == before
    with pytest.raises(SystemExit, match="^2$"):
        generate.main([str(tmp_path / "nowhere"), "--prompt", "hi"])
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as done:  # neither --prompt nor --prompt-ids
        generate.main([str(rec.run_dir)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
