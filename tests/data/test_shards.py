"""The sharded on-disk format (`marin.data.shards`): shards as one stream, verification, atomicity."""
from __future__ import annotations

import numpy as np

from marin.data import shards


def _write(tmp_path, docs_per_shard):
    tmp_path.mkdir(parents=True, exist_ok=True)
    manifests = []
    for k, docs in enumerate(docs_per_shard):
        w = shards.ShardWriter(tmp_path, shards.shard_id(k, 0), np.uint16)
        for d in docs:
            w.append(np.asarray(d))
        manifests.append(w.finish({"counts": {}}))
    shards.write_index(tmp_path, "src", manifests, {"corrupt": 0})
    return shards.ShardedSource.open("src", tmp_path)


def test_shards_read_as_one_stream(tmp_path):
    docs = [[[1, 2, 9], [3, 9]], [[4, 5, 6, 9]], [[7, 9], [8, 8, 9]]]
    flat = [t for shard in docs for d in shard for t in d]
    src = _write(tmp_path, docs)
    assert (src.num_tokens, src.documents) == (len(flat), 5) and not src._open  # only the index read
    idx = np.array([[0, 4, 5, 9], [11, 1, 8, 3]])
    np.testing.assert_array_equal(src.tokens[idx], np.asarray(flat)[idx])
    ends = np.cumsum([len(d) for shard in docs for d in shard])
    np.testing.assert_array_equal(src.offsets, [0, *ends])
    np.testing.assert_array_equal(src.document_of(idx), np.searchsorted(src.offsets, idx, side="right"))


def test_a_damaged_shard_does_not_verify(tmp_path):
    src = _write(tmp_path, [[[1, 2, 9]], [[3, 9]]])
    folder = src.path / src.shard_ids[1]
    assert shards.verify_shard(folder) is not None
    data = bytearray((folder / shards.TOKENS).read_bytes())
    data[0] ^= 1
    (folder / shards.TOKENS).write_bytes(bytes(data))
    assert shards.verify_shard(folder, full=False) is not None  # same size
    assert shards.verify_shard(folder) is None


def test_a_second_writer_of_the_same_shard_keeps_the_whole_one(tmp_path):
    a = shards.ShardWriter(tmp_path, "000000-0000", np.uint16)
    b = shards.ShardWriter(tmp_path, "000000-0000", np.uint16)
    for w in (a, b):
        w.append(np.asarray([1, 2, 9]))
    first = a.finish({})
    assert b.finish({}) == first
    assert [p.name for p in tmp_path.iterdir()] == ["000000-0000"]  # no temporary left


def test_the_index_stays_small_whatever_the_shard_count(tmp_path):
    """Opening reads the index and one column table: the JSON does not grow with the shards."""
    few = _write(tmp_path / "few", [[[1, 9]]] * 3)
    many = _write(tmp_path / "many", [[[1, 9]]] * 300)
    size = lambda src: (src.path / shards.INDEX).stat().st_size
    assert size(many) <= size(few) + 8   # a few more digits at most
    assert many.shard_ids[299] == shards.shard_id(299, 0) and many.num_tokens == 600
    np.testing.assert_array_equal(many.shard_tokens, 2)
    np.testing.assert_array_equal(many.tokens[[0, 1, 598, 599]], [1, 9, 1, 9])
    np.testing.assert_array_equal(many.document_of([0, 2, 599]), [1, 2, 300])
