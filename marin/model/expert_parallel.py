"""Expert parallelism: experts sharded on E over the mesh's `expert` axis (spec §6).

Inside `jax.shard_map` each device routes its own tokens (tokens are split over the batch axes
replica_dcn × data × expert) and moves each assignment to the device owning its expert by the
training transport, `model.ep_transport`:

- `fixed`: the [E, C_local, ℓ] send buffer of the single-device sort dispatch (C_local from the
  device's own T·k) and one `all_to_all` over `expert`, which delivers to every device the rows
  of its E/n experts from all n peers: [E/n, n·C_local, ℓ]; the local experts run as one batched
  matmul and a second `all_to_all` returns the rows. A (device, expert) pair past C_local drops,
  even when the expert has room for every device's rows.
- `pooled` (`dispatch.pooled_dispatch`, the published run's transport until step 81,716): one
  sender pool per device (`model.ep_send_capacity_factor` · T·k rows), each destination's share
  filled by token-major rank and striped over `model.ep_waves` static waves that each carry
  every local expert; receive buffers of `model.ep_recv_capacity_factor` · T·k / (local · waves)
  rows per (expert, wave), slots round-robin across senders, each wave rematerialised; drops
  counted per stage (send, recv). Static shapes: runs on every backend.
- `ragged` (`ragged_transport`): `jax.lax.ragged_all_to_all` sends exactly the rows each peer
  needs into a receive buffer of ⌈`model.ep_recv_capacity_factor` · T·k⌉ / `model.ep_expert_chunks`
  rows per chunk of local experts, the chunks one after another (one chunk's buffers live); the
  receiver runs its experts with grouped matmuls (`model.grouped_matmul`). No drops unless a
  chunk receives more than its buffer (then "recv" drops). XLA:CPU can lower it but not compile or run it (validation
  refuses ragged on CPU outside a planning dry run); tests on CPU run the same index arithmetic
  through `emulated_ragged_all_to_all`.

Routing statistics (QB's quantile, load, dropped fraction) are reduced over the batch axes, so
they are those of the global batch. Dropless evaluation repeats the fixed round trip in waves
(`dispatch.wave_dispatch`), the wave count maxed over `expert` so the all_to_alls pair up.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from marin.config import derive
from marin.config.derive import remat_mode
from marin.config.registry import Registry
from marin.model import routers
from marin.model.dispatch import (
    ExpertWeights,
    capacity,
    expert_queues,
    expert_swiglu,
    pooled_capacities,
    pooled_dispatch,
    routed_experts,
    sort_dispatch,
    take_rows,
)
from marin.model.kernels.grouped_matmul import grouped_matmul
from marin.model.mesh import BATCH_AXES

EXPERT_AXIS = "expert"


def expert_parallel_size(mesh) -> int:
    """Size of the mesh's `expert` axis (1 without a mesh or without that axis)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(EXPERT_AXIS, 1))


def _remote_experts(xe, w: ExpertWeights):
    """[E, C, ℓ] send buffer → outputs of the same rows, via the devices owning the experts."""
    recv = jax.lax.all_to_all(xe, EXPERT_AXIS, split_axis=0, concat_axis=1, tiled=True)  # [E/n, n·C, ℓ]
    out = expert_swiglu(recv, w)
    return jax.lax.all_to_all(out, EXPERT_AXIS, split_axis=1, concat_axis=0, tiled=True)  # [E, C, ℓ]


def _exchange(a):
    """[peers, S, ...] → [peers, S, ...]: block p goes to peer p; block s of the result came from s."""
    return jax.lax.all_to_all(a, EXPERT_AXIS, split_axis=0, concat_axis=0, tiled=True)




# --- ragged transport -------------------------------------------------------------------------

