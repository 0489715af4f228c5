"""Per-process checkpoint manifests (marin/train/manifest.py): which files each process owns, chunked
hashing, and a real 2-process JAX job (two local CPU processes under jax.distributed) where each
process seals its own shards and a flipped bit in process 1's shard is caught at restore.

The 2-process job runs this module as its processes (`python -m tests.train.test_manifest`)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from marin.train import manifest
from tests.helpers import checkpoint_sealed, subprocess_env

ROOT = Path(__file__).resolve().parents[2]

# orbax's layout of a step written by 2 processes (OCDBT): per-process shard folders and metadata files
LAYOUT = ["_CHECKPOINT_METADATA", "commit_success.txt", "meta/metadata", "state/_METADATA", "state/_sharding",
          "state/manifest.ocdbt", "state/d/root0", "state/array_metadatas/process_0", "state/array_metadatas/process_1",
          "state/ocdbt.process_0/manifest.ocdbt", "state/ocdbt.process_0/d/a0", "state/ocdbt.process_1/manifest.ocdbt",
          "state/ocdbt.process_1/d/b1", "state/ocdbt.process_1/d/b2"]


def _lay_out(step_dir: Path) -> None:
    for i, name in enumerate(LAYOUT):
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / name).write_bytes(bytes([i]) * (100 + i))


def test_each_file_belongs_to_exactly_one_process(tmp_path, monkeypatch):
    _lay_out(tmp_path)
    walked = []
    real_walk = os.walk
    monkeypatch.setattr(manifest.os, "walk", lambda top: ((walked.append(r), (r, d, f))[1] for r, d, f in real_walk(top)))
    first = manifest.own_files(tmp_path, 1, 2)
    assert first == ["state/array_metadatas/process_1", "state/ocdbt.process_1/d/b1", "state/ocdbt.process_1/d/b2",
                     "state/ocdbt.process_1/manifest.ocdbt"]
    assert not any("process_0" in r for r in walked)   # process 1 never lists process 0's shards
    zeroth = manifest.own_files(tmp_path, 0, 2)
    assert "meta/metadata" in zeroth and "state/d/root0" in zeroth and not any("process_1" in n for n in zeroth)
    assert sorted(first + zeroth) == sorted(n for n in LAYOUT if n not in manifest.UNHASHED)
    assert manifest.own_files(tmp_path, 0, 1) == sorted(zeroth + first)   # read by one process: all of it


def test_chunks_catch_a_flip_and_a_short_file(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "CHUNK", 48)   # several chunks per file, hashed on 3 threads
    _lay_out(tmp_path)
    for p in (0, 1):
        manifest.write(tmp_path, p, 2, threads=3)
    body = json.loads((tmp_path / "manifest.1.json").read_text())
    assert len(body["files"]["state/ocdbt.process_1/d/b2"]["sha256"]) == 3   # 113 bytes in 48-byte chunks
    assert manifest.complete(tmp_path) and manifest.damage(tmp_path, 1, 2) is None
    victim = tmp_path / "state/ocdbt.process_1/d/b2"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x40                               # in the last chunk
    victim.write_bytes(bytes(data))
    monkeypatch.setattr(manifest, "CHUNK", 1 << 20)   # verified in the chunks the manifest records
    assert manifest.damage(tmp_path, 0, 2) is None   # process 0's share is intact
    assert manifest.damage(tmp_path, 1, 2) == "state/ocdbt.process_1/d/b2 does not match its sha256"
    assert manifest.damage(tmp_path, 0, 1) is not None   # one restoring process checks both manifests
    victim.write_bytes(bytes(data[:50]))
    assert "has 50 bytes, its manifest says 113" in manifest.damage(tmp_path, 1, 2)
    (tmp_path / "manifest.0.json").unlink()
    assert manifest.missing(tmp_path) == ["manifest.0.json"] and not manifest.complete(tmp_path)


def test_the_slurm_tests_wait_for_a_checkpoint_every_process_has_sealed(tmp_path):
    """A job killed before its first checkpoint is sealed restarts from step 0: the Slurm tests
    must not kill it on seeing the step's folder alone."""
    step_dir = tmp_path / "checkpoints" / "4"
    _lay_out(step_dir)                         # orbax has committed the step; no process has sealed it
    assert not checkpoint_sealed(tmp_path)
    (step_dir / manifest.META_FILE).write_text(json.dumps({manifest.META_KEY: 2}))
    manifest.write(step_dir, 1, 2)
    assert not checkpoint_sealed(tmp_path)     # process 0's manifest still missing
    manifest.write(step_dir, 0, 2)
    assert checkpoint_sealed(tmp_path)


