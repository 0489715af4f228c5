"""MuonH and AdamH (spec §3) as optax GradientTransformations.

MuonH = Nesterov momentum → Newton–Schulz orthogonalisation → hyperball step;
AdamH = Adam direction → hyperball step. Every matrix is the last two dims of its array;
leading dims (stacked layers L, experts E) are independent matrices.

Why not `optax.contrib.scale_by_muon`: it handles leading dims by transposing and reshaping
them into one flat batch (L·E) before a vmap. With experts sharded over the `expert` mesh axis
that merge is not expressible as a block sharding, so every step would reshard every expert
matrix; its orthogonaliser is also not public API. Batched matmuls on [..., m, n] keep the
leading axes — and their sharding — as they are. Momentum is optax's own `trace`.

MuonH runs fused, one layer at a time (`per_layer`, a loop over the stacked-layer axis L of
[L, m, n] and [L, E, m, n] leaves): momentum, Newton–Schulz and the hyperball step of one
layer's matrices, then the next. What the update holds at once is one layer's matrices and their
temporaries, not the whole stack; the arithmetic per matrix is that of the optax chain
trace(nesterov) → orthogonalise → hyperball, and the state has that chain's structure. Leaves in
pinned host memory (`optim.offload`: the momentum, and the routed experts' fp32 masters with
their gradients) are read one layer's slice at a time onto the device and written back the same
way, so no whole host leaf is ever staged on the device. For the 535B hero this is what keeps
the train step on a GB200 (README "What a CPU compile tells").
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from marin.model.memory import fetch, on_host, store  # noqa: F401 (on_host: marin.optim.decay, marin.train.step)
from marin.optim.newton_schulz import SIMPLE as NS_COEFFS  # noqa: F401 (the "simple" triple)
from marin.optim.newton_schulz import coefficients as ns_schedule


def matrix_norm(x: jax.Array) -> jax.Array:
    """Frobenius norm of each matrix (last two dims), kept broadcastable against `x`."""
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def per_layer(fn, *arrays: jax.Array, n_out: int = 1):
    """`fn(*arrays)` one slice of the leading (stacked-layer) axis at a time when the arrays have
    more than two dims; `fn` treats leading dims as independent matrices and returns `n_out`
    results (one array, or a tuple when n_out > 1) shaped like one slice of `arrays[:n_out]`.

    Result k is written into the buffer of `arrays[k]`, slice by slice (a loop carry, updated in
    place): a `lax.map` would stack results in fresh zero-filled arrays, which XLA allocates
    early, one more whole leaf per map. Slices of host arrays are fetched to the device and the
    results stored back (`fetch`, `store`). The stacked axis is never split over the mesh
    (marin.train.state), so each slice is local; the expert axis (sharded) stays batched."""
    first = arrays[0]
    pack = (lambda r: r) if n_out > 1 else (lambda r: (r,))
    if first.ndim <= 2:
        out = tuple(store(a, r.astype(a.dtype)) for a, r in zip(arrays, pack(fn(*map(fetch, arrays)))))
        return out if n_out > 1 else out[0]

    def body(i, bufs):
        take = lambda a: fetch(jax.lax.dynamic_index_in_dim(a, i, keepdims=False))
        results = pack(fn(*map(take, bufs + arrays[n_out:])))  # slice i of each buffer is still the input's
        return tuple(jax.lax.dynamic_update_index_in_dim(b, store(b, r.astype(b.dtype)), i, 0)
                     for b, r in zip(bufs, results))

    out = jax.lax.fori_loop(0, first.shape[0], body, tuple(arrays[:n_out]))
    return out if n_out > 1 else out[0]


def orthogonalize(x: jax.Array, ns_steps: int = 5, eps: float = 1e-7, dtype=jnp.float32,
                  coefficients="simple") -> jax.Array:
    """Quintic Newton–Schulz on each matrix in the last two dims; returns `dtype`.

    `coefficients`: the (a, b, c) of each iteration, X ← aX + b(XXᵀ)X + c(XXᵀ)²X, as
    `optim.ns_coefficients` names them (simple | quintic | a list of ns_steps triples;
    marin.optim.newton_schulz). Normalising by the Frobenius norm (in fp32) puts every singular
    value in (0, 1]; the simple triple then pushes them to ≈[0.7, 1.1] (tuned for speed, not
    exact convergence), the quintic schedule nearer 1. The iteration runs
    in `dtype` (the published run: bfloat16 with eps 1e-8, modded-nanogpt's pattern; its
    matmuls take half the bytes) on the wide orientation, so X·Xᵀ is the smaller Gram matrix.
    """
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -2, -1)
    x = (x / (matrix_norm(x) + eps)).astype(dtype)
    for a, b, c in ns_schedule(coefficients, ns_steps):
        gram = x @ jnp.swapaxes(x, -2, -1)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return jnp.swapaxes(x, -2, -1) if tall else x


def scale_by_newton_schulz(ns_steps: int, dtype=jnp.float32, eps: float = 1e-7,
                           coefficients="simple") -> optax.GradientTransformation:
    def update_fn(updates, state, params=None):
        del params
        ortho = lambda u: orthogonalize(u, ns_steps, eps, dtype, coefficients).astype(u.dtype)
        return jax.tree.map(lambda u: per_layer(ortho, u), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


class HyperballState(NamedTuple):
    count: jax.Array  # updates applied so far: the schedule's step


def hyperball_step(u: jax.Array, w: jax.Array, lr) -> jax.Array:
    """The hyperball update of matrices `w` along direction `u` (see `hyperball`)."""
    if w.ndim < 2:
        raise ValueError(f"hyperball acts on matrices; got a parameter of shape {w.shape}")
    tiny = jnp.finfo(jnp.float32).tiny
    w32, u32 = w.astype(jnp.float32), u.astype(jnp.float32)
    norm = matrix_norm(w32)
    moved = w32 - lr * norm * u32 / jnp.maximum(matrix_norm(u32), tiny)
    new_w = moved * (norm / jnp.maximum(matrix_norm(moved), tiny))
    return (new_w - w32).astype(w.dtype)


def hyperball(learning_rate) -> optax.GradientTransformation:
    """Move each matrix W by lr·‖W‖ against the direction u, then rescale to the original ‖W‖.

        W' = W − lr·‖W‖·u/‖u‖;   W_new = W'·‖W‖/‖W'‖;   update = W_new − W

    `u` is a descent direction in optax's convention (gradient-like: the step goes against it),
    so `optax.apply_updates` lands on W_new. Norms stay at their initial values, which is why
    this group has no weight decay. `learning_rate` is a float or an optax schedule.
    """
    def init_fn(params):
        del params
        return HyperballState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("hyperball needs the parameters: call update(updates, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        step = lambda u, w: hyperball_step(u, w, lr)
        new_updates = jax.tree.map(lambda u, w: per_layer(step, u, w), updates, params)
        return new_updates, HyperballState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def muonh(learning_rate, momentum: float = 0.95, ns_steps: int = 5, ns_dtype=jnp.float32,
          ns_eps: float = 1e-7, ns_coefficients="simple") -> optax.GradientTransformation:
    """Nesterov momentum → Newton–Schulz → hyperball, fused per layer (module docstring).

    The same arithmetic and state as `optax.chain(optax.trace(momentum, nesterov=True,
    accumulator_dtype=float32), scale_by_newton_schulz(...), hyperball(learning_rate))`.
    Nesterov in optax's sum form (g + β·m); it differs from the EMA form only by the factor
    (1 − β), which orthogonalisation and the hyperball normalisation both remove. The momentum
    stays fp32 whatever ns_dtype is. The update is written into the gradient's buffer and the new
    momentum into the old one's, one layer at a time."""
    chain = optax.chain(optax.trace(decay=momentum, nesterov=True, accumulator_dtype=jnp.float32),
                        scale_by_newton_schulz(ns_steps, ns_dtype, ns_eps, ns_coefficients), hyperball(learning_rate))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("muonh needs the parameters: call update(updates, state, params)")
        trace_state, ns_state, ball = state
        lr = learning_rate(ball.count) if callable(learning_rate) else learning_rate

        def layer(g, m, w):  # one layer's matrices, on the device
            m_new = g + momentum * m.astype(g.dtype)                  # optax.trace
            u = g + momentum * m_new                                  # its Nesterov update
            u = orthogonalize(u, ns_steps, ns_eps, ns_dtype, ns_coefficients).astype(u.dtype)
            return hyperball_step(u, w, lr), m_new

        pairs = jax.tree.map(lambda g, m, w: per_layer(layer, g, m, w, n_out=2),
                             updates, trace_state.trace, params)
        new_updates = jax.tree.map(lambda _, p: p[0], updates, pairs)
        new_trace = jax.tree.map(lambda _, p: p[1], updates, pairs)
        return new_updates, (trace_state._replace(trace=new_trace), ns_state,
                             HyperballState(count=optax.safe_increment(ball.count)))

    return optax.GradientTransformation(chain.init, update_fn)


def adamh(learning_rate, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), hyperball(learning_rate))
