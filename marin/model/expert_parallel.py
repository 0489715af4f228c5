"""Expert parallelism: experts sharded on E over the mesh's `expert` axis (spec §6).

Inside `jax.shard_map` each device routes its own tokens (tokens are split over the batch axes
replica_dcn × data × expert), fills its [E, C_local, ℓ] send buffer exactly like the
single-device sort dispatch, and one `all_to_all` over `expert` delivers to every device the
rows of its E/n experts from all n peers: [E/n, n·C_local, ℓ]. The local experts run as one
batched matmul and a second `all_to_all` returns the rows to their tokens' devices. Routing
statistics (QB's quantile, load, dropped fraction) are reduced over the batch axes, so they are
those of the global batch.

The capacity is per device (C_local from the device's own T·k), as in the published run.
Dropless evaluation repeats this round trip in waves (`dispatch.wave_dispatch`), the wave count
maxed over `expert` so the all_to_alls of every device pair up.
`jax.lax.ragged_all_to_all` would avoid sending padding rows, but XLA:CPU does not implement it;
the fixed-size `all_to_all` runs on every backend.
"""
from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec as P

from marin.launch.mesh import BATCH_AXES
from marin.model.dispatch import ExpertWeights, expert_swiglu, routed_experts

EXPERT_AXIS = "expert"


def expert_parallel_size(mesh) -> int:
    """Size of the mesh's `expert` axis (1 without a mesh or without that axis)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(EXPERT_AXIS, 1))


def _remote_experts(xe, w: ExpertWeights):
    """[E, C, ℓ] send buffer → outputs of the same rows, via the devices owning the experts."""
    recv = jax.lax.all_to_all(xe, EXPERT_AXIS, split_axis=0, concat_axis=1, tiled=True)  # [E/n, n·C, ℓ]
    out = expert_swiglu(recv, w)
    return jax.lax.all_to_all(out, EXPERT_AXIS, split_axis=1, concat_axis=0, tiled=True)  # [E, C, ℓ]


def routed_experts_ep(x, logits, bias, w: ExpertWeights, cfg, *, train: bool, mesh):
    """`dispatch.routed_experts` with expert parallelism over `mesh` (same inputs and outputs).

    x [N, ℓ] and logits [N, E]: all tokens, N divisible by the batch-axis size; the expert
    weights are sharded on E over `expert` (E divisible by its size).
    """
    batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    num_experts = w.gate.shape[0]
    if num_experts % expert_parallel_size(mesh):
        raise ValueError(f"{num_experts} experts do not split over expert axis {expert_parallel_size(mesh)}")

    def local(x, logits, bias, gate, up, down):
        local_w = ExpertWeights(gate, up, down)
        return routed_experts(x, logits, bias, local_w, cfg, train=train, axis_names=batch_axes,
                              expert_fn=partial(_remote_experts, w=local_w), num_experts=num_experts,
                              wave_axes=(EXPERT_AXIS,))

    tokens, experts = P(batch_axes, None), P(EXPERT_AXIS, None, None)
    stats_spec = {"beta": P(), "load": P(), "aux_loss": P(), "dropped_frac": P()}
    fn = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, P(), experts, experts, experts),
                       out_specs=(tokens, stats_spec))
    return fn(x, logits, bias, w.gate, w.up, w.down)
