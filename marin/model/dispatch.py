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
`expert_parallel.py` across devices): `fixed` is `sort_dispatch`; `pooled` (`pooled_dispatch`)
is the published run's fixed pooled-wave all-to-all (spec §9): per destination a pool of S rows
per wave shared by its local experts, filled by token-major rank and striped over `model.ep_waves`
static waves (rank % waves), so every wave carries every local expert; receive buffers of R rows
per (expert, wave) with round-robin slots; drops counted per stage (send, recv). (A variant that re-sent overflow in up to
`ep_waves` full-capacity waves was measured dropless but 1.95–2.15× the layer time of `fixed` on
8 host devices, benchmarks/moe_layer.py --ep-devices 8 --experts 24 --top-k 4, and removed.) On one
device `pooled` runs in one pass (`pooled_one_device`): the same drops, fixed's data movement.

Counts per expert are compare-and-sums and inverse permutations are unique-index writes: no
scatter-add (atomics that serialise on GPU) forward or backward; `marin/model/census.py` and
tests/model/test_census.py keep count.

`ragged_dot` (sort + `jax.lax.ragged_dot`) and `dense` (every expert on every token, masked) are
dropless references for tests; on CPU both cost about E× the useful FLOPs.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from marin.config import derive
from marin.config.registry import TRANSPORTS
from marin.model import routers
from marin.model.kernels.grouped_matmul import grouped_matmul


