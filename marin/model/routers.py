"""Token → expert routing (`conf/router/`): QB, softmax with an auxiliary loss, and bias_update.

Each router is a class registered under its `router.kind` (`@router("qb")`); a new one is its
class here and its option file in conf/router/, nothing else.

`route(logits, bias, cfg)` picks k experts per token and their combine weights; the per-expert
bias comes from the router state, which lives in the train state as [L, E] and is advanced
once per step from the layer stats (`next_router_state`). The bias only re-ranks experts:
it never receives gradients, and combine weights always come from the unbiased logits.

Inside `shard_map` (expert parallelism) each device routes its own tokens; statistics that the
spec defines over the global batch (QB's quantile, the load, the aux loss) are reduced over
`axis_names`, the mesh axes the tokens are split over.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from marin.config.registry import ROUTERS

Axes = Sequence[str]


def _psum(x, axis_names: Axes):
    return jax.lax.psum(x, tuple(axis_names)) if axis_names else x


def combine_weights(chosen_logits, cfg):
    """Weights of the k chosen experts [T,k] from their unbiased logits (fp32).

    sigmoid: rescaled so each token's weights sum to `router.combine_sum` (spec QB step 3);
    softmax: the softmax probabilities of the chosen experts, renormalised over them.
    """
    if cfg.router.combine == "softmax":
        return jax.nn.softmax(chosen_logits, axis=-1)
    gates = jax.nn.sigmoid(chosen_logits)
    return gates * (cfg.router.combine_sum / jnp.sum(gates, axis=-1, keepdims=True))


def count_values(idx, length: int, dtype=jnp.int32):
    """How many entries of the integer array `idx` equal 0, 1, ..., length − 1 ([length]).

    A compare-and-sum, not `.at[idx].add(1)`: that scatter-add makes every entry an atomic add
    into `length` counters, which serialises on GPU (a step's T·k assignments onto E experts);
    the comparison is one fused reduction, length · idx.size compares."""
    values = jnp.arange(length, dtype=idx.dtype)
    return jnp.sum(idx.reshape(-1, 1) == values, axis=0, dtype=dtype)


def expert_load(expert_idx, num_experts: int, axis_names: Axes = (), valid=None):
    """Fraction of all assignments that go to each expert [E], before any capacity drop; only
    valid tokens' (`valid` [T], None: all) count."""
    if valid is not None:   # an id past the last expert counts nowhere
        expert_idx = jnp.where(valid[:, None], expert_idx, num_experts)
    counts = count_values(expert_idx, num_experts, jnp.float32)
    total = _psum(jnp.sum(counts), axis_names)
    return _psum(counts, axis_names) / jnp.maximum(total, 1.0)


def histogram_quantile(values, q: float, bins: int, axis_names: Axes = (), valid=None):
    """Per-column q-quantile of `values` [T,E] over the (global) batch, from a histogram.

    As the published run does it: one range, the global min/max of all values; `bins` equal
    bins; counts summed across devices; linear interpolation inside the bin where the
    cumulative count crosses q·N. Within one bin width of the smallest value with at least q·N
    values at or below it (numpy's `inverted_cdf`), so (1 − q)·N values lie above. Counts are int32 so that a global
    batch beyond 2^24 tokens still counts exactly. The histogram is never built: only its
    crossing bin and the counts up to it, by bisection (below), the same numbers exactly.
    Rows with `valid` [T] False (padding) are left out of the range and the counts.
    """
    values = jax.lax.stop_gradient(values.astype(jnp.float32))
    tokens, experts = values.shape
    if valid is None:
        lo, hi = jnp.min(values), jnp.max(values)
        n = _psum(jnp.int32(tokens), axis_names)
        inside = True
    else:
        inside = valid[:, None]
        lo, hi = jnp.min(jnp.where(inside, values, jnp.inf)), jnp.max(jnp.where(inside, values, -jnp.inf))
        n = _psum(jnp.sum(valid, dtype=jnp.int32), axis_names)
    if axis_names:
        lo, hi = jax.lax.pmin(lo, tuple(axis_names)), jax.lax.pmax(hi, tuple(axis_names))
    lo, hi = jnp.where(n > 0, lo, 0.0), jnp.where(n > 0, hi, 0.0)   # no valid token: a zero quantile
    width = jnp.maximum(hi - lo, 1e-12) / bins
    bin_idx = jnp.clip(jnp.floor((values - lo) / width), 0, bins - 1).astype(jnp.int32)
    target = q * n.astype(jnp.float32)                       # values below the quantile

    def cdf(b):
        """Values in bins ≤ b [E] (global), per column."""
        return _psum(jnp.sum((bin_idx <= b) & inside, axis=0, dtype=jnp.int32), axis_names)

    # The first bin whose cumulative count reaches the target, found by bisection over the bins:
    # ceil(log2 bins) compare-and-sum passes over [T, E] (and psums of [E]) instead of scattering
    # T·E ones into an [E, bins] histogram (a serialised scatter-add on GPU, and a psum of E·bins).
    # The cumulative count is monotone in b, so this is the histogram's argmax(cdf ≥ target).
    # Invariant: cdf(low) < target ≤ cdf(high); the interval halves each pass, ending at high = low + 1.
    low, high = jnp.full((experts,), -1, jnp.int32), jnp.full((experts,), bins - 1, jnp.int32)
    cdf_low, cdf_high = jnp.zeros((experts,), jnp.int32), jnp.broadcast_to(n, (experts,))
    for _ in range(math.ceil(math.log2(bins))):
        mid = (low + high + 1) // 2
        cdf_mid = cdf(mid)
        reached = cdf_mid.astype(jnp.float32) >= target
        low, cdf_low = jnp.where(reached, low, mid), jnp.where(reached, cdf_low, cdf_mid)
        high, cdf_high = jnp.where(reached, mid, high), jnp.where(reached, cdf_mid, cdf_high)
    crossing = high
    below = cdf_low.astype(jnp.float32)
    in_bin = (cdf_high - cdf_low).astype(jnp.float32)
    frac = jnp.clip((target - below) / jnp.maximum(in_bin, 1.0), 0.0, 1.0)
    return lo + width * (crossing.astype(jnp.float32) + frac)


# --- the routers: one class each, registered under its router.kind -----------------------------

router = ROUTERS.register   # `@router("name")` on a class: with conf/router/<option>.yaml, all a router needs


class Router:
    """A routing rule: which experts a token takes, and the [L, E] router state it keeps.

    `select` returns (expert_idx [T,k], beta [E]); the defaults select on the biased logits,
    add no loss and keep no state. `valid` [T] (None: all): the tokens whose statistics count
    (padding is no token for routing)."""

    def select(self, logits, biased, k: int, cfg, axis_names: Axes, valid=None):
        return jax.lax.top_k(biased, k)[1], jnp.zeros((logits.shape[-1],), jnp.float32)

    def aux_loss(self, logits, load, cfg, axis_names: Axes, valid=None):
        return jnp.float32(0.0)

    def bias(self, state, cfg):
        return jnp.zeros_like(state)

    def next_state(self, state, stats, cfg):
        return state


@router("qb")
class QuantileBalancing(Router):
    """QB: the bias is −β, the (1 − k/E) quantile of each expert's margin over the batch."""

    def select(self, logits, biased, k, cfg, axis_names, valid=None):
        top_vals, top_idx = jax.lax.top_k(biased, k + 1)
        threshold = top_vals[:, k]                           # α: the (k+1)-th biased value
        margins = logits - threshold[:, None]                # m = s − α
        beta = histogram_quantile(margins, 1.0 - k / logits.shape[-1], cfg.router.qb_bins, axis_names, valid)
        return top_idx[:, :k], beta

    def bias(self, state, cfg):
        # b = −β shifted to zero mean over the experts of each layer (a shift does not re-rank).
        return -(state - jnp.mean(state, axis=-1, keepdims=True))

    def next_state(self, state, stats, cfg):
        return jnp.asarray(stats["beta"], jnp.float32)       # replaces, never accumulates


@router("softmax_aux")
class SoftmaxAux(Router):
    """Top-k of the unbiased logits plus Switch Transformer's load-balancing loss."""

    def select(self, logits, biased, k, cfg, axis_names, valid=None):
        return super().select(logits, logits, k, cfg, axis_names)

    def aux_loss(self, logits, load, cfg, axis_names, valid=None):
        # E · Σ_e f_e · P_e, f = assignment fraction (no gradient), P = mean prob over valid tokens.
        probs = jax.nn.softmax(logits, axis=-1)
        weight = jnp.ones((logits.shape[0],), jnp.float32) if valid is None else valid.astype(jnp.float32)
        mean_prob = _psum(jnp.sum(probs * weight[:, None], axis=0), axis_names) / jnp.maximum(_psum(jnp.sum(weight), axis_names), 1.0)
        return cfg.router.aux_loss_weight * logits.shape[-1] * jnp.sum(jax.lax.stop_gradient(load) * mean_prob)


@router("bias_update")
class BiasUpdate(Router):
    """DeepSeek-V3: a per-expert bias nudged by sign(mean load − load) each step."""

    def bias(self, state, cfg):
        return state

    def next_state(self, state, stats, cfg):
        load = jnp.asarray(stats["load"], jnp.float32)
        nudged = state + cfg.router.bias_update_rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        return nudged - jnp.mean(nudged, axis=-1, keepdims=True)


@jax.named_scope("routing")   # a part of its own in profiles (benchmarks/gpu_profile.py)
def route(logits, bias, cfg, *, axis_names: Axes = (), valid=None):
    """Choose experts: (expert_idx int32 [T,k], weights f32 [T,k], stats).

    logits [T,E] fp32 (x·W_router), bias [E] from `router_bias`. stats = {beta [E] (QB's
    quantile estimate, zeros otherwise), load [E], aux_loss []}, over the tokens with `valid`
    [T] (None: all; padding is no token for routing, spec §9): so are the router state's updates.
    """
    rule, k = ROUTERS.get(cfg.router.kind), cfg.router.top_k
    logits = logits.astype(jnp.float32)
    biased = logits + jax.lax.stop_gradient(bias.astype(jnp.float32))
    expert_idx, beta = rule.select(logits, biased, k, cfg, axis_names, valid=valid)
    weights = combine_weights(jnp.take_along_axis(logits, expert_idx, axis=1), cfg)
    load = expert_load(expert_idx, logits.shape[-1], axis_names, valid)
    aux_loss = rule.aux_loss(logits, load, cfg, axis_names, valid=valid)
    return expert_idx.astype(jnp.int32), weights, {"beta": beta, "load": load, "aux_loss": aux_loss}


# --- router state: [L, E] in the train state, advanced once per step ---------------------------

def init_router_state(cfg):
    """Zeros [L, E]: QB's pending betas, or bias_update's bias."""
    return jnp.zeros((cfg.model.num_layers, cfg.model.num_experts), jnp.float32)


def router_bias(state, cfg):
    """The bias [L, E] the layers add to their logits this step."""
    return ROUTERS.get(cfg.router.kind).bias(state, cfg)


def next_router_state(state, stats, cfg):
    """The state for the next step from this step's per-layer stats (beta/load [L, E])."""
    return ROUTERS.get(cfg.router.kind).next_state(state, stats, cfg)
