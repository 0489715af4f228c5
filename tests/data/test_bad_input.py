"""Every bad data input is a clear error at validation, before anything is written or trained."""
from __future__ import annotations

import dataclasses

import pytest

from marin.config.validate import ConfigError
from marin.data.loader import Loader
from marin.launch.checks import load
from tests.data.mixtures import composed, resolved, write_jsonl


@pytest.fixture
def files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["alpha " * 20] * 10)
    write_jsonl(tmp_path / "b.jsonl", ["beta " * 20] * 10)
    return tmp_path


def problems(tmp_path, sources, **kw) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load(composed(tmp_path, sources, **kw))
    return dict(err.value.problems)


def two(wa, wb, **extra):
    return [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=wa, **extra),
            dict(name="b", kind="jsonl", paths=["b.jsonl"], weights=wb)]


def test_negative_weights_name_the_phase_and_values(files):
    msg = problems(files, two([0.5, 1.2], [0.5, -0.2]), boundaries=[0.8], names=["pretrain", "midtrain"])
    assert msg["data.sources"] == "phase 1 (midtrain) has negative or non-finite weights: b=-0.2"


def test_all_zero_weights(files):
    msg = problems(files, two([0.0], [0.0]))
    assert "phase 0 (p0) weights are all zero" in msg["data.sources"]


def test_weights_not_summing_to_one_are_not_normalised(files):
    msg = problems(files, two([0.5], [0.4]))
    assert msg["data.sources"] == "phase 0 (p0) weights sum to 0.9, not 1 (they are not normalised for you): a=0.5, b=0.4"


def test_a_weight_per_phase(files):
    msg = problems(files, two([1.0], [0.0, 1.0]), boundaries=[0.5])
    assert "needs one weight per phase (2)" in msg["data.sources[0].weights"]


def test_missing_source_file(files):
    msg = problems(files, [dict(name="a", kind="jsonl", paths=["nope/*.jsonl"], weights=[1.0])])
    assert msg["data.sources[0].paths"].startswith("no file matches")
    assert "nope/*.jsonl" in msg["data.sources[0].paths"]


def test_source_without_location(files):
    msg = problems(files, [dict(name="a", kind="jsonl", paths=[], weights=[1.0])])
    assert "has no location" in msg["data.sources[0].paths"]


def test_empty_source(files):
    (files / "empty.jsonl").write_bytes(b"")
    msg = problems(files, [dict(name="a", kind="jsonl", paths=["empty.jsonl"], weights=[1.0])])
    assert msg["data.sources[0].paths"] == "the source is empty: its 1 file(s) hold no bytes"


def test_directory_in_place_of_a_file(files):
    (files / "dir.jsonl").mkdir()
    msg = problems(files, [dict(name="a", kind="jsonl", paths=["dir.jsonl"], weights=[1.0])])
    assert msg["data.sources[0].paths"].endswith("dir.jsonl is a directory, not a file")


def test_invalid_parquet(files):
    (files / "bad.parquet").write_bytes(b"not parquet at all")
    msg = problems(files, [dict(name="a", kind="parquet", paths=["bad.parquet"], weights=[1.0])])
    assert "is not a Parquet file" in msg["data.sources[0].paths"]


def test_invalid_encoding(files):
    (files / "bin.txt").write_bytes(bytes(range(128, 256)) * 10)
    msg = problems(files, [dict(name="a", kind="text", paths=["bin.txt"], weights=[1.0])])
    assert "is not UTF-8 text" in msg["data.sources[0].paths"]


def test_missing_eval_set(files):
    msg = problems(files, two([0.5], [0.5]), eval_sets=[dict(name="held", kind="jsonl", paths=["held.jsonl"])])
    assert msg["data.eval_sets[0].paths"].startswith("no file matches")


@pytest.mark.parametrize("boundary", [0.0, 1.0, 1.5, -0.1])
def test_phase_boundary_outside_0_1(files, boundary):
    msg = problems(files, two([0.5, 0.5], [0.5, 0.5]), boundaries=[boundary])
    assert msg["data.phase_boundaries"] == ("a phase boundary is a fraction of the run strictly "
                                            f"between 0 and 1; got {boundary}")