class ExpertWeights(NamedTuple):
    """The routed experts, SwiGLUs inside the latent: gate/up [E, ℓ, I], down [E, I, ℓ]."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array


@jax.named_scope("expert_gemm")   # a part of its own in profiles (benchmarks/gpu_profile.py)
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
    # One [len(src), ·] gather per reader, accumulated: never an [r, len(src), ·] buffer.
    out = _take(g, inverse[0])
    for r in range(1, inverse.shape[0]):
        out = out + _take(g, inverse[r])
    return out, None, None


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


def expert_queues(expert_idx, num_experts: int, rank=None) -> Queues:
    """Stable sort of the assignments by expert; position within the expert = rank in the sort.

    One sort carries the ids along (an argsort would gather the sorted experts back), and the
    counts are a compare-and-sum (`routers.count_values`), not a scatter-add of T·k ones onto E
    counters (atomics that serialise on GPU). An expert id ≥ num_experts (a padding
    token's assignment, `mask_invalid`) is in no queue: it sorts last, counts nowhere and takes no
    slot. `rank` [T, k] (optional): the order within each queue, instead of assignment order."""
    n = expert_idx.size
    flat_expert = expert_idx.T.reshape(-1).astype(jnp.int32)
    ids = jnp.arange(n, dtype=jnp.int32)
    if rank is None:
        sorted_expert, order = jax.lax.sort((flat_expert, ids), num_keys=1, is_stable=True)
    else:
        sorted_expert, _, order = jax.lax.sort((flat_expert, rank.T.reshape(-1).astype(jnp.int32), ids), num_keys=2)
    counts = routers.count_values(flat_expert, num_experts)
    starts = jnp.cumsum(counts) - counts
    # One more start for the ids past the last expert (padding), so their positions stay in range.
    position = ids - jnp.append(starts, jnp.sum(counts))[jnp.minimum(sorted_expert, num_experts)]
    return Queues(order, sorted_expert, position, starts, counts)


def mask_invalid(expert_idx, valid, num_experts: int):
    """expert_idx [T, k] with every choice of a token that is not valid (`valid` [T] False:
    padding) replaced by num_experts, the id of no expert: it takes no slot, no capacity, no
    wave and counts in no drop (`expert_queues`). valid None: every token is valid."""
    if valid is None:
        return expert_idx
    return jnp.where(valid[:, None], expert_idx, num_experts).astype(expert_idx.dtype)


def queue_slots(q: Queues, cap: int, first=0, limit=None) -> Slots:
    """Buffer rows for the queue positions [first, first + cap) of every expert (a "wave");
    assignments outside that window get the out-of-range slot E·C (dropped, or left to another
    wave). `first` may be traced. `limit` [E]: only the first limit[e] of expert e's queue may
    take a row (the rest were dropped before, e.g. at a sender's pool); default all."""
    n, num_experts = q.order.shape[0], q.counts.shape[0]
    pos = q.position - first
    inside = (pos >= 0) & (pos < cap) & (q.sorted_expert < num_experts)
    queued = q.counts
    if limit is not None:
        inside &= q.position < limit[q.sorted_expert]
        queued = jnp.minimum(queued, limit)
    slot_sorted = jnp.where(inside, q.sorted_expert * cap + pos, num_experts * cap)
    # The inverse permutation of the sort, written once with unique indices (no atomics: every
    # row is written by one thread); another sort would cost more.
    slot_of_assignment = jnp.zeros((n,), jnp.int32).at[q.order].set(slot_sorted, unique_indices=True)
    # Row c of expert e holds the (starts[e] + first + c)-th assignment of the sort, if it has that many.
    queue_pos = first + jnp.arange(cap, dtype=jnp.int32)[None, :]
    rank = q.starts[:, None] + queue_pos
    filled = queue_pos < queued[:, None]
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
    s = assign_slots(expert_idx, num_experts, cap)
    y = slot_dispatch(x, s, weights, expert_fn, num_experts, cap)
    return y, jnp.sum(jnp.maximum(s.counts - cap, 0))


def slot_dispatch(x, s: Slots, weights, expert_fn: Callable, num_experts: int, cap: int):
    """Move the assignments to their slots of the [E, C, ℓ] buffer, run `expert_fn` on it, and
    combine each token's k outputs with its weights: y [T, ℓ] (dropped assignments add zero)."""
    tokens, k = weights.shape
    token_of_slot = jnp.where(s.assignment_of_slot < tokens * k, s.assignment_of_slot % tokens, tokens)
    xe = take_rows(x, token_of_slot, s.slot_of_assignment.reshape(k, tokens))
    ye = expert_fn(xe.reshape(num_experts, cap, -1)).reshape(num_experts * cap, -1)
    y_assign = take_rows(ye, s.slot_of_assignment, s.assignment_of_slot[None, :]).reshape(k, tokens, -1)
    y = jnp.einsum("kt,ktl->tl", weights.T.astype(jnp.float32), y_assign.astype(jnp.float32))
    return y.astype(x.dtype)


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


# --- pooled transport (published): one sender pool per destination, striped by rank over waves -----

pooled_capacities = derive.pooled_capacities   # (S, R): the sizes, pure Python (planning reads them)


def _identity(a):
    return a


def _token_major_rank(expert_idx, num_experts: int):
    """[T, k] rank of each valid assignment among the sender's valid ones in token-major order
    (t·k + j), padding (`mask_invalid`) skipped: a running count of valid tokens, no sort."""
    tokens, k = expert_idx.shape
    valid = expert_idx[:, 0] < num_experts
    before = jnp.cumsum(valid.astype(jnp.int32)) - valid.astype(jnp.int32)    # valid tokens before t
    return before[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None, :]


def _receiver_ranks(r_expert, peers: int, send_cap: int, local: int):
    """Rank of each received row [peers·S] (sender-major) within its local expert, counted in pool
    position order: every sender's row p before any sender's row p + 1 (round-robin over the
    senders, so an overflow does not always cut the same sender). A running count per expert
    ([peers·S, local] compares), no sort."""
    by_position = r_expert.reshape(peers, send_cap).T.reshape(-1)
    hit = by_position[:, None] == jnp.arange(local, dtype=r_expert.dtype)
    rank = jnp.sum(jnp.where(hit, jnp.cumsum(hit, axis=0, dtype=jnp.int32), 0), axis=1) - 1
    return rank.reshape(send_cap, peers).T.reshape(-1)


class Pool(NamedTuple):
    """A sender's pooled-wave plan, per assignment a = j·T + t (`sender_pool`)."""
    queues: Queues            # each destination's queue, in token-major order
    peer: jax.Array           # [T·k] destination device (peers: padding, no destination)
    wave: jax.Array           # [T·k] rank in the destination's queue % waves
    row: jax.Array            # [T·k] rank // waves: the row of the destination's pool in that wave
    sent: jax.Array           # [T·k] kept at the sender: row < S
    send_dropped: jax.Array   # [] what the pools could not hold


def sender_pool(expert_idx, num_experts: int, local: int, peers: int, waves: int, send_cap: int) -> Pool:
    """Rank each destination's assignments in token-major order (t·k + j; padding skipped); rank r
    rides in wave r % waves at pool row r // waves, kept while that row < S (spec §9)."""
    tokens, k = expert_idx.shape
    n = tokens * k
    dest = jnp.minimum(expert_idx // local, peers)                   # [T, k]; padding: peers
    q = expert_queues(dest, peers, rank=_token_major_rank(expert_idx, num_experts))
    rank = jnp.zeros((n,), jnp.int32).at[q.order].set(q.position, unique_indices=True)
    peer = dest.T.reshape(-1).astype(jnp.int32)
    sent = (peer < peers) & (rank // waves < send_cap)
    dropped = jnp.sum(jnp.maximum(q.counts - waves * send_cap, 0))
    return Pool(q, peer, rank % waves, rank // waves, sent, dropped)


def wave_rows(pool: Pool, expert_idx, local: int, waves: int, send_cap: int, i):
    """Wave i's send buffer [peers·S]: (the assignment in each row, n where empty; its local expert,
    `local` where empty: the header that rides with the rows). Row p of destination d holds d's
    queue entry p·waves + i, if d's queue has one."""
    q = pool.queues
    n, peers = q.order.shape[0], q.counts.shape[0]
    queue_pos = jnp.arange(send_cap, dtype=jnp.int32)[None, :] * waves + i       # [peers, S]
    filled = (queue_pos < q.counts[:, None]).reshape(-1)
    assignment = jnp.where(filled, q.order[jnp.minimum(q.starts[:, None] + queue_pos, n - 1)].reshape(-1), n)
    flat_expert = expert_idx.T.reshape(-1).astype(jnp.int32)
    header = jnp.where(filled, flat_expert[jnp.minimum(assignment, n - 1)] % local, local)
    return assignment, header


def receiver_refused(r_expert, peers: int, send_cap: int, local: int, recv_cap: int):
    """(row of each received row in the [local · R] expert buffer, rows·local where refused;
    how many arrived rows were refused). `r_expert` [peers·S] sender-major, `local` = empty."""
    rank = _receiver_ranks(r_expert, peers, send_cap, local)
    arrived = r_expert < local
    accept = arrived & (rank < recv_cap)
    return jnp.where(accept, r_expert * recv_cap + rank, local * recv_cap), jnp.sum((arrived & ~accept).astype(jnp.int32))


def pooled_dispatch(x, expert_idx, weights, w: ExpertWeights, num_experts: int, peers: int,
                    send_cap: int, recv_cap: int, waves: int, exchange: Callable = _identity,
                    remat_waves: bool = True):
    """The published fixed pooled-wave transport: (y [T, ℓ], {"send": dropped, "recv": dropped}).

    The sender ranks each destination's assignments in token-major order (t·k + j); rank r goes
    in wave r % waves, at row r // waves of that destination's pool of S rows, so every wave
    carries every local expert and what the pool cannot hold ("send" drops: r // waves ≥ S) is
    the shard's later tokens, whatever their choice rank. Local expert ids ride with the rows
    (`exchange`: one all_to_all of [peers, S, ·] per wave). Each receiving (expert, wave) has R
    rows, allocated round-robin across senders (`_receiver_ranks`), so an overflow ("recv") drops
    evenly from all senders. Refused rows come back as zeros. Expert ids ≥ num_experts (padding,
    `mask_invalid`) take no rank, row or drop. All shapes are static; each wave is
    rematerialised: `remat_waves` wraps it in `jax.checkpoint` (for blocks that are not recomputed
    whole); inside a block under `model.remat=full` the block's recomputation already
    rematerialises every wave, and a nested checkpoint only raised the compiled peak (ladder_d768
    on XLA:CPU: 16.74 GiB with it, 15.05 without; fixed 15.64). `w` holds this device's local
    experts. With peers = 1 and `exchange` the identity it is a local dispatch.
    """
    tokens, k = expert_idx.shape
    n = tokens * k
    local = w.gate.shape[0]
    slots, rows = peers * send_cap, local * recv_cap
    pool = sender_pool(expert_idx, num_experts, local, peers, waves, send_cap)
    peer, wave_of = pool.peer, pool.wave
    slot_of = peer * send_cap + pool.row
    wts = weights.T.astype(jnp.float32)                           # [k, T]

    def wave(x, gate, up, down, i):
        """One wave: (its contribution to y [T, ℓ] fp32, rows refused by the receivers)."""
        slot_of_assignment = jnp.where(pool.sent & (wave_of == i), slot_of, slots)
        assignment_of_slot, header = wave_rows(pool, expert_idx, local, waves, send_cap, i)
        filled = assignment_of_slot < n
        token_of_slot = jnp.where(filled, assignment_of_slot % tokens, tokens)
        xs = take_rows(x, token_of_slot, slot_of_assignment.reshape(k, tokens))
        recv = exchange(xs.reshape(peers, send_cap, -1)).reshape(slots, -1)
        r_expert = exchange(header.reshape(peers, send_cap)).reshape(slots)
        row_of_recv, refused = receiver_refused(r_expert, peers, send_cap, local, recv_cap)
        recv_of_row = jnp.full((rows,), slots, jnp.int32).at[row_of_recv].set(
            jnp.arange(slots, dtype=jnp.int32), mode="drop")
        xe = take_rows(recv, recv_of_row, row_of_recv[None])
        ye = expert_swiglu(xe.reshape(local, recv_cap, -1), ExpertWeights(gate, up, down)).reshape(rows, -1)
        out = take_rows(ye, row_of_recv, recv_of_row[None])         # refused rows: zeros
        back = exchange(out.reshape(peers, send_cap, -1)).reshape(slots, -1)
        # Combine one choice at a time: [T, ℓ] gathers, never a [T·k, ℓ] buffer per wave.
        slot = slot_of_assignment.reshape(k, tokens)
        choice = assignment_of_slot // tokens
        y = jnp.zeros(x.shape, jnp.float32)
        for j in range(k):
            reader = jnp.where(filled & (choice == j), assignment_of_slot % tokens, tokens)
            y = y + wts[j][:, None] * take_rows(back, slot[j], reader[None]).astype(jnp.float32)
        return y, refused

    y = jnp.zeros(x.shape, jnp.float32)
    recv_dropped = jnp.int32(0)
    for i in range(waves):
        fn = jax.checkpoint(partial(wave, i=i)) if remat_waves else partial(wave, i=i)
        dy, refused = fn(x, w.gate, w.up, w.down)
        y, recv_dropped = y + dy, recv_dropped + refused
    return y.astype(x.dtype), {"send": pool.send_dropped, "recv": recv_dropped}


def pooled_one_device(x, expert_idx, weights, w: ExpertWeights, send_cap: int, recv_cap: int, waves: int):
    """`pooled_dispatch` with one peer, in one pass: the same result and the same drops per stage.

    With one peer the exchange is the identity and the waves only add bookkeeping (per wave: a
    pool, a receive buffer, an exchange). What is left is two drop rules and one fixed-capacity
    buffer. The device is the only destination, so an assignment's rank there is its token-major
    index r (among valid tokens): it is in wave r % waves and kept at the sender while
    r < waves · S, a prefix of every (expert, wave) queue ordered by r; the receiver keeps the
    first R of each such queue. So: queues over (expert, wave) groups ordered by r (one sort),
    `queue_slots` with cap R and the sender's prefix as limit, and the [E, waves·R, ℓ] buffer of
    `sort_dispatch`. The published transport stays as it is (not `fixed`: its sender pool drops
    what fixed would keep, so results would change)."""
    num_experts = w.gate.shape[0]
    rank = _token_major_rank(expert_idx, num_experts)                # [T, k]
    groups = num_experts * waves
    group = jnp.where(expert_idx < num_experts, expert_idx * waves + rank % waves, groups)
    sent = (group < groups) & (rank < waves * send_cap)
    kept = routers.count_values(jnp.where(sent, group, groups), groups)
    q = expert_queues(group, groups, rank=rank)
    s = queue_slots(q, recv_cap, limit=kept)
    y = slot_dispatch(x, s, weights, partial(expert_swiglu, w=w), num_experts, waves * recv_cap)
    send_dropped = jnp.sum(q.counts) - jnp.sum(kept)
    return y, {"send": send_dropped, "recv": jnp.sum(jnp.maximum(kept - recv_cap, 0))}


def dense_dispatch(x, expert_idx, weights, w: ExpertWeights):
    """Reference: every expert on every token, masked by the combine weights. Dropless."""
    tokens = x.shape[0]
    num_experts = w.gate.shape[0]
    ye = expert_swiglu(jnp.broadcast_to(x, (num_experts,) + x.shape), w)
    dense_w = jnp.zeros((tokens, num_experts), jnp.float32).at[jnp.arange(tokens)[:, None], expert_idx].add(
        weights, mode="drop")   # an id past the last expert (padding, `mask_invalid`) adds nothing
    return jnp.einsum("te,etl->tl", dense_w, ye.astype(jnp.float32)).astype(x.dtype)


def ragged_dot_dispatch(x, expert_idx, weights, w: ExpertWeights, impl: str = "xla"):
    """Sort by expert, grouped matmuls (`kernels.grouped_matmul`: `impl` mosaic, JAX's Hopper
    kernel, or xla, `jax.lax.ragged_dot`; `model.grouped_matmul`). Dropless.

    The rows move by gathers whose transposes are gathers (`take_rows`), the group sizes are the
    queues' counts: no scatter-add forward or backward. On GPU see marin/model/grouped.py."""
    tokens, k = expert_idx.shape
    n = tokens * k
    q = expert_queues(expert_idx, w.gate.shape[0])
    sorted_pos = jnp.zeros((n,), jnp.int32).at[q.order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    xs = take_rows(x, q.order % tokens, sorted_pos.reshape(k, tokens))            # [T·k, ℓ] by expert
    matmul = partial(grouped_matmul, group_sizes=q.counts, impl=impl)
    h = jax.nn.silu(matmul(xs, w.gate)) * matmul(xs, w.up)
    ys = matmul(h, w.down)
    # Rows past the groups (padding's, sorted last) are read by no one: a kernel may leave them unset.
    grouped = jnp.sum(q.counts)
    in_group = jnp.arange(n, dtype=jnp.int32) < grouped
    read = jnp.where(sorted_pos < grouped, sorted_pos, n)
    y_assign = take_rows(ys, read, jnp.where(in_group, q.order, n)[None]).reshape(k, tokens, -1)
    y = jnp.einsum("kt,ktl->tl", weights.T.astype(jnp.float32), y_assign.astype(jnp.float32))
    return y.astype(x.dtype)


# --- the training transports on one device, registered under model.ep_transport -------------
# (under expert parallelism: `marin.model.expert_parallel.PARALLEL`, the same names)

transport = TRANSPORTS.register


@transport("fixed")
def fixed_local(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """Capacity C per expert; the rest drops (at the sender)."""
    return sort_dispatch(x, expert_idx, weights, partial(expert_swiglu, w=w), w.gate.shape[0], cap)


@transport("pooled")
def pooled_local(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """The published pooled-wave transport with one peer: its sender pool and receive buffers,
    in one pass (`pooled_one_device`)."""
    m, (tokens, k), num_experts = cfg.model, expert_idx.shape, w.gate.shape[0]
    send, recv = pooled_capacities(tokens, k, num_experts, 1, m.ep_waves, m.ep_send_capacity_factor,
                                   m.ep_recv_capacity_factor)
    return pooled_one_device(x, expert_idx, weights, w, send, recv, m.ep_waves)


@transport("ragged")
def ragged_local(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """Exact: grouped matmuls (`ragged_dot_dispatch`)."""
    y = ragged_dot_dispatch(x, expert_idx, weights, w, derive.grouped_matmul_impl(cfg))
    return y, {"send": jnp.int32(0), "recv": jnp.int32(0)}


def local_transport(x, expert_idx, weights, w: ExpertWeights, cfg, cap: int):
    """The training pass on one device by `model.ep_transport`: (y, dropped)."""
    return TRANSPORTS.get(cfg.model.ep_transport)(x, expert_idx, weights, w, cfg, cap)


def routed_experts(x, logits, bias, w: ExpertWeights, cfg, *, train: bool,
                   axis_names=(), expert_fn: Callable | None = None, num_experts: int | None = None,
                   wave_axes=(), transport: Callable | None = None, valid=None):
    """Route, dispatch, run the experts and combine, on this device's tokens.

    x [T, ℓ] (latent, normalised), logits [T, E] fp32, bias [E]. Returns (y [T, ℓ], stats) with
    stats = {beta [E], load [E], dropped_frac [], dropped_frac/send [], dropped_frac/recv [],
    aux_loss []}, reduced over `axis_names` (dropped assignments over all, by the transport's
    stage: the sender's buffer, the receiver's).
    Evaluation (train=False with model.eval_dropless) drops nothing: `model.eval_dispatch=waves`
    runs the training capacity C in as many waves as the longest expert queue needs
    (`wave_dispatch`), `unbounded` uses C = T in one pass. Under expert parallelism `expert_fn`
    replaces the local experts (and `num_experts` gives the global E, since `w` then holds only
    this device's experts), and `wave_axes` names the mesh axes its collectives span.
    The training pass (and evaluation with drops) moves tokens by `model.ep_transport`: under
    expert parallelism as `transport(x, expert_idx, weights) -> (y, dropped)` says, on one device
    by `local_transport`.
    `valid` [T] (None: all): tokens that are not valid (padding, `segment_ids == 0`) are no tokens
    for routing (spec §9): they take no slot, capacity, wave or drop in any dispatch, enter no
    router statistic, and get zero expert output; the dropped fractions are of the valid
    tokens' assignments.
    """
    m = cfg.model
    tokens = x.shape[0]
    k = cfg.router.top_k
    num_experts = num_experts or w.gate.shape[0]
    expert_idx, weights, stats = routers.route(logits, bias, cfg, axis_names=axis_names, valid=valid)
    if valid is not None:
        expert_idx = mask_invalid(expert_idx, valid, num_experts)
        weights = jnp.where(valid[:, None], weights, 0.0)
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
        y = ragged_dot_dispatch(x, expert_idx, weights, w, derive.grouped_matmul_impl(cfg))
    elif m.dispatch == "dense":
        y = dense_dispatch(x, expert_idx, weights, w)
    else:
        raise ValueError(f"unknown model.dispatch {m.dispatch!r}")
    # Drops by stage: a transport returns {"send", "recv"} counts; a bare count is the sender's.
    drops = dropped if isinstance(dropped, dict) else {"send": dropped, "recv": jnp.int32(0)}
    drops = {stage: jnp.asarray(v, jnp.int32) for stage, v in drops.items()}
    total = jnp.int32(tokens * k) if valid is None else jnp.sum(valid, dtype=jnp.int32) * k
    if axis_names:
        drops, total = jax.lax.psum((drops, total), tuple(axis_names))
    total = jnp.maximum(total, 1)
    stats["dropped_frac/send"] = drops["send"].astype(jnp.float32) / total.astype(jnp.float32)
    stats["dropped_frac/recv"] = drops["recv"].astype(jnp.float32) / total.astype(jnp.float32)
    stats["dropped_frac"] = (drops["send"] + drops["recv"]).astype(jnp.float32) / total.astype(jnp.float32)
    return y, stats
