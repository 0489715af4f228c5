"""Run by tests/model/test_expert_parallel.py in a subprocess with 8 forced host devices: the
expert-parallel MoE layer (mesh data=2 × expert=4) against the same layer on one device.

Prints one JSON line: the max absolute differences of output, stats and gradients per router.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from marin.launch.mesh import make_mesh
from marin.model.moe import MoE
from tests.helpers import make_config


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare(router: str) -> dict:
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
    return {"y": max_diff(y1, y8), "stats": max_diff(s1, s8), "grads": max_diff(g1, g8),
            "dropped": float(s8["dropped_frac"]), "aux_loss": float(s8["aux_loss"]),
            "devices": jax.device_count()}


if __name__ == "__main__":
    print(json.dumps({router: compare(router) for router in sys.argv[1:]}))
