"""Token dispatch: moving each token's k assignments to their experts and back (`model.dispatch`).

`sort` (default): sort the T·k assignments by expert, place them into a fixed [E, C, ℓ] buffer
(C from the capacity factor), run all experts as one batched matmul, gather the results back and
combine. Assignments past an expert's capacity are dropped (the token keeps the shared experts
and the residual). Both moves are row gathers whose transposes are again row gathers (the slot
map is a partial permutation), so the backward pass has no scatter-add either; see
benchmarks/README.md (moe_layer.py) for why this formulation (1.5× a dense MLP on CPU, against
2.4× for one-hot einsums and 17× for `ragged_dot`).

Evaluation is dropless without an [E, T, ℓ] buffer: `wave_dispatch` reuses the training buffer for
queue positions [0, C), [C, 2C), ... until every expert's queue is done (`model.eval_dispatch`).

The training pass moves tokens by `model.ep_transport` (`local_transport` on one device,
`expert_parallel.py` across devices): `fixed` is `sort_dispatch`; `pooled_dispatch` pools the
capacities (per peer sent, per expert received) and sends overflow in a static number of waves.

`ragged_dot` (sort + `jax.lax.ragged_dot`) and `dense` (every expert on every token, masked) are
dropless references for tests; on CPU both cost about E× the useful FLOPs.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from marin.config.registry import TRANSPORTS
from marin.model import routers


class ExpertWeights(NamedTuple):
    """The routed experts, SwiGLUs inside the latent: gate/up [E, ℓ, I], down [E, I, ℓ]."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array


def expert_swiglu(xe, w: ExpertWeights):
    """Every expert on its own rows: xe [E, C, ℓ] → [E, C, ℓ] (one batched matmul per weight)."""
    h = jax.nn.silu(jnp.einsum("ecl,eli->eci", xe, w.gate)) * jnp.einsum("ecl,eli->eci", xe, w.up)
    return jnp.einsum("eci,eil->ecl", h, w.down)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert: ceil(cf · T·k / E) rounded up to a multiple of 8, never more than T
    (a token picks an expert at most once, so C = T can never drop)."""
    c = math.ceil(capacity_factor * tokens * top_k / num_experts)
    return max(1, min(8 * math.ceil(c / 8), tokens))


# --- row gathers whose transpose is a gather --------------------------------------------------

def _take(src, idx):
    """src[idx] with idx == len(src) (or beyond) reading a zero row."""
    return jnp.take(src, idx, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def take_rows(src, idx, inverse):
    """out[m] = src[idx[m]] (zero where idx is out of range).

    `inverse` [r, len(src)] lists, for each source row, the output rows that read it (padded
    with len(out)), so the cotangent is Σ_r g[inverse[r]]: a gather, where JAX's default
    transpose would be a scatter-add (slow on CPU and serialising on GPU).
    """
    return _take(src, idx)


def _take_rows_fwd(src, idx, inverse):
    return _take(src, idx), (idx, inverse)


def _take_rows_bwd(res, g):
    idx, inverse = res
    return jnp.sum(_take(g, inverse), axis=0), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


class Slots(NamedTuple):
    """Where each assignment goes. Assignment a = j·T + t is token t's j-th choice, so when an
    expert overflows, second choices are dropped before first choices."""
    slot_of_assignment: jax.Array   # [T·k] row of the [E·C] buffer, E·C where dropped
    assignment_of_slot: jax.Array   # [E·C] the assignment in that row, T·k where empty
    counts: jax.Array               # [E] assignments per expert before dropping


class Queues(NamedTuple):
    """The assignments in expert order: each expert's queue, first choices before second ones."""
    order: jax.Array          # [T·k] assignment ids sorted (stably) by expert
    sorted_expert: jax.Array  # [T·k] the expert of each sorted assignment
    position: jax.Array       # [T·k] rank of each sorted assignment in its expert's queue
    starts: jax.Array         # [E] where each expert's queue starts in `order`
    counts: jax.Array         # [E] queue lengths (assignments per expert)


