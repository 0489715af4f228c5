"""Source formats, tokenizers, the preparation cache and its CLI, the built-in held-out split."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from marin.data import builtin, prepare
from marin.data.loader import Loader
from marin.data.tokenizers import ByteTokenizer, load_tokenizer
from tests.data.mixtures import resolved, write_jsonl


def decoded(batch) -> str:
    ids = batch["inputs"].ravel()
    return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", "replace")


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"body": ["parquet row number %d. " % i * 5 for i in range(40)] + [None]})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=8)
    cfg = resolved(tmp_path, [dict(name="pq", kind="parquet", paths=["*.parquet"], weights=[1.0],
                                   text_field="body")], max_bad_fraction=0.05)  # 1 of 41 rows tolerated
    loader = Loader(cfg, progress=False)
    assert (loader.shards[0].documents, loader.shards[0].corrupt) == (40, 1)  # the null row
    assert "parquet row number" in decoded(loader.batch(0))


def test_text_and_gzip_sources(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "one.txt").write_text("plain text file " * 10)
    with gzip.open(tmp_path / "docs" / "two.txt.gz", "wt") as f:
        f.write("compressed text file " * 10)
    with gzip.open(tmp_path / "three.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "compressed jsonl line " * 5}) + "\n")
    cfg = resolved(tmp_path, [dict(name="txt", kind="text", paths=["docs/**/*.txt*"], weights=[0.5]),
                              dict(name="gz", kind="jsonl", paths=["three.jsonl.gz"], weights=[0.5])])
    loader = Loader(cfg, progress=False)
    assert [s.documents for s in loader.shards] == [2, 1]
    text = "".join(decoded(loader.batch(s)) for s in range(5))
    assert "plain text" in text and "compressed text" in text and "compressed jsonl" in text


@pytest.fixture
def bpe_json(tmp_path):
    """A tiny tokenizer.json trained offline with the `tokenizers` library."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 +
                            ["mixture of experts language models"] * 20, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_tokenizer_json(tmp_path, bpe_json):
    write_jsonl(tmp_path / "a.jsonl", ["the quick brown fox", "mixture of experts"] * 30)
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])],
                   tokenizer=str(bpe_json), overrides=["model.vocab_size=128"])  # ≤ 120 ids: 120–256 fit
    tok = load_tokenizer(str(bpe_json))
    assert tok.eos_id == 1 and tok.vocab_size <= 120
    loader = Loader(cfg, progress=False)
    assert loader.vocab_size == tok.vocab_size
    ids = loader.batch(0)["inputs"]
    assert ids.max() < tok.vocab_size and (ids == tok.eos_id).any()
    assert loader.shards[0].tokens.dtype == np.uint16


def test_tokenizer_json_larger_than_the_model(tmp_path, bpe_json):
    from marin.config.validate import ConfigError

    write_jsonl(tmp_path / "a.jsonl", ["text"] * 5)
    with pytest.raises(ConfigError, match=r"data.tokenizer: data.tokenizer \(.*tokenizer.json\) has \d+ ids "
                                          r"but model.vocab_size is 64"):
        resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])],
                 tokenizer=str(bpe_json), overrides=["model.vocab_size=64"])


def test_prepared_shards_are_reused_until_a_file_changes(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["first version"] * 10)
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])])
    first = Loader(cfg, progress=False).shards[0]
    (first.path / "index.json").write_text((first.path / "index.json").read_text().replace('"corrupt": 0', '"corrupt": 7'))
    assert Loader(cfg, progress=False).shards[0].corrupt == 7  # read back, not tokenized again
    write_jsonl(path, ["second version, longer"] * 10)
    second = Loader(cfg, progress=False).shards[0]
    assert second.path != first.path and second.corrupt == 0


