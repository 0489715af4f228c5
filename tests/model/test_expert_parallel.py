"""Expert parallelism on 8 forced host devices (mesh data=2 × expert=4) matches one device.

The device count must be forced before JAX is imported, and the pytest process has already
imported it, so the test runs this same module as a subprocess (`python -m
tests.model.test_expert_parallel qb softmax_aux`) with XLA_FLAGS set; `compare` runs there.
"""
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model.mesh import make_mesh
from marin.model.moe import MoE
from tests.helpers import make_config, subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare(router: str) -> dict:
    """Output, stats and gradients (params and input) of the EP layer against one device."""
    # E=8 over expert=4 (2 experts per device); cf = E/k makes every capacity C = T: no drops.
    cfg = make_config("model=tiny", f"router={router}", "model.num_experts=8", "model.capacity_factor=4.0",
                      "hardware.host_devices=8", "hardware.mesh.expert=4")
    mesh = make_mesh(cfg)
    assert dict(mesh.shape) == {"replica_dcn": 1, "data": 2, "expert": 4, "model": 1}, mesh.shape
    module = MoE(cfg)
    kx, kp, kb, kr = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (8, 16, cfg.model.d_model))
    bias = 0.3 * jax.random.normal(kb, (cfg.model.num_experts,))
    probe = jax.random.normal(kr, x.shape)
    params = module.init(kp, x, bias, train=True)

    def loss(params, x, mesh):
        y, stats = module.apply(params, x, bias, train=True, mesh=mesh)
        return jnp.sum(y * probe) + stats["aux_loss"], (y, stats)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, (y1, s1)), g1 = run(params, x, None)
    (_, (y8, s8)), g8 = run(params, x, mesh)
    return {"y": _max_diff(y1, y8), "stats": _max_diff(s1, s8), "grads": _max_diff(g1, g8),
            "dropped": float(s8["dropped_frac"]), "aux_loss": float(s8["aux_loss"]),
            "devices": jax.device_count()}


@pytest.mark.slow
def test_expert_parallel_layer_matches_single_device():
    env = subprocess_env(8)
    proc = subprocess.run([sys.executable, "-m", "tests.model.test_expert_parallel", "qb", "softmax_aux"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for router, r in results.items():
        assert r["devices"] == 8, r
        assert r["dropped"] == 0.0, (router, r)            # cf = E/k: a no-drop capacity
        assert r["y"] <= 1e-5 and r["grads"] <= 1e-5 and r["stats"] <= 1e-5, (router, r)
    assert results["softmax_aux"]["aux_loss"] > 0          # the psum'd aux loss is really there


if __name__ == "__main__":
    print(json.dumps({router: compare(router) for router in sys.argv[1:]}))