def expert_queues(expert_idx, num_experts: int) -> Queues:
    """Stable sort of the assignments by expert; position within the expert = rank in the sort."""
    n = expert_idx.size
    flat_expert = expert_idx.T.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat_expert].add(1)
    starts = jnp.cumsum(counts) - counts
    sorted_expert = flat_expert[order]
    position = jnp.arange(n, dtype=jnp.int32) - starts[sorted_expert]
    return Queues(order, sorted_expert, position, starts, counts)


def queue_slots(q: Queues, cap: int, first=0) -> Slots:
    """Buffer rows for the queue positions [first, first + cap) of every expert (a "wave");
    assignments outside that window get the out-of-range slot E·C (dropped, or left to another
    wave). `first` may be traced."""
    n, num_experts = q.order.shape[0], q.counts.shape[0]
    pos = q.position - first
    inside = (pos >= 0) & (pos < cap)
    slot_sorted = jnp.where(inside, q.sorted_expert * cap + pos, num_experts * cap)
    slot_of_assignment = jnp.zeros((n,), jnp.int32).at[q.order].set(slot_sorted, unique_indices=True)
    # Row c of expert e holds the (starts[e] + first + c)-th assignment of the sort, if it has that many.
    queue_pos = first + jnp.arange(cap, dtype=jnp.int32)[None, :]
    rank = q.starts[:, None] + queue_pos
    filled = queue_pos < q.counts[:, None]
    assignment_of_slot = jnp.where(filled, q.order[jnp.minimum(rank, n - 1)], n).reshape(-1)
    return Slots(slot_of_assignment.astype(jnp.int32), assignment_of_slot.astype(jnp.int32), q.counts)


def assign_slots(expert_idx, num_experts: int, cap: int) -> Slots:
    """Slots of the fixed-capacity dispatch: the first `cap` of each expert's queue."""
    return queue_slots(expert_queues(expert_idx, num_experts), cap)


def sort_dispatch(x, expert_idx, weights, expert_fn: Callable, num_experts: int, cap: int):
    """Fixed-capacity dispatch: (y [T, ℓ], dropped assignments []).

    x [T, ℓ]; expert_idx, weights [T, k]; expert_fn maps the [E, C, ℓ] buffer to the experts'
    outputs (local experts, or an all_to_all round trip under expert parallelism).
    """
    tokens, k = expert_idx.shape
    s = assign_slots(expert_idx, num_experts, cap)
    token_of_slot = jnp.where(s.assignment_of_slot < tokens * k, s.assignment_of_slot % tokens, tokens)
    xe = take_rows(x, token_of_slot, s.slot_of_assignment.reshape(k, tokens))
    ye = expert_fn(xe.reshape(num_experts, cap, -1)).reshape(num_experts * cap, -1)
    y_assign = take_rows(ye, s.slot_of_assignment, s.assignment_of_slot[None, :]).reshape(k, tokens, -1)
    y = jnp.einsum("kt,ktl->tl", weights.T.astype(jnp.float32), y_assign.astype(jnp.float32))
    dropped = jnp.sum(jnp.maximum(s.counts - cap, 0))
    return y.astype(x.dtype), dropped


def wave_dispatch(x, expert_idx, weights, expert_fn: Callable, num_experts: int, cap: int,
                  wave_axes=()):
    """Exact dropless dispatch in the training pass's memory: (y [T, ℓ], dropped = 0).

    Wave w sends, for every expert, the assignments at queue positions [w·C, (w+1)·C) through the
    same [E, C, ℓ] buffer and `expert_fn` (collectives included) as `sort_dispatch`; waves repeat
    until the longest queue is done: ceil(max load / C) of them, maxed over `wave_axes` so every
    device taking part in expert_fn's collectives runs the same number. Each assignment runs in
    exactly one wave, so the result is the dropless one (C = T) up to fp32 summation order, while
    memory stays one training-size buffer instead of E·T rows. Evaluation only: `lax.while_loop`
    has no reverse-mode derivative.
    """
    tokens, k = expert_idx.shape
    n = tokens * k
    q = expert_queues(expert_idx, num_experts)
    waves = (jnp.max(q.counts) + cap - 1) // cap
    if wave_axes:
        waves = jax.lax.pmax(waves, tuple(wave_axes))
    wts = weights.T.astype(jnp.float32)[:, :, None]                        # [k, T, 1]

    def wave(i, y):
        s = queue_slots(q, cap, i * cap)
        token_of_slot = jnp.where(s.assignment_of_slot < n, s.assignment_of_slot % tokens, tokens)
        ye = expert_fn(_take(x, token_of_slot).reshape(num_experts, cap, -1)).reshape(num_experts * cap, -1)
        # Assignments outside this wave read the zero row E·C: they add nothing. One [T, ℓ]
        # gather per choice, fused into the accumulation (no [T·k, ℓ] buffer).
        slot = s.slot_of_assignment.reshape(k, tokens)
        for j in range(k):
            y = y + wts[j] * _take(ye, slot[j]).astype(jnp.float32)
        return y

    y = jax.lax.fori_loop(jnp.int32(0), waves.astype(jnp.int32), wave, jnp.zeros_like(x, jnp.float32))
    return y.astype(x.dtype), jnp.int32(0)