def test_prepare_cli(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", ["cli document"] * 10)
    source = f"{{name:a,kind:jsonl,paths:['{tmp_path}/a.jsonl'],weights:[1.0]}}"
    code = prepare.main(["model=tiny", "train.steps=2", f"data.cache_dir={tmp_path}/cache",
                         f"data.sources=[{source}]", "data.eval_sets=[]"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[1].split()[:4] == ["a", "10", "0", "130"]
    assert len([p for p in (tmp_path / "cache").iterdir() if p.name != "by-config"]) == 1   # + the config pointers
    assert prepare.main(["model=tiny", "data.sources=[]", "data.eval_sets=[]"]) == 2


def test_prepare_is_composed_as_launch_py(tmp_path, capsys):
    """A Hydra app over the same conf/: --config-dir options are found and typed, --help works,
    a bad field is one line with exit status 2."""
    import subprocess
    import sys

    from marin.config.paths import PROJECT_ROOT

    write_jsonl(tmp_path / "a.jsonl", ["mine"] * 4)
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "mine.yaml").write_text(
        f"name: mine\nsources: [{{name: a, kind: jsonl, paths: ['{tmp_path}/a.jsonl'], weights: [1.0]}}]\n"
        f"eval_sets: []\ncache_dir: {tmp_path}/cache\n")
    assert prepare.main(["--config-dir", str(tmp_path / "conf"), "data=mine", "model=tiny"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["a", "4"]
    assert prepare.main(["model=tiny", "train.seq_len=0"]) == 2
    assert capsys.readouterr().err.strip() == "error: train.seq_len: must be an integer in [2, 2147483647]; got 0"
    done = subprocess.run([sys.executable, "-m", "marin.data.prepare", "--help"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "tokenize the mixture" in done.stdout and "router: bias_update" in done.stdout
    assert "Traceback" not in done.stderr


def test_builtin_heldout_documents_never_train():
    for name in builtin.NAMES:
        train = set(builtin.documents(name))
        heldout = set(builtin.documents(f"{name}/heldout"))
        assert train and heldout and not train & heldout, name
    with pytest.raises(ValueError, match="unknown built-in source"):
        builtin.parse("stdlib/test")


def test_the_stdlib_is_listed_once_per_process(monkeypatch):
    """Both splits of the built-in `stdlib` source read one listing of the standard library (its
    walk was most of preparing the built-in mixture when every source walked it again), which
    skips what a full walk would filter out and lists the same files in the same order."""
    import os
    import sysconfig
    from pathlib import Path

    walks = []
    walk = os.walk
    monkeypatch.setattr(os, "walk", lambda *args, **kw: walks.append(args) or walk(*args, **kw))
    rglob = Path.rglob
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: walks.append(self) or rglob(self, pattern))
    for location in ("stdlib", "stdlib/heldout", "stdlib"):
        assert next(builtin.documents(location))
    assert len(walks) <= 1
    monkeypatch.undo()
    root = Path(sysconfig.get_paths()["stdlib"])
    full = [(str(p.relative_to(root)), p) for p in sorted(root.rglob("*.py"))
            if builtin.STDLIB_SKIP.isdisjoint(p.relative_to(root).parts) and p.is_file()]
    assert list(builtin._stdlib_paths()) == full  # noqa: SLF001


def test_byte_tokenizer_round_trip():
    (ids,) = ByteTokenizer().encode_batch(["héllo"])
    assert bytes(ids.astype(np.uint8)).decode() == "héllo" and ids.max() < 256


def test_tokenizing_draws_no_empty_bar(tmp_path, capsys):
    """The tokenizing bar starts at its first tokens: no `tokenizing a: 0.00tok` line before them
    (a source tokenized in a moment shows no bar at all)."""
    from marin.data.loader import Loader
    from tests.data.mixtures import resolved, write_jsonl

    write_jsonl(tmp_path / "a.jsonl", ["a short document"] * 20)
    Loader(resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])]), progress=True)
    err = capsys.readouterr().err
    assert "0.00tok" not in err and "tokenizing a" not in err, err
