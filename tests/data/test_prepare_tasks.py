"""Preparation as tasks (`marin.data.prepare_tasks`): the same shards whatever the task count, a
killed task resumed to the uninterrupted result, bad input counted or refused, the plan."""
from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from marin.data import prepare, prepare_tasks, shards
from marin.data.loader import Loader
from tests.data.mixtures import resolved, write_jsonl


def corpus(root: Path) -> None:
    """5 files of different sizes, some documents long enough to cross a shard boundary."""
    (root / "in").mkdir()
    for f in range(5):
        docs = [f"file {f} document {d} " + "word " * (3 + (7 * f + 11 * d) % 40) for d in range(12 + 5 * f)]
        write_jsonl(root / "in" / f"part{f}.jsonl", docs)


def _cfg(root, cache, **data):
    import dataclasses

    data.setdefault("shard_tokens", 600)
    cfg = resolved(root, [dict(name="a", kind="jsonl", paths=["in/*.jsonl"], weights=[1.0])], **data)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(root / cache)))


def fingerprint(cfg) -> tuple[str, dict[str, str]]:
    """The source's index text and every shard file's hash."""
    (src,) = prepare.plan(cfg).sources
    folder = Path(src.dir)
    files = {str(p.relative_to(folder)): shards.file_hash(p) for p in sorted(folder.glob("*/*"))}
    return (folder / shards.INDEX).read_text(), files


def test_one_task_and_three_tasks_make_identical_shards(tmp_path):
    corpus(tmp_path)
    one, three = _cfg(tmp_path, "c1", prepare_tasks=1), _cfg(tmp_path, "c3", prepare_tasks=3)
    p1, p3 = prepare.plan(one), prepare.plan(three)
    assert (len(p1.tasks), len(p3.tasks)) == (1, 3)
    prepare.run_pool(p1, progress=False)
    prepare.run_pool(p3, progress=False)   # three pool workers
    index, files = fingerprint(one)
    assert (index, files) == fingerprint(three)
    src = shards.ShardedSource.open("a", Path(p1.sources[0].dir))
    assert json.loads(index)["shards"] == len(src.shard_ids) > len(p1.units)   # some groups cut into several parts
    assert src.shard_tokens.max() <= 600 and src.shard_tokens.sum() == src.num_tokens
    # the stream is the documents of the files in order, each ended by the end-of-document id
    text = bytes(t for t in src.tokens[:] if t < 256).decode()
    expected = "".join(json.loads(line)["text"] for f in sorted((tmp_path / "in").iterdir())
                       for line in f.read_text().splitlines())
    assert text == expected


def test_batches_do_not_depend_on_the_shard_size(tmp_path):
    corpus(tmp_path)
    many = Loader(_cfg(tmp_path, "small", shard_tokens=500), progress=False)
    one = Loader(_cfg(tmp_path, "big", shard_tokens=10**8), progress=False)
    assert len(many.shards[0].shard_ids) > 5 and len(one.shards[0].shard_ids) == 1
    for step in range(6):
        a, b = many.batch(step), one.batch(step)
        assert all(np.array_equal(a[k], b[k]) for k in a), step


class Killed(Exception):
    pass


def test_a_task_killed_mid_shard_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    corpus(tmp_path)
    whole = _cfg(tmp_path, "whole")
    prepare.prepare(whole, progress=False)
    killed = _cfg(tmp_path, "killed")
    appended = {"n": 0}
    real_append = shards.ShardWriter.append

    def dies_later(self, ids):
        appended["n"] += 1
        if appended["n"] == 60:   # a few shards in, mid-shard
            raise Killed
        real_append(self, ids)

    monkeypatch.setattr(shards.ShardWriter, "append", dies_later)
    with pytest.raises(Killed):
        prepare.prepare(killed, progress=False)
    (src,) = prepare.plan(killed).sources
    folder = Path(src.dir)
    kept = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))   # not locks, temporaries
    assert kept and shards.INDEX not in kept and not list(folder.glob(".[0-9]*"))  # in-flight shard removed
    # damage one finished shard: the rerun redoes it too
    victim = folder / kept[0] / shards.TOKENS
    victim.write_bytes(b"\0" * victim.stat().st_size)
    monkeypatch.setattr(shards.ShardWriter, "append", real_append)
    made = []
    real_init = shards.ShardWriter.__init__
    monkeypatch.setattr(shards.ShardWriter, "__init__",
                        lambda self, d, sid, dt: (made.append(sid), real_init(self, d, sid, dt))[1])
    prepare.prepare(killed, progress=False)
    assert kept[0] in made and not set(kept[1:]) & set(made)   # verified shards skipped
    assert fingerprint(killed) == fingerprint(whole)