# --- pooled transport: per-peer send and per-expert receive capacities, overflow in waves -------

def pooled_capacities(tokens: int, top_k: int, num_experts: int, peers: int,
                      send_factor: float, recv_factor: float) -> tuple[int, int]:
    """(S, R) of the pooled transport, multiples of 8: S rows per wave from each device to each
    peer (send_factor · T·k / peers, at most T·min(k, E/peers), all a device can owe one peer)
    and R rows per wave for each expert from all peers together (recv_factor · T·k / (E/peers),
    at most peers·S and peers·T)."""
    local = num_experts // peers
    send = max(1, min(8 * math.ceil(math.ceil(send_factor * tokens * top_k / peers) / 8), tokens * min(top_k, local)))
    recv = max(1, min(8 * math.ceil(math.ceil(recv_factor * tokens * top_k / local) / 8), peers * send, peers * tokens))
    return send, recv


def _identity(a):
    return a


def pooled_dispatch(x, expert_idx, weights, expert_fn: Callable, num_experts: int, peers: int,
                    send_cap: int, recv_cap: int, waves: int, exchange: Callable = _identity,
                    agree: Callable = _identity):
    """Near-dropless training transport with static shapes: (y [T, ℓ], dropped assignments []).

    The fixed transport gives every (device, expert) pair its own C rows, so one device's hot
    expert drops even when the expert has room for everyone's tokens. Here the capacities pool:
    each wave a device sends every peer up to S of its pending assignments for that peer's
    experts (whichever experts they are: `exchange` is one all_to_all of [peers, S, ·]), and each
    receiving expert accepts up to R of the rows that all peers sent it (position-major, so every
    sender's first rows go first); refused rows come back empty and unacknowledged. Assignments
    still pending are sent again in the next wave, up to `waves`; what is left then is dropped.
    Within a device, first choices queue before second ones. Waves after the first run under
    `lax.cond` only when some device (`agree`: a pmax over the exchange's axis) still has pending
    assignments, so a balanced step costs one wave. Every move is a row gather with a gather as
    transpose (`take_rows`) or an all_to_all: differentiable, and a static Python loop (not a
    while_loop) so reverse mode works. With peers = 1 and `exchange` the identity it is a local
    dispatch with capacity R per expert in up to `waves` waves.
    """
    tokens, k = expert_idx.shape
    n = tokens * k
    local = num_experts // peers
    slots, rows = peers * send_cap, local * recv_cap
    flat_expert = expert_idx.T.reshape(-1)                      # assignment a = j·T + t
    peer = flat_expert // local
    order = jnp.argsort(peer, stable=True).astype(jnp.int32)    # by peer, first choices first
    peer_sorted, local_sorted = peer[order], (flat_expert % local)[order]
    peer_counts = jnp.zeros((peers,), jnp.int32).at[peer].add(1)
    peer_start = (jnp.cumsum(peer_counts) - peer_counts)[peer_sorted]
    # The receiver ranks rows position-major (row i of every sender before row i + 1 of any).
    pm = np.arange(slots).reshape(peers, send_cap).T.reshape(-1)
    pm_inverse = np.argsort(pm)
    wts = weights.T.astype(jnp.float32)                          # [k, T]

    def wave(pending, y):
        p = pending[order].astype(jnp.int32)
        before = jnp.cumsum(p) - p
        rank = before - before[jnp.minimum(peer_start, n - 1)]  # among this peer's pending ones
        sent = (p == 1) & (rank < send_cap)
        slot_sorted = jnp.where(sent, peer_sorted * send_cap + rank, slots)
        slot_of_assignment = jnp.zeros((n,), jnp.int32).at[order].set(slot_sorted, unique_indices=True)
        assignment_of_slot = jnp.full((slots,), n, jnp.int32).at[slot_sorted].set(order, mode="drop")
        expert_of_slot = jnp.full((slots,), local, jnp.int32).at[slot_sorted].set(local_sorted, mode="drop")
        token_of_slot = jnp.where(assignment_of_slot < n, assignment_of_slot % tokens, tokens)
        xs = take_rows(x, token_of_slot, slot_of_assignment.reshape(k, tokens))
        recv = exchange(xs.reshape(peers, send_cap, -1)).reshape(slots, -1)
        recv_expert = exchange(expert_of_slot.reshape(peers, send_cap)).reshape(slots)
        # Receiver: each local expert takes its first R rows; the rest are refused.
        q = expert_queues(recv_expert[pm][:, None], local + 1)   # expert `local` = empty row
        accept = (q.sorted_expert < local) & (q.position < recv_cap)
        row_sorted = jnp.where(accept, q.sorted_expert * recv_cap + q.position, rows)
        row_of_pm = jnp.zeros((slots,), jnp.int32).at[q.order].set(row_sorted, unique_indices=True)
        row_of_recv = row_of_pm[pm_inverse]
        recv_of_row = jnp.full((rows,), slots, jnp.int32).at[row_sorted].set(
            jnp.asarray(pm, jnp.int32)[q.order], mode="drop")
        xe = take_rows(recv, recv_of_row, row_of_recv[None])
        ye = expert_fn(xe.reshape(local, recv_cap, -1)).reshape(rows, -1)
        out = take_rows(ye, row_of_recv, recv_of_row[None])     # refused rows: zeros
        back = exchange(out.reshape(peers, send_cap, -1)).reshape(slots, -1)
        acked = exchange((row_of_recv < rows).astype(jnp.int32).reshape(peers, send_cap)).reshape(slots)
        y_assign = take_rows(back, slot_of_assignment, assignment_of_slot[None]).reshape(k, tokens, -1)
        y = y + jnp.einsum("kt,ktl->tl", wts, y_assign.astype(jnp.float32))
        done = (slot_of_assignment < slots) & (acked[jnp.minimum(slot_of_assignment, slots - 1)] == 1)
        return pending & ~done, y

    pending, y = wave(jnp.ones((n,), bool), jnp.zeros(x.shape, jnp.float32))
    for _ in range(waves - 1):
        left = agree(jnp.sum(pending.astype(jnp.int32)))
        pending, y = jax.lax.cond(left > 0, wave, lambda p, y: (p, y), pending, y)
    return y.astype(x.dtype), jnp.sum(pending.astype(jnp.int32))