ragged_buffer_rows = derive.ragged_buffer_rows   # rows of one chunk's receive buffer (pure Python)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics from all_gather and gathers, for backends without
    the op (XLA:CPU): tests run the ragged transport's index arithmetic with it. Memory n× the
    operand: not for real runs."""
    del recv_sizes  # implied by the senders' sizes (the op requires them to agree)
    ops = jax.lax.all_gather(operand, axis_name)                 # [src, N, ...]
    starts, sizes, dests = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis_name)
    r = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        lo, size, start = dests[s, me], sizes[s, me], starts[s, me]
        inside = (r >= lo) & (r < lo + size)
        rows = jnp.take(ops[s], jnp.clip(start + r - lo, 0, operand.shape[0] - 1), axis=0)
        output = jnp.where(inside.reshape(-1, *[1] * (output.ndim - 1)), rows, output)
    return output


def _pad_rows(a, rows: int):
    """a [m, ...] cut or zero-padded to [rows, ...]."""
    if a.shape[0] >= rows:
        return a[:rows]
    return jnp.concatenate([a, jnp.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def stand_in_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name):
    """A memory stand-in for `ragged_all_to_all` where XLA:CPU cannot compile it (`dry_run=compile`):
    the same operand and output buffers, moved by one tiled all_to_all of the operand (as many
    bytes as the ragged op sends when the receive buffer is full). Its values are not the op's."""
    del input_offsets, send_sizes, output_offsets, recv_sizes
    peers = jax.lax.axis_size(axis_name)
    rows = -(-operand.shape[0] // peers) * peers
    moved = jax.lax.all_to_all(_pad_rows(operand, rows), axis_name, 0, 0, tiled=True)
    return output + _pad_rows(moved, output.shape[0])


def stand_in_grouped_matmul(x, w, group_sizes):
    """A memory stand-in for `ragged_dot` (which XLA:CPU lowers to an E× dense masked matmul):
    the rows split evenly over the groups, one batched matmul: the grouped GEMM's FLOPs and
    buffers. Its values are not the op's."""
    del group_sizes
    groups, m = w.shape[0], x.shape[0]
    rows = -(-m // groups) * groups
    out = jnp.einsum("gra,gab->grb", _pad_rows(x, rows).reshape(groups, rows // groups, -1), w)
    return out.reshape(rows, -1)[:m]


RAGGED_ALL_TO_ALL = jax.lax.ragged_all_to_all   # tests on CPU swap in `emulated_ragged_all_to_all`
GROUPED_MATMUL = None   # None: kernels.grouped_matmul by model.grouped_matmul; dry_run=compile on CPU swaps in the stand-ins


def _chunk_weights(w: ExpertWeights, chunks: int) -> ExpertWeights:
    """[local, ...] → [chunks, local / chunks, ...]; the local experts padded with zero experts
    (which no assignment targets) when `chunks` does not divide them."""
    local = w.gate.shape[0]
    per = -(-local // chunks)

    def split(a):
        if per * chunks > local:
            a = jnp.concatenate([a, jnp.zeros((per * chunks - local, *a.shape[1:]), a.dtype)])
        return a.reshape(chunks, per, *a.shape[1:])
    return ExpertWeights(*(split(a) for a in w))


def _exclusive(a, axis):
    return jnp.cumsum(a, axis=axis) - a


def ragged_transport(x, expert_idx, weights, w: ExpertWeights, num_experts: int, buffer_rows: int,
                     impl: str = "xla", chunks: int = 1):
    """Exact expert transport with `ragged_all_to_all`: (y [T, ℓ], dropped assignments []).

    The T·k assignments are sorted by expert (so by owning peer); one all_gather of the per
    (peer, expert) counts [n, n, E/n] tells every device every block's size, so all of them
    compute the same offsets. The local experts are cut into `chunks` chunks
    (`model.ep_expert_chunks`; production: 2) that run one after another, so one
    chunk's receive buffer of `buffer_rows` rows (and its expert activations) is live at a time:
    per chunk, device s's block for peer p lands in p's buffer after the blocks of devices < s
    (cut at `buffer_rows`; what is cut is dropped and counted, per chunk). The receiver sorts its
    rows by local expert, runs the chunk's experts as grouped matmuls (`kernels.grouped_matmul`,
    `impl`: model.grouped_matmul), unsorts, and a second ragged_all_to_all with the offsets
    swapped returns the rows into the sender's sorted buffer, chunk after chunk (rows never sent
    come back as zeros). Every move is a gather with a gather as transpose or a ragged_all_to_all
    (whose transpose is another): differentiable. Expert ids ≥ num_experts (padding,
    `dispatch.mask_invalid`) sort last and are never sent.
    """
    a2a = partial(RAGGED_ALL_TO_ALL, axis_name=EXPERT_AXIS)
    ragged_dot = GROUPED_MATMUL or partial(grouped_matmul, impl=impl)
    tokens, k = expert_idx.shape
    n, local = tokens * k, w.gate.shape[0]
    peers = num_experts // local
    chunks = max(1, min(chunks, local))
    cw = _chunk_weights(w, chunks)
    per = cw.gate.shape[1]                                                       # experts per chunk
    q = expert_queues(expert_idx, num_experts)
    sorted_pos = jnp.zeros((n,), jnp.int32).at[q.order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    xs = take_rows(x, q.order % tokens, sorted_pos.reshape(k, tokens))            # [T·k, ℓ] by expert

    mine = jnp.pad(q.counts.reshape(peers, local), ((0, 0), (0, per * chunks - local)))
    counts = jax.lax.all_gather(mine.reshape(peers, chunks, per), EXPERT_AXIS)   # [src, dst, chunk, expert]
    total = jnp.sum(counts, axis=-1)                                             # [src, dst, chunk]
    # Where src's block for (dst, chunk) starts in src's sorted buffer: blocks in (dst, chunk) order.
    send_off = _exclusive(total.reshape(peers, -1), 1).reshape(total.shape)
    full_off = _exclusive(total, 0)
    kept = jnp.clip(buffer_rows - full_off, 0, total)  # what fits in dst's buffer for that chunk
    recv_off = _exclusive(kept, 0)                     # where src's block starts in dst's chunk buffer
    me = jax.lax.axis_index(EXPERT_AXIS)
    r = jnp.arange(buffer_rows, dtype=jnp.int32)

    def chunk(xs, back, c: int):
        """One chunk of local experts: receive, run, return into `back` (the sender's sorted rows)."""
        gate, up, down = (a[c] for a in cw)
        send, got = kept[me, :, c], kept[:, me, c]
        recv = a2a(xs, jnp.zeros((buffer_rows, x.shape[-1]), x.dtype), send_off[me, :, c], send,
                   recv_off[me, :, c], got)
        # Each received row's expert within the chunk: its sender's block, then the group in it.
        src = jnp.searchsorted(jnp.cumsum(got), r, side="right")
        src_c = jnp.minimum(src, peers - 1)
        within = r - recv_off[src_c, me, c]
        group_end = jnp.cumsum(counts[:, me, c, :], axis=-1)[src_c]              # [rows, per]
        expert = jnp.where(src < peers, jnp.sum(within[:, None] >= group_end, axis=-1), per)
        order = jnp.argsort(expert, stable=True).astype(jnp.int32)
        position = jnp.zeros((buffer_rows,), jnp.int32).at[order].set(r, unique_indices=True)
        group_sizes = routers.count_values(expert, per)   # compare-and-sum: no scatter-add (atomics) on GPU
        xr = take_rows(recv, order, position[None])
        h = jax.nn.silu(ragged_dot(xr, gate, group_sizes)) * ragged_dot(xr, up, group_sizes)
        out = take_rows(ragged_dot(h, down, group_sizes), position, order[None])
        return a2a(out, back, recv_off[:, me, c], got, send_off[:, me, c], send)

    # Chunk c + 1 reads the send rows only through a barrier with chunk c's returned rows, so it
    # cannot start before chunk c is done: one chunk's buffers are live at a time. (A lax.scan
    # does the same on a GPU, but XLA:CPU holds its stacked bf16 residuals in fp32: the hero's
    # dry_run=compile peak was 183.7 GiB with it, 147.6 with one chunk.)
    back = jnp.zeros_like(xs)
    for c in range(chunks):
        if c:
            xs, back = jax.lax.optimization_barrier((xs, back))
        back = chunk(xs, back, c)
    y_assign = take_rows(back, sorted_pos, q.order[None]).reshape(k, tokens, -1)
    y = jnp.einsum("kt,ktl->tl", weights.T.astype(jnp.float32), y_assign.astype(jnp.float32))
    # What is cut at the receivers' buffers: counted once, by the sender.
    return y.astype(x.dtype), {"send": jnp.int32(0), "recv": jnp.sum(total[me] - kept[me])}


# The training transports under expert parallelism, by model.ep_transport (one device: dispatch.TRANSPORTS).
# Each builds `(x, expert_idx, weights) -> (y, dropped)` for this device's `tokens` tokens.
PARALLEL = Registry("model.ep_transport")


@PARALLEL.register("fixed")
def _fixed(cfg, local_w: ExpertWeights, num_experts: int, peers: int, tokens: int, batch_axes):
    return partial(sort_dispatch, expert_fn=partial(_remote_experts, w=local_w), num_experts=num_experts,
                   cap=capacity(tokens, cfg.router.top_k, num_experts, cfg.model.capacity_factor))


@PARALLEL.register("pooled")
def _pooled(cfg, local_w: ExpertWeights, num_experts: int, peers: int, tokens: int, batch_axes):
    m = cfg.model
    send, recv = pooled_capacities(tokens, cfg.router.top_k, num_experts, peers, m.ep_waves,
                                   m.ep_send_capacity_factor, m.ep_recv_capacity_factor)
    return partial(pooled_dispatch, w=local_w, num_experts=num_experts, peers=peers, send_cap=send,
                   recv_cap=recv, waves=m.ep_waves, exchange=_exchange,
                   remat_waves=remat_mode(m.remat) != "full")   # remat full: the block's recompute remats them


@PARALLEL.register("ragged")
def _ragged(cfg, local_w: ExpertWeights, num_experts: int, peers: int, tokens: int, batch_axes):
    m = cfg.model
    chunks = max(1, min(m.ep_expert_chunks, num_experts // peers))
    rows = ragged_buffer_rows(tokens, cfg.router.top_k, num_experts, peers, m.ep_recv_capacity_factor, chunks)
    return partial(ragged_transport, w=local_w, num_experts=num_experts, buffer_rows=rows,
                   impl=derive.grouped_matmul_impl(cfg), chunks=chunks)


def _transport(cfg, local_w: ExpertWeights, num_experts: int, peers: int, tokens: int, batch_axes):
    """The training transport of `model.ep_transport` on this device's `tokens` tokens."""
    return PARALLEL.get(cfg.model.ep_transport)(cfg, local_w, num_experts, peers, tokens, batch_axes)


def routed_experts_ep(x, logits, bias, w: ExpertWeights, cfg, *, train: bool, mesh, valid=None):
    """`dispatch.routed_experts` with expert parallelism over `mesh` (same inputs and outputs).

    x [N, ℓ] and logits [N, E]: all tokens, N divisible by the batch-axis size; the expert
    weights are sharded on E over `expert` (E divisible by its size); valid [N] (None: all).
    """
    batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    num_experts, peers = w.gate.shape[0], expert_parallel_size(mesh)
    if num_experts % peers:
        raise ValueError(f"{num_experts} experts do not split over expert axis {peers}")

    def local(x, logits, bias, gate, up, down, valid):
        local_w = ExpertWeights(gate, up, down)
        return routed_experts(x, logits, bias, local_w, cfg, train=train, axis_names=batch_axes, valid=valid,
                              expert_fn=partial(_remote_experts, w=local_w), num_experts=num_experts,
                              wave_axes=(EXPERT_AXIS,),
                              transport=_transport(cfg, local_w, num_experts, peers, x.shape[0], batch_axes))

    tokens, experts = P(batch_axes, None), P(EXPERT_AXIS, None, None)
    stats_spec = {"beta": P(), "load": P(), "aux_loss": P(), "dropped_frac": P(),
                  "dropped_frac/send": P(), "dropped_frac/recv": P()}
    fn = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, P(), experts, experts, experts, P(batch_axes)),
                       out_specs=(tokens, stats_spec))
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid
    return fn(x, logits, bias, w.gate, w.up, w.down, valid)
