"""The train state and how it is laid out over the mesh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from marin.model import routers, transformer

# Leaves that hold one slice per routed expert on axis 1 (after the stacked-layer axis): they are
# split over the mesh's `expert` axis; so are the optimizer moments that mirror them.
EXPERT_LEAVES = ("w_gate", "w_up", "w_down")


@struct.dataclass
class TrainState:
    step: jax.Array          # int32 scalar: optimizer steps taken
    params: dict
    opt_state: object
    router_state: jax.Array  # [L, E]: QB pending betas / bias-update biases (see routers.py)


def init_state(cfg, tx, key) -> TrainState:
    params = transformer.init_params(cfg, key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      router_state=routers.init_router_state(cfg))


def _leaf_spec(path, leaf, num_experts: int) -> P:
    names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    if names & set(EXPERT_LEAVES) and leaf.ndim >= 3 and leaf.shape[1] == num_experts:
        return P(None, "expert")
    return P()


def state_sharding(cfg, abstract_state, mesh):
    """Expert weights (and their optimizer moments) split over `expert`; everything else
    replicated. Batches are split over every axis but `model` (see `batch_sharding`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, _leaf_spec(path, leaf, cfg.model.num_experts)),
        abstract_state)


def batch_sharding(mesh):
    from marin.launch.mesh import BATCH_AXES

    return NamedSharding(mesh, P(BATCH_AXES))