def dense_dispatch(x, expert_idx, weights, w: ExpertWeights):
    """Reference: every expert on every token, masked by the combine weights. Dropless."""
    tokens = x.shape[0]
    num_experts = w.gate.shape[0]
    ye = expert_swiglu(jnp.broadcast_to(x, (num_experts,) + x.shape), w)
    dense_w = jnp.zeros((tokens, num_experts), jnp.float32).at[jnp.arange(tokens)[:, None], expert_idx].add(weights)
    return jnp.einsum("te,etl->tl", dense_w, ye.astype(jnp.float32)).astype(x.dtype)


def ragged_dot_dispatch(x, expert_idx, weights, w: ExpertWeights):
    """Reference: sort by expert, grouped matmuls with `jax.lax.ragged_dot`. Dropless."""
    tokens, k = expert_idx.shape
    num_experts = w.gate.shape[0]
    flat_expert = expert_idx.T.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_expert].add(1)
    xs = x[order % tokens]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w.gate, group_sizes)) * jax.lax.ragged_dot(xs, w.up, group_sizes)
    ys = jax.lax.ragged_dot(h, w.down, group_sizes)
    y_assign = jnp.zeros_like(ys).at[order].set(ys).reshape(k, tokens, -1)
    y = jnp.einsum("kt,ktl->tl", weights.T.astype(jnp.float32), y_assign.astype(jnp.float32))
    return y.astype(x.dtype)