def test_tokenizer_larger_than_the_model_vocabulary(files):
    sources = two([0.5], [0.5])
    msg = problems(files, sources, overrides=["model.vocab_size=256"])
    assert msg["data.tokenizer"].startswith("data.tokenizer (byte) has 258 ids but model.vocab_size is 256")
    msg = problems(files, sources, overrides=["model.vocab_size=256", "dry_run=true"])  # a dry run too
    assert msg["data.tokenizer"].startswith("data.tokenizer (byte) has 258 ids but model.vocab_size is 256")
    cfg = load(composed(files, sources, overrides=["dry_run=true"]))[1]
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=256))
    with pytest.raises(ValueError, match="model.vocab_size is 256"):  # the loader checks it too
        Loader(small, progress=False)


def test_missing_tokenizer_file(files):
    msg = problems(files, two([0.5], [0.5]), tokenizer=str(files / "tokenizer.json"))
    assert msg["data.tokenizer"].startswith("no tokenizer file at")


def test_more_epochs_than_the_cap(files):
    msg = problems(files, two([0.5], [0.5], tokens=100))  # 20 × 8 × 32 tokens, half from a
    assert msg["data.sources"].startswith("1 source(s) would repeat more than data.max_epochs=8 epochs")
    assert "a=25.6" in msg["data.sources"]


def test_dry_run_skips_site_files(files):
    cfg = load(composed(files, [dict(name="a", kind="jsonl", paths=["/site/data/*.jsonl"], weights=[1.0])],
                        overrides=["dry_run=true"]))[1]
    assert cfg.data.sources[0].paths == ["/site/data/*.jsonl"]


def test_a_corrupt_document_is_skipped_and_counted(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["good document"] * 10, corrupt_at=[4])
    with open(tmp_path / "a.jsonl", "ab") as f:
        f.write(b'{"text": "\xff\xfe bad utf-8"}\n{"other": "no text field"}\n{"text": 3}\n')
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])],
                   max_bad_fraction=0.5)  # 4 of 14 records: tolerated only when allowed
    (shard,) = Loader(cfg, progress=False).shards
    assert (shard.documents, shard.corrupt) == (10, 4)
    assert shard.num_tokens == 10 * (len("good document") + 1)


def test_a_source_with_only_corrupt_documents_fails_before_training(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": 1}\n{"broken\n')
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])])
    with pytest.raises(ValueError, match=r"data.sources\[0\] \(a\): 2 of 2 input records of shard 000000-0000 "
                                         r"are bad .*a.jsonl:1: not text"):  # over data.max_bad_fraction
        Loader(cfg, progress=False)
    cfg = resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[1.0])], max_bad_fraction=1.0)
    with pytest.raises(ValueError, match=r"data.sources\[0\] \(a\): the source is empty: no readable "
                                         r"document \(2 corrupt skipped\)"):
        Loader(cfg, progress=False)
    assert not any(p.name == "index.json" for p in (tmp_path / "cache").rglob("*"))  # nothing listed


def test_unknown_builtin_source_even_in_a_dry_run(files):
    msg = problems(files, [dict(name="a", kind="builtin", paths=["stdlb"], weights=[1.0])],
                   overrides=["dry_run=true"])
    assert msg["data.sources[0].paths"].startswith("unknown built-in source 'stdlb'")


def test_a_symlink_loop_under_a_recursive_glob_is_refused_naming_the_link(files):
    """`**` follows links to folders: a link back to a folder above it would read every file
    below again at each level (41 times, until the path is too long), silently."""
    (files / "d").mkdir()
    write_jsonl(files / "d" / "c.jsonl", ["gamma " * 20] * 10)
    (files / "d" / "loop").symlink_to("..")
    msg = problems(files, [dict(name="a", kind="jsonl", paths=["d/**/*.jsonl"], weights=[1.0])])
    assert "symbolic link loop" in msg["data.sources[0].paths"], msg
    assert f"{files / 'd' / 'loop'} → {files.resolve()};" in msg["data.sources[0].paths"], msg


def test_a_file_reached_twice_through_links_is_read_once(files):
    """A link to a folder the pattern also reaches itself (`latest -> v3`): each file once, by the
    first of its names."""
    from marin.data.mixture import expand

    (files / "v3").mkdir()
    write_jsonl(files / "v3" / "c.jsonl", ["gamma " * 20] * 10)
    (files / "latest").symlink_to("v3")
    assert expand(["**/c.jsonl"], files) == [files / "latest" / "c.jsonl"]
