"""The loader on sharded sources (issue 41 item 3): the batches of a run do not depend on how a
source's stream is cut into shards, and a loader opens only the shards its rows read."""
from __future__ import annotations

import numpy as np
import pytest

from marin.data import shards
from marin.data.loader import Loader
from tests.data.mixtures import resolved, write_jsonl


def resharded(folder, source, cuts: int, seed: int):
    """`source`'s stream (one-shard cache) rewritten as `cuts` shards split at random documents."""
    offsets = np.asarray(source.offsets)
    docs = len(offsets) - 1
    edges = np.unique([0, docs, *np.random.default_rng(seed).integers(1, docs, cuts - 1)])
    manifests = []
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        writer = shards.ShardWriter(folder, shards.shard_id(k, 0), source.tokens.dtype)
        for d in range(a, b):
            writer.append(np.asarray(source.tokens[offsets[d]:offsets[d + 1]]))
        manifests.append(writer.finish({}))
    shards.write_index(folder, source.name, manifests, {"corrupt": 0})
    return shards.ShardedSource.open(source.name, folder)


@pytest.fixture(params=["epoch", "random"])
def cfg(tmp_path, request):
    for name, n in (("a", 90), ("b", 40)):
        write_jsonl(tmp_path / f"{name}.jsonl", [f"{name}{i} " + "xyz" * (i % 23) for i in range(n)])
    return resolved(tmp_path, [dict(name="a", kind="jsonl", paths=["a.jsonl"], weights=[0.6]),
                               dict(name="b", kind="jsonl", paths=["b.jsonl"], weights=[0.4])],
                    eval_sets=[dict(name="held", kind="jsonl", paths=["a.jsonl"])],
                    sampling=request.param, overrides=("train.global_batch=8", "train.steps=40"))


@pytest.mark.parametrize("cuts", [1, 7, 30])
def test_batches_do_not_depend_on_the_shard_count(tmp_path, cfg, cuts):
    one = Loader(cfg, progress=False)
    split = [resharded(tmp_path / f"split{cuts}" / s.name, s, cuts, seed=i) for i, s in enumerate(one.shards)]
    evals = {n: resharded(tmp_path / f"split{cuts}" / n, s, cuts, seed=9) for n, s in one.eval_shards.items()}
    assert all(len(s.shard_ids) > 1 for s in split) or cuts == 1  # random cuts may coincide: ≤ cuts shards
    many = Loader(cfg, progress=False, prepared=(split, evals))
    for step in (0, 1, 2, 17, 39, 3):
        a, b = one.batch(step), many.batch(step)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k} at step {step}")
    for x, y in zip(one.eval_batches()["held"], many.eval_batches()["held"]):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    assert one.eval_bytes_per_token() == many.eval_bytes_per_token()


def test_a_loader_opens_only_the_shards_its_rows_read(tmp_path, cfg):
    one = Loader(cfg, progress=False)
    split = [resharded(tmp_path / s.name, s, 20, seed=i) for i, s in enumerate(one.shards)]
    many = Loader(cfg, progress=False, prepared=(split, {}), process_index=1, process_count=4)
    assert not any(s._open for s in split)  # starting reads the indexes alone
    _, src, start = many.rows(5)
    many.batch(5)
    for s, source in enumerate(split):
        ends = (start[src == s, None] + np.arange(cfg.train.seq_len + 1)) % source.num_tokens
        read = set(np.searchsorted(source._token_starts, ends.ravel(), side="right") - 1)
        assert set(source._open) == read  # the 2 rows of this process: a few of the 20 shards
    assert sum(len(s._open) for s in split) < sum(len(s.shard_ids) for s in split)


def test_prepared_with_smaller_shards_the_batches_are_the_same(tmp_path, cfg):
    """The same files prepared into one shard a source and into shards of ≤ 200 tokens."""
    import dataclasses

    small = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shard_tokens=200))
    one, many = Loader(cfg, progress=False), Loader(small, progress=False)
    assert [len(s.shard_ids) for s in one.shards] == [1, 1]
    assert all(len(s.shard_ids) > 5 for s in many.shards)
    for step in (0, 1, 23):
        a, b = one.batch(step), many.batch(step)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k} at step {step}")