# --- the training transports on one device, registered under model.ep_transport -------------
# (under expert parallelism: `marin.model.expert_parallel.PARALLEL`, the same names)

transport = TRANSPORTS.register


@transport("fixed")
def fixed_local(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """Capacity C per expert; the rest drops."""
    return sort_dispatch(x, expert_idx, weights, partial(expert_swiglu, w=w), w.gate.shape[0], cap)


@transport("pooled")
def pooled_local(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """Capacity R per expert in up to `model.ep_waves` waves."""
    m, (tokens, k), num_experts = cfg.model, expert_idx.shape, w.gate.shape[0]
    send, recv = pooled_capacities(tokens, k, num_experts, 1, m.ep_send_capacity_factor, m.ep_recv_capacity_factor)
    return pooled_dispatch(x, expert_idx, weights, partial(expert_swiglu, w=w), num_experts, 1, send, recv, m.ep_waves)


@transport("ragged")
def ragged_local(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """Exact: grouped matmuls (`ragged_dot_dispatch`)."""
    return ragged_dot_dispatch(x, expert_idx, weights, w), jnp.int32(0)


def local_transport(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """The training pass on one device by `model.ep_transport`: (y, dropped)."""
    return TRANSPORTS.get(cfg.model.ep_transport)(x, expert_idx, weights, w, cfg, cap)


def routed_experts(x, logits, bias, w: ExpertWeights, cfg, *, train: bool,
                   axis_names=(), expert_fn: Callable | None = None, num_experts: int | None = None,
                   wave_axes=(), transport: Callable | None = None):
    """Route, dispatch, run the experts and combine, on this device's tokens.

    x [T, ℓ] (latent, normalised), logits [T, E] fp32, bias [E]. Returns (y [T, ℓ], stats) with
    stats = {beta [E], load [E], dropped_frac [], aux_loss []}, reduced over `axis_names`.
    Evaluation (train=False with model.eval_dropless) drops nothing: `model.eval_dispatch=waves`
    runs the training capacity C in as many waves as the longest expert queue needs
    (`wave_dispatch`), `unbounded` uses C = T in one pass. Under expert parallelism `expert_fn`
    replaces the local experts (and `num_experts` gives the global E, since `w` then holds only
    this device's experts), and `wave_axes` names the mesh axes its collectives span.
    The training pass (and evaluation with drops) moves tokens by `model.ep_transport`: under
    expert parallelism as `transport(x, expert_idx, weights) -> (y, dropped)` says, on one device
    by `local_transport`.
    """
    m = cfg.model
    tokens = x.shape[0]
    k = cfg.router.top_k
    num_experts = num_experts or w.gate.shape[0]
    expert_idx, weights, stats = routers.route(logits, bias, cfg, axis_names=axis_names)
    dropped = jnp.int32(0)
    if m.dispatch == "sort" or expert_fn is not None:
        cap = capacity(tokens, k, num_experts, m.capacity_factor)
        if train or not m.eval_dropless:   # the training transport
            transport = transport or partial(local_transport, w=w, cfg=cfg, cap=cap)
            y, dropped = transport(x, expert_idx, weights)
        elif m.eval_dispatch == "waves":
            expert_fn = expert_fn or partial(expert_swiglu, w=w)
            y, dropped = wave_dispatch(x, expert_idx, weights, expert_fn, num_experts, cap, wave_axes)
        else:   # "unbounded": C = T, an [E·T, ℓ] buffer (the reference for the waves)
            expert_fn = expert_fn or partial(expert_swiglu, w=w)
            y, dropped = sort_dispatch(x, expert_idx, weights, expert_fn, num_experts, tokens)
    elif m.dispatch == "ragged_dot":
        y = ragged_dot_dispatch(x, expert_idx, weights, w)
    elif m.dispatch == "dense":
        y = dense_dispatch(x, expert_idx, weights, w)
    else:
        raise ValueError(f"unknown model.dispatch {m.dispatch!r}")
    total = tokens * k
    if axis_names:
        dropped, total = jax.lax.psum(dropped, tuple(axis_names)), jax.lax.psum(jnp.int32(total), tuple(axis_names))
    stats["dropped_frac"] = dropped.astype(jnp.float32) / jnp.float32(total)
    return y, stats
