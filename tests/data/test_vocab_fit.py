"""The tokenizer must fit the model's vocabulary (docs/data.md "Tokenizers"): model.vocab_size from
the tokenizer's ids up to those ids rounded up to a multiple of 128, plus 128; more only with
data.allow_vocab_mismatch=true. The hero needs the site's tokenizer (Marin's, 128,256 ids)."""
from __future__ import annotations

import pytest

from marin.config.validate import ConfigError
from marin.data.tokenizers import ByteTokenizer, check_vocab, load_tokenizer, vocab_range
from tests.data.mixtures import resolved, write_jsonl
from tests.helpers import launch_here, make_config


@pytest.fixture(scope="module")
def word_json(tmp_path_factory):
    """A word-level tokenizer.json of exactly 300 ids (ids rounded up: 384; the fit: 300–512)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(298)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_the_range_is_the_ids_rounded_up_to_128_plus_128():
    assert vocab_range(258) == (258, 512)  # byte: model=tiny/small's 512 fits
    assert vocab_range(300) == (300, 512)
    assert vocab_range(384) == (384, 512)
    assert vocab_range(385) == (385, 640)
    assert vocab_range(128_256) == (128_256, 128_384)  # Marin's tokenizer: the hero's 128,256 fits
    byte = ByteTokenizer()
    assert check_vocab(byte, 512, "byte", refuse_padding=True) is None
    assert check_vocab(byte, 513, "byte", refuse_padding=True) is not None
    assert check_vocab(byte, 513, "byte") is None  # the loader refuses only ids past the embedding
    assert check_vocab(byte, 257, "byte") is not None


def _sources(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["w1 w2 w3"] * 5)
    return [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])]


@pytest.mark.parametrize("vocab", [300, 400, 512])
def test_a_tokenizer_json_within_the_range_is_accepted(tmp_path, word_json, vocab):
    assert load_tokenizer(str(word_json)).vocab_size == 300
    cfg = resolved(tmp_path, _sources(tmp_path), tokenizer=str(word_json), overrides=[f"model.vocab_size={vocab}"])
    assert cfg.model.vocab_size == vocab


def test_too_much_padding_is_refused_in_one_line_unless_allowed(tmp_path, word_json):
    with pytest.raises(ConfigError) as err:
        resolved(tmp_path, _sources(tmp_path), tokenizer=str(word_json), overrides=["model.vocab_size=640"])
    (field, msg), = err.value.problems
    assert field == "data.tokenizer"
    assert msg == (f"data.tokenizer ({word_json}) has 300 ids but model.vocab_size is 640: it must be "
                   "300–512 (the ids rounded up to a multiple of 128, plus 128); use the model's tokenizer "
                   "(a path to its tokenizer.json), fit model.vocab_size, or set data.allow_vocab_mismatch=true")
    cfg = resolved(tmp_path, _sources(tmp_path), tokenizer=str(word_json), allow_vocab_mismatch=True,
                   overrides=["model.vocab_size=640"])
    assert cfg.data.allow_vocab_mismatch and cfg.model.vocab_size == 640


def test_a_model_vocabulary_below_the_tokenizer_is_refused_even_when_allowed(tmp_path, word_json):
    with pytest.raises(ConfigError, match=r"has 300 ids but model.vocab_size is 256: raise model.vocab_size"):
        resolved(tmp_path, _sources(tmp_path), tokenizer=str(word_json), allow_vocab_mismatch=True,
                 overrides=["model.vocab_size=256"])


def test_the_hero_refuses_the_byte_tokenizer_even_in_a_dry_run():
    with pytest.raises(ConfigError) as err:
        make_config("experiment=mochi_535b_a23b", "dry_run=true", "data.tokenizer=byte")
    (field, msg), = err.value.problems
    assert field == "data.tokenizer"
    assert msg.startswith("data.tokenizer (byte) has 258 ids but model.vocab_size is 128,256: it must be 258–512")
    cfg = make_config("experiment=mochi_535b_a23b", "dry_run=true", "data.tokenizer=byte",
                      "data.allow_vocab_mismatch=true")
    assert cfg.data.tokenizer == "byte"


def test_the_hero_dry_run_names_the_site_tokenizer_and_still_plans():
    cfg = make_config("experiment=mochi_535b_a23b", "dry_run=true")
    assert cfg.data.tokenizer.endswith("marin-tokenizer/tokenizer.json")  # under data.root
    cfg = make_config("experiment=mochi_535b_a23b", "dry_run=true", "data.root=/site/mochi")
    assert cfg.data.tokenizer == "/site/mochi/marin-tokenizer/tokenizer.json"


def test_the_hero_with_a_128256_tokenizer_fits(tmp_path):
    """A tokenizer.json of Marin's size (128,256 ids) passes the hero's check; one id more does not."""
    from tokenizers import Tokenizer, models

    for size, ok in ((128_256, True), (128_257, False)):
        path = tmp_path / f"t{size}.json"
        Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0")).save(str(path))
        overrides = ("experiment=mochi_535b_a23b", "dry_run=true", f"data.tokenizer={path}")
        if ok:
            assert make_config(*overrides).model.vocab_size == 128_256
        else:
            with pytest.raises(ConfigError, match="has 128257 ids but model.vocab_size is 128256"):
                make_config(*overrides)


def test_launch_refuses_in_one_line_with_exit_2(capsys):
    assert launch_here("experiment=mochi_535b_a23b", "dry_run=true", "data.tokenizer=byte") == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "data.tokenizer" in line]
    assert len(lines) == 1 and "data.allow_vocab_mismatch=true" in lines[0]