# ---------------------------------------------------------------------------- two processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_each_seal_their_own_shards_and_catch_a_flip(tmp_path):
    port = _free_port()
    env = subprocess_env()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.train.test_manifest", str(i), str(port), str(tmp_path)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    results = [json.loads((tmp_path / f"result-{i}.json").read_text()) for i in (0, 1)]
    step2 = tmp_path / "checkpoints" / "2.corrupt"   # set aside (below), kept whole
    owned = [json.loads((step2 / manifest.name(i)).read_text())["files"] for i in (0, 1)]
    assert owned[1] and all("process_1" in n for n in owned[1])          # process 1 hashed its own shards
    assert not any("process_1" in n for n in owned[0]) and "meta/metadata" in owned[0]
    on_disk = {str(f.relative_to(step2)) for f in step2.rglob("*") if f.is_file()}
    assert set(owned[0]) | set(owned[1]) == {n for n in on_disk if not n.startswith("manifest.")} - set(manifest.UNHASHED)
    for r in results:
        assert r["restored_step"] == 1 and r["value_ok"], r                 # both fell back to step 1
    assert "does not match its sha256" in results[1]["log"]                 # process 1 found it, in its share
    assert "found by process 1" in results[0]["log"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2.corrupt"]


def _one_process(index: int, port: int, out: Path) -> None:
    """One of the two processes: save steps 1 and 2 of a state sharded over both, flip a bit in
    a shard process 1 wrote, restore."""
    import logging
    from types import SimpleNamespace as NS

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from marin.train.checkpoint import Checkpointer

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=index, initialization_timeout=120)
    from jax.experimental import multihost_utils

    log_file = out / f"log-{index}.txt"
    logging.getLogger("marin.checkpoint").addHandler(logging.FileHandler(log_file))
    cfg = NS(train=NS(steps=10, seed=0, checkpoint=NS(every_steps=1, keep_last=2, every_minutes=0, permanent_every=0,
                                                       async_save=True)), schedule=NS(horizon_steps=None))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))

    def state(step):
        data = np.arange(4096, dtype=np.float32).reshape(8, 512) + step
        return {"w": jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx]),
                "step": jax.make_array_from_callback((), NamedSharding(mesh, PartitionSpec()), lambda _: np.int32(step))}

    ckpt = Checkpointer(out, cfg)
    for step in (1, 2):
        ckpt.save(step, state(step), {})
    ckpt.close()
    multihost_utils.sync_global_devices("saved")
    if index == 1:
        shards = [f for f in (out / "checkpoints" / "2" / "state" / "ocdbt.process_1").rglob("*")
                  if f.is_file() and f.parent.name == "d"]
        victim = max(shards, key=lambda f: f.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    multihost_utils.sync_global_devices("flipped")
    restored, meta = Checkpointer(out, cfg).restore(state(0))
    local = np.concatenate([np.asarray(s.data) for s in restored["w"].addressable_shards])
    expected = np.concatenate([np.asarray(s.data) for s in state(1)["w"].addressable_shards])
    (out / f"result-{index}.json").write_text(json.dumps({
        "restored_step": meta["step"], "value_ok": bool(np.array_equal(local, expected)), "log": log_file.read_text()}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    _one_process(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
