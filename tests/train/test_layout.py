"""The published layout (marin/train/state.py): FSDP specs, and a run on 8 forced host devices
with FSDP, optimizer-state offload and carry offload gives the losses of one device (AdamW, and
MuonH, whose offload also puts the experts' fp32 masters in host memory and streams them).

The device count must be forced before JAX starts, so the 8-device comparison runs this module
as a subprocess (`python -m tests.train.test_layout`), which trains both layouts there.
"""
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from marin.optim import build_optimizer
from marin.train.state import init_state, leaf_spec
from tests.helpers import make_config, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
# model=micro: the block without GatedNorm, short convolutions and shared experts (what is under
# test is the train state's layout around the routed MoE: 25 CPU-s here, 44 with model=tiny); every
# leaf's spec, those included, is checked above on model=small, and the hero compiles with them all
# in this layout (tests/launch/test_compile_plan.py).
TINY = ["model=micro", "train.seq_len=32", "train.global_batch=8", "train.steps=3",
        "model.capacity_factor=2.0"]  # capacity factor E/k: nothing drops on 1 or 8 devices
LAYOUT = ["hardware.mesh.fsdp=true", "optim.offload=true", "model.remat=full", "model.offload_carry=true"]


def specs(cfg, sizes):
    tx = build_optimizer(cfg)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return {jax.tree_util.keystr(path): (leaf.shape, leaf_spec(path, leaf, cfg, sizes)) for path, leaf in flat}


def test_fsdp_shards_every_large_leaf_inside_the_replica():
    cfg = make_config("model=small", "hardware=local_cpu8", "hardware.mesh.fsdp=true", "optim=muonh")
    sizes = {"replica_dcn": 1, "data": 2, "expert": 4, "model": 1}
    out = specs(cfg, sizes)
    params = {k: v for k, v in out.items() if k.startswith(".params")}
    for name, (shape, spec) in out.items():
        if any(f"'{w}'" in name for w in ("w_gate", "w_up", "w_down")) and len(shape) >= 3:
            assert spec[1] == "expert", (name, spec)           # expert parallel, data-FSDP on another dim
            assert "data" in tuple(spec), (name, spec)
        elif np.prod(shape) >= 2 ** 14:
            assert ("data", "expert") in tuple(spec), (name, shape, spec)
            dim = tuple(spec).index(("data", "expert"))
            assert shape[dim] % 8 == 0 and not (dim == 0 and "'layers'" in name), (name, shape, spec)
        else:
            assert spec == P(), (name, spec)                    # small leaves stay replicated
    assert params[".params['layers']['attn']['wq']"][1] == P(None, ("data", "expert"), None) or \
        params[".params['layers']['attn']['wq']"][1] == P(None, None, ("data", "expert"))
    off = make_config("model=small", "hardware=local_cpu8", "optim=muonh")
    assert all(spec == P() or spec[1] == "expert" for _, spec in specs(off, sizes).values())


def losses(cfg, devices):
    from marin.data.loader import Loader
    from marin.model.mesh import make_mesh
    from marin.train.state import state_sharding
    from marin.train.step import hyperparams, jit_steps

    mesh = make_mesh(cfg, devices)
    tx = build_optimizer(cfg)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    shardings = state_sharding(cfg, abstract, mesh)
    state = jax.jit(lambda k: init_state(cfg, tx, k), out_shardings=shardings)(jax.random.key(0))
    train_step, eval_step = jit_steps(cfg, tx, mesh, shardings)
    loader, out = Loader(cfg), []
    spec = train_step.in_shardings[1] if hasattr(train_step, "in_shardings") else None
    for step in range(cfg.train.steps):
        batch = {k: v for k, v in loader.batch(step).items() if k != "source_counts"}
        batch = jax.device_put(batch, spec) if spec is not None else batch
        state, metrics = train_step(state, batch, hyperparams(cfg, mesh))
        out.append(float(metrics["loss"]))
    host = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
    masters = sorted({"/".join(str(getattr(k, "key", k)) for k in path[-1:]) for path, x in
                      jax.tree_util.tree_flatten_with_path(state.params)[0] if x.sharding.memory_kind == "pinned_host"})
    return out, host, masters


def compare() -> dict:
    one, _, _ = losses(make_config(*TINY), jax.devices()[:1])
    eight, host, _ = losses(make_config(*TINY, "hardware=local_cpu8", *LAYOUT), jax.devices())
    # MuonH streams its momentum and the experts' fp32 masters (in host memory) layer by layer
    one_m, _, _ = losses(make_config(*TINY, "optim=muonh"), jax.devices()[:1])
    eight_m, _, masters = losses(make_config(*TINY, "optim=muonh", "hardware=local_cpu8", *LAYOUT), jax.devices())
    return {"one": one, "eight": eight, "host": host, "devices": jax.device_count(),
            "one_muonh": one_m, "eight_muonh": eight_m, "masters_on_host": masters}


@pytest.mark.slow
def test_eight_devices_with_fsdp_and_offload_match_one_device(tmp_path):
    env = subprocess_env(8, MARIN_TEST_OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "tests.train.test_layout"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == 8 and r["host"] == ["pinned_host"], r
    assert len(r["one"]) == 3 and r["one"][-1] < r["one"][0], r   # it trains
    np.testing.assert_allclose(r["eight"], r["one"], rtol=2e-5)
    assert r["masters_on_host"] == ["w_down", "w_gate", "w_up"], r   # the experts' fp32 masters
    assert r["one_muonh"][-1] < r["one_muonh"][0], r
    np.testing.assert_allclose(r["eight_muonh"], r["one_muonh"], rtol=2e-5)


if __name__ == "__main__":
    print(json.dumps(compare()))