# ------------------------------------------------------------------------------------ bad input

def _bad_corpus(root: Path) -> None:
    (root / "in").mkdir()
    good = [json.dumps({"text": f"good document {i}"}) for i in range(30)]
    lines = good[:10] + ['{"text": "unterminated', '{"other": "x"}', '{"text": 3}', '{"text": "   "}'] + good[10:]
    (root / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    with open(root / "in" / "a.jsonl", "ab") as f:
        f.write(b'{"text": "\xff bad utf-8"}\n' + json.dumps({"text": "huge " * 200}).encode() + b"\n")
    with gzip.open(root / "in" / "b.jsonl.gz", "wb") as f:   # varied text: it does not compress to nothing
        f.write("".join(json.dumps({"text": f"{i * 7919 % 10007} {i ** 3}"}) + "\n" for i in range(3000)).encode())
    data = (root / "in" / "b.jsonl.gz").read_bytes()
    (root / "in" / "b.jsonl.gz").write_bytes(data[: len(data) * 3 // 4])   # truncated: unreadable from there


def _bad_cfg(root, **data):
    data.setdefault("shard_tokens", 500)   # the 1,000-character document is huge
    return resolved(root, [dict(name="a", kind="jsonl", paths=["in/*"], weights=[1.0])], **data)


def test_each_kind_of_bad_input_is_counted_in_the_manifest(tmp_path):
    _bad_corpus(tmp_path)
    cfg = _bad_cfg(tmp_path, max_bad_fraction=0.5)
    (src,), _ = prepare.prepare(cfg, progress=False)
    index = json.loads((src.path / shards.INDEX).read_text())
    assert {k: v for k, v in index["counts"].items() if v} == {
        "malformed_json": 1, "missing_field": 1, "not_text": 1, "empty": 1, "invalid_utf8": 1, "huge": 1,
        "unreadable": 1}
    assert src.corrupt == 6   # empty documents are not bad
    first = shards.read_manifest(src.path / src.shard_ids[0])
    assert first["first_bad"] is None or "a.jsonl" in first["first_bad"]
    assert sum(shards.read_manifest(src.path / s)["counts"]["unreadable"] for s in src.shard_ids) == 1


def test_too_much_bad_input_fails_naming_file_and_line_and_lists_nothing(tmp_path):
    _bad_corpus(tmp_path)
    cfg = _bad_cfg(tmp_path)   # the default 0.001
    with pytest.raises(prepare_tasks.BadInput, match=r"data.sources\[0\] \(a\): 5 of 36 input records of shard "
                                                     r"000000-0000 are bad .*over data.max_bad_fraction=0.001; "
                                                     r"the first: .*a.jsonl:11: malformed json"):
        prepare.prepare(cfg, progress=False)
    (src,) = prepare.plan(cfg).sources
    assert not list(Path(src.dir).glob("*")) or not (Path(src.dir) / shards.INDEX).exists()
    assert not any(shards.verify_shard(p) for p in Path(src.dir).glob("000000-*"))


# ------------------------------------------------------------------------------------ the plan

def test_a_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    corpus(tmp_path)
    source = f"{{name:a,kind:jsonl,paths:['{tmp_path}/in/*.jsonl'],weights:[1.0]}}"
    code = prepare.main([f"data.sources=[{source}]", "data.eval_sets=[]", f"data.cache_dir={tmp_path}/cache",
                         "data.shard_tokens=600", "data.prepare_tasks=2", "dry_run=true", "model=tiny"])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "cache").exists()
    assert "run: 2 tasks on a local process pool" in out and "file groups" in out
    tokens = sum(len(json.loads(line)["text"]) + 1 for f in (tmp_path / "in").iterdir()
                 for line in f.read_text().splitlines())
    assert f"{tokens:,}" in out   # the byte tokenizer on a small source: its whole text sampled


def test_the_hero_plan_at_a_site(capsys):
    code = prepare.main(["data=mochi_hero", "hardware=slurm_cpu", "hardware.cpus_per_task=4", "data.prepare_tasks=500",
                         "dry_run=true", "model=tiny", "data.allow_vocab_mismatch=true"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(l for l in out.splitlines() if l.startswith("run:"))
    assert line.startswith("run: 500 tasks on a Slurm array, 2,000 cores"), line
    assert "hours" in line and "total: 201 sources" in out   # the 200 cells and the site's Paloma copy
    assert any(l.startswith("paloma ") and l.endswith("unknown") for l in out.splitlines()), out


def test_a_pool_worker_killed_mid_shard_and_a_rerun_give_the_uninterrupted_shards(tmp_path, monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    corpus(tmp_path)
    whole = _cfg(tmp_path, "whole")
    prepare.prepare(whole, progress=False)
    pooled = _cfg(tmp_path, "pooled", prepare_tasks=2)
    monkeypatch.setenv(prepare_tasks.KILL_VARIABLE, "1:15")   # task 1's worker: SIGKILL at its 15th document
    with pytest.raises(BrokenProcessPool):
        prepare.run_pool(prepare.plan(pooled), progress=False)
    monkeypatch.delenv(prepare_tasks.KILL_VARIABLE)
    prepare.run_pool(prepare.plan(pooled), progress=False)
    assert fingerprint(pooled) == fingerprint(whole)


def test_documents_keeps_the_documents_and_counts_the_rest(tmp_path):
    from marin.data.documents import Counts, UnreadableSource, documents

    _bad_corpus(tmp_path)
    counts = Counts()
    docs = list(documents("jsonl", [tmp_path / "in" / "a.jsonl"], "text", counts))
    assert len(docs) == counts.documents == 31 and counts.corrupt == 4   # the huge one is a document here
    with pytest.raises(UnreadableSource, match=r"reading failed at .*b.jsonl.gz:\d+"):
        list(documents("jsonl", [tmp_path / "in" / "b.jsonl.gz"], "text", Counts()))


def test_two_preparers_at_once_make_the_uninterrupted_shards(tmp_path):
    from concurrent.futures import ProcessPoolExecutor

    corpus(tmp_path)
    whole = _cfg(tmp_path, "whole")
    prepare.prepare(whole, progress=False)
    both = _cfg(tmp_path, "both", prepare_tasks=1)
    p = prepare.plan(both)
    with ProcessPoolExecutor(2) as pool:   # the same task twice, at the same time
        for f in [pool.submit(prepare_tasks.run_task, p, 0) for _ in range(2)]:
            f.result()
    assert fingerprint(both) == fingerprint(whole)
    assert not list(Path(p.sources[0].dir).glob(".[0-9]*"))   # no temporary left


def test_the_command_names_the_source_that_failed(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": 1}\n{"broken\n')
    source = f"{{name:a,kind:jsonl,paths:['{tmp_path}/in/a.jsonl'],weights:[1.0]}}"
    common = [f"data.sources=[{source}]", "data.eval_sets=[]", f"data.cache_dir={tmp_path}/cache", "model=tiny"]
    def error() -> str:   # stderr's error line (the progress bar shares stderr)
        return next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))

    assert prepare.main(common) == 2
    assert error().startswith("error: data.sources[0] (a): 2 of 2 input records of shard 000000-0000 "
                                              "are bad (malformed_json 1, not_text 1)")
    assert prepare.main([*common, "data.max_bad_fraction=1.0"]) == 2
    assert error().startswith("error: data.sources[0] (a): the source is empty: no readable document "
                                              "(2 corrupt skipped); the first: ")


def test_a_large_builtin_source_splits_into_groups_and_the_stream_keeps_its_order(tmp_path, monkeypatch):
    """A process pool balances a large input only if it is several groups: the built-in text is
    cut into runs of documents (by characters), and the stream is the same whatever the tasks."""
    from marin.data import builtin

    monkeypatch.setattr(builtin, "GROUP_CHARS", 60_000)   # small groups, a small cap: a quick test
    monkeypatch.setitem(builtin.CAPS, "train", 200_000)
    builtin.sizes.cache_clear()
    corpus(tmp_path)
    try:
        cfgs = [_cfg(tmp_path, f"c{n}", prepare_tasks=n, shard_tokens=10**8) for n in (1, 3)]
        for c in cfgs:
            c.data.sources = [dataclasses.replace(c.data.sources[0], kind="builtin", paths=["stdlib"])]
        p1, p3 = prepare.plan(cfgs[0]), prepare.plan(cfgs[1])
        (src,) = p1.sources
        assert len(src.groups) >= 3 and src.group_records[0][0] == 0
        assert [r[1] for r in src.group_records[:-1]] == [r[0] for r in src.group_records[1:]]   # contiguous
        assert len(p3.tasks) == 3
        prepare.run_pool(p1, progress=False)
        prepare.run_pool(p3, progress=False)
        assert fingerprint(cfgs[0]) == fingerprint(cfgs[1])
        opened = shards.ShardedSource.open("a", Path(src.dir))
        assert len(opened.shard_ids) == len(src.groups)
        text = bytes(t for t in opened.tokens[:] if t < 256).decode()
        assert text == "".join(builtin.documents("stdlib"))
    finally:
        builtin.sizes.cache_clear()


def test_a_large_jsonl_file_splits_into_pieces_with_the_same_stream(tmp_path, monkeypatch):
    """One large file is several groups (byte pieces, each line in the piece its first byte is in):
    the stream is the file's documents in order whatever the task count, and a bad line is named
    by its line in the file."""
    monkeypatch.setattr(prepare_tasks, "PIECE_BYTES", 1000)
    (tmp_path / "in").mkdir()
    texts = [f"document {d} " + "word " * (d % 37) for d in range(150)]
    write_jsonl(tmp_path / "in" / "big.jsonl", texts, corrupt_at=[120])   # line 121 is malformed
    cfgs = [_cfg(tmp_path, f"c{n}", prepare_tasks=n, shard_tokens=10**8, max_bad_fraction=0.5) for n in (1, 3)]
    p1, p3 = prepare.plan(cfgs[0]), prepare.plan(cfgs[1])
    (src,) = p1.sources
    size = (tmp_path / "in" / "big.jsonl").stat().st_size
    assert len(src.groups) == -(-size // 1000) and src.files == [str(tmp_path / "in" / "big.jsonl")]
    prepare.run_pool(p1, progress=False)
    prepare.run_pool(p3, progress=False)
    assert fingerprint(cfgs[0]) == fingerprint(cfgs[1])
    opened = shards.ShardedSource.open("a", Path(src.dir))
    assert bytes(t for t in opened.tokens[:] if t < 256).decode() == "".join(texts)
    assert opened.documents == 150 and opened.corrupt == 1
    bad = [m["first_bad"] for m in (shards.read_manifest(opened.path / s) for s in opened.shard_ids) if m["first_bad"]]
    assert bad == [f"{tmp_path / 'in' / 'big.jsonl'}:121: malformed json"]


def test_the_pool_forks_unless_jax_runs_here(monkeypatch):
    """Forked workers cost no start (a fifth of preparing the built-in corpus); a process running
    JAX spawns them instead (a fork would copy JAX's threads mid-lock)."""
    import sys

    monkeypatch.delitem(sys.modules, "jax", raising=False)
    assert prepare.pool_start_method() == ("fork" if sys.platform == "linux" else "spawn")
    monkeypatch.setitem(sys.modules, "jax", object())
    assert prepare.pool_start_method() == "spawn"
