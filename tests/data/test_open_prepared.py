"""A training process of a multi-process run opens the prepared sources without reading or
stat-ing an input file (issue 41): through each source's config pointer to its last preparation."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from marin.data import prepare
from marin.data.loader import Loader
from tests.data.mixtures import resolved, write_jsonl


@pytest.fixture
def cfg(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [f"alpha {i} " + "x" * (i % 17) for i in range(60)])
    write_jsonl(tmp_path / "b.jsonl", [f"beta {i} " + "y" * (i % 11) for i in range(30)])
    return resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[0.7]),
                               dict(name="b", kind="jsonl", paths=["*.jsonl"], weights=[0.3])],
                    eval_sets=[dict(name="held", kind="jsonl", paths=["b.jsonl"])])


def _many(cfg, verify=False):
    """`cfg` as a process of a multi-process run sees it (data.verify_inputs auto resolves off there)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, verify_inputs=verify))


def _no_input_files(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("an input file was globbed or stat-ed")
    monkeypatch.setattr(prepare, "_files", refuse)
    monkeypatch.setattr(prepare, "_inputs", refuse)


def test_a_process_of_many_opens_the_preparation_without_touching_inputs(cfg, monkeypatch):
    one = Loader(cfg, progress=False)   # one process: plans from the files, prepares, writes the pointers
    _no_input_files(monkeypatch)
    for p in range(2):
        part = Loader(_many(cfg), p, 2, progress=False)
        assert [s.path for s in part.shards] == [s.path for s in one.shards]
        assert part.eval_shards["held"].path == one.eval_shards["held"].path
        for step in (0, 3):
            whole, mine = one.batch(step), part.batch(step)
            rows = slice(p * 4, (p + 1) * 4)
            assert np.array_equal(whole["inputs"][rows], mine["inputs"])


def test_changed_inputs_are_never_mixed_into_an_open_preparation(cfg, tmp_path, monkeypatch):
    old = Loader(cfg, progress=False)
    write_jsonl(tmp_path / "a.jsonl", [f"changed {i}" for i in range(40)])
    trusted = Loader(_many(cfg), 0, 2, progress=False)   # not verified, the last preparation whole
    assert trusted.shards[0].path == old.shards[0].path
    assert trusted.shards[0].num_tokens == old.shards[0].num_tokens
    checked = Loader(_many(cfg, verify=True), 0, 2, progress=False)   # verified: the changed file tokenized into a new cache
    assert checked.shards[0].path != old.shards[0].path
    _no_input_files(monkeypatch)
    after = Loader(_many(cfg), 1, 2, progress=False)       # the pointer moved with the new preparation
    assert [s.path for s in after.shards] == [s.path for s in checked.shards]


def test_a_pointer_that_disagrees_with_its_index_is_not_trusted(cfg):
    Loader(cfg, progress=False)
    tok = Loader(cfg, progress=False).tokenizer
    assert prepare.open_prepared(cfg, tok) is not None
    (pointer,) = [p for p in (prepare.cache_dir(cfg) / "by-config").iterdir()
                  if json.loads(p.read_text())["name"] == "a"]
    record = json.loads(pointer.read_text())
    pointer.write_text(json.dumps({**record, "inputs": "0" * 32}))
    assert prepare.open_prepared(cfg, tok) is None   # the loader then plans from the files
    assert str(Loader(_many(cfg), 0, 2, progress=False).shards[0].path) == record["dir"]
    assert json.loads(pointer.read_text()) == record   # and the preparation rewrote the pointer


def test_verify_inputs_auto_is_on_for_one_process_and_off_for_many():
    from marin.config.store import compose
    from marin.config.validate import load

    one = load(compose(["model=tiny"]))[1]
    assert one.data.verify_inputs is True
    many = load(compose(["model=tiny", "hardware.nodes=2"]))[1]
    assert many.data.verify_inputs is False
    assert load(compose(["model=tiny", "hardware.nodes=2", "data.verify_inputs=true"]))[1].data.verify_inputs is True
