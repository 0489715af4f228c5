"""The train state and how it is laid out over the mesh (spec §6).

Layout (`state_sharding`):
- routed expert weights `w_gate|w_up|w_down` [L, E, ...] (and every optimizer leaf that mirrors
  them) are expert-parallel: E split over the mesh's `expert` axis;
- with `hardware.mesh.fsdp` every other leaf of at least `FSDP_MIN_SIZE` elements is sharded
  inside a replica (FSDP): its largest dim divisible by data × expert is split over both axes
  (the stacked-layer dim 0 of `layers/` leaves is never split, so the layer scan slices locally);
  expert leaves additionally split their largest other dim over `data` when data > 1. Leaves are
  replicated over `replica_dcn` (and `model`). XLA's SPMD partitioner then all-gathers each
  layer's weights where they are used and reduce-scatters their gradients inside a replica;
  the replica_dcn reduction is an all-reduce;
- with `optim.offload` the optimizer state lives in pinned host memory (memory kind
  `pinned_host`); the train step moves it to the device for the update and back, except
  MuonH's momentum, which the optimizer streams one layer at a time (marin.optim.muonh). Under
  MuonH the routed experts' fp32 masters (`offloaded_masters`, ~97% of the hero's weights) live
  there too (spec §6): each layer's slice comes to the device where the layer runs, its
  gradient goes back (the transpose of that copy), and the update streams them per layer.
Small or indivisible leaves (norm gains, biases, scalars) stay replicated.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from marin.model import routers, transformer
from marin.model.mesh import BATCH_AXES

# Leaves that hold one slice per routed expert on axis 1 (after the stacked-layer axis): they are
# split over the mesh's `expert` axis; so are the optimizer moments that mirror them.
EXPERT_LEAVES = transformer.EXPERT_LEAVES
FSDP_AXES = ("data", "expert")
FSDP_MIN_SIZE = 2 ** 14          # smaller leaves are not worth a collective: replicated
HOST = "pinned_host"


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


def _names(path) -> set:
    return {getattr(k, "key", getattr(k, "name", None)) for k in path}


def _split_largest(shape, spec: list, size: int, axes, skip: set) -> list:
    """`spec` with the largest dim of `shape` that `size` divides (and not in `skip`) split over
    `axes`; unchanged if none qualifies."""
    dims = [i for i in range(len(shape)) if i not in skip and spec[i] is None and shape[i] % size == 0]
    if size > 1 and dims:
        best = max(dims, key=lambda i: (shape[i], -i))
        spec[best] = axes if len(axes) > 1 else axes[0]
    return spec


def leaf_spec(path, leaf, cfg, mesh_sizes: dict) -> P:
    """PartitionSpec of one state leaf (module docstring)."""
    names = _names(path)
    shape = tuple(leaf.shape)
    spec = [None] * len(shape)
    stacked = {0} if "layers" in names and len(shape) > 1 else set()
    if names & set(EXPERT_LEAVES) and len(shape) >= 3 and shape[1] == cfg.model.num_experts:
        spec[1] = "expert"
        if cfg.hardware.mesh.fsdp:
            spec = _split_largest(shape, spec, mesh_sizes.get("data", 1), ("data",), stacked)
        return P(*spec)
    if not cfg.hardware.mesh.fsdp or math.prod(shape) < FSDP_MIN_SIZE:
        return P()
    axes = tuple(a for a in FSDP_AXES if mesh_sizes.get(a, 1) > 1)
    size = math.prod(mesh_sizes[a] for a in axes)
    return P(*_split_largest(shape, spec, size, axes, stacked))


def offloaded_masters(cfg) -> bool:
    """Whether the routed experts' fp32 masters live in pinned host memory: with `optim.offload`
    under MuonH, whose update streams them one layer at a time (AdamW reads whole leaves)."""
    return bool(cfg.optim.offload) and cfg.optim.name == "muonh"


def is_expert_leaf(path, leaf, cfg) -> bool:
    return bool(_names(path) & set(EXPERT_LEAVES)) and len(leaf.shape) >= 3 and \
        leaf.shape[1] == cfg.model.num_experts


def state_sharding(cfg, abstract_state, mesh):
    """NamedSharding of every leaf of the train state (layout: module docstring)."""
    sizes = dict(mesh.shape)

    def sharding(path, leaf, memory_kind=None):
        return NamedSharding(mesh, leaf_spec(path, leaf, cfg, sizes), memory_kind=memory_kind)

    out = jax.tree_util.tree_map_with_path(sharding, abstract_state)
    if offloaded_masters(cfg):
        out = out.replace(params=jax.tree_util.tree_map_with_path(
            lambda p, leaf: sharding(p, leaf, HOST if is_expert_leaf(p, leaf, cfg) else None),
            abstract_state.params))
    if cfg.optim.offload:
        out = out.replace(opt_state=jax.tree_util.tree_map_with_path(
            lambda p, leaf: sharding(p, leaf, HOST), abstract_state.opt_state))
    return out


def init_sharded(cfg, tx, mesh, seed: int):
    """(initial state laid out on `mesh`, its shardings), tracing the model's init once: the
    trace's shapes decide the shardings, and the same trace (its jaxpr) is compiled with them
    (eval_shape and then jit would trace the whole model twice: a third of a second for a tiny one)."""
    from jax.extend.core import jaxpr_as_fun

    key = jax.random.key(seed)
    with jax.set_mesh(mesh):
        traced = jax.jit(lambda k: init_state(cfg, tx, k)).trace(key)
        shardings = state_sharding(cfg, traced.out_info, mesh)
        made = jaxpr_as_fun(traced.jaxpr)
        state = jax.jit(lambda k: traced.out_tree.unflatten(made(k)), out_shardings=shardings)(key)
    return state, shardings


def check_host_memory(devices=None) -> str | None:
    """None if the backend offers pinned host memory (needed by `optim.offload`); else why not."""
    device = (devices or jax.devices())[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST in kinds:
        return None
    return (f"optim.offload: the {device.platform} backend has no '{HOST}' memory "
            f"(memory kinds: {', '.join(sorted(kinds))}); set optim.offload=false")


def batch_sharding(mesh):

    return NamedSharding(mesh, P(BATCH_AXES))
