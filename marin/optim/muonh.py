"""MuonH and AdamH (spec §3) as optax GradientTransformations.

MuonH = Nesterov momentum → Newton–Schulz orthogonalisation → hyperball step;
AdamH = Adam direction → hyperball step. Every matrix is the last two dims of its array;
leading dims (stacked layers L, experts E) are independent matrices.

Why not `optax.contrib.scale_by_muon`: it handles leading dims by transposing and reshaping
them into one flat batch (L·E) before a vmap. With experts sharded over the `expert` mesh axis
that merge is not expressible as a block sharding, so every step would reshard every expert
matrix; its orthogonaliser is also not public API. Batched matmuls on [..., m, n] keep the
leading axes — and their sharding — as they are. Momentum is optax's own `trace`.

Stacked leaves ([L, m, n], [L, E, m, n]) are orthogonalised and stepped one layer at a time
(`per_layer`, a `lax.map` over L): what the update holds at once is one layer's matrices and
their Newton–Schulz temporaries, not the whole stack. The arithmetic per matrix is unchanged.
For the 535B hero this is what keeps the train step on a GB200: with FSDP a whole stacked
attention matrix gathered for the update is 6.75 GiB per device, and the expert leaves' fp32
temporaries were 10 GiB each, many at once (README "What a CPU compile tells").
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the standard quintic (Keller Jordan's Muon)


def matrix_norm(x: jax.Array) -> jax.Array:
    """Frobenius norm of each matrix (last two dims), kept broadcastable against `x`."""
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def per_layer(fn, *arrays: jax.Array) -> jax.Array:
    """`fn(*arrays)`, computed one slice of the leading (stacked-layer) axis at a time when the
    arrays have more than two dims; `fn` treats leading dims as independent matrices and
    returns the shape and dtype of `arrays[0]`. The leading axis is never split over the mesh
    (marin.train.state), so each slice is local; the expert axis (sharded) stays batched.

    The loop writes each result into the buffer of `arrays[0]` (its carry), slice by slice: a
    `lax.map` would stack its results in a fresh zero-filled array, and XLA allocates those
    early (one more whole leaf per map, live through the forward and backward passes)."""
    first = arrays[0]
    if first.ndim <= 2:
        return fn(*arrays)

    def body(i, out):
        take = lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
        result = fn(take(out), *map(take, arrays[1:]))  # slice i of `out` is still the input's
        return jax.lax.dynamic_update_index_in_dim(out, result.astype(out.dtype), i, 0)

    return jax.lax.fori_loop(0, first.shape[0], body, first)


def orthogonalize(x: jax.Array, ns_steps: int = 5, eps: float = 1e-7, dtype=jnp.float32) -> jax.Array:
    """Quintic Newton–Schulz on each matrix in the last two dims; returns `dtype`.

    Normalising by the Frobenius norm (in fp32) puts every singular value in (0, 1]; the quintic
    then pushes them to ≈[0.7, 1.1] (tuned for speed, not exact convergence). The iteration runs
    in `dtype` (the published run: bfloat16 with eps 1e-8, modded-nanogpt's pattern; its
    matmuls take half the bytes) on the wide orientation, so X·Xᵀ is the smaller Gram matrix.
    """
    a, b, c = NS_COEFFS
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -2, -1)
    x = (x / (matrix_norm(x) + eps)).astype(dtype)
    for _ in range(ns_steps):
        gram = x @ jnp.swapaxes(x, -2, -1)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return jnp.swapaxes(x, -2, -1) if tall else x


def scale_by_newton_schulz(ns_steps: int, dtype=jnp.float32, eps: float = 1e-7) -> optax.GradientTransformation:
    def update_fn(updates, state, params=None):
        del params
        ortho = lambda u: orthogonalize(u, ns_steps, eps, dtype).astype(u.dtype)
        return jax.tree.map(lambda u: per_layer(ortho, u), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


class HyperballState(NamedTuple):
    count: jax.Array  # updates applied so far: the schedule's step


def hyperball(learning_rate) -> optax.GradientTransformation:
    """Move each matrix W by lr·‖W‖ against the direction u, then rescale to the original ‖W‖.

        W' = W − lr·‖W‖·u/‖u‖;   W_new = W'·‖W‖/‖W'‖;   update = W_new − W

    `u` is a descent direction in optax's convention (gradient-like: the step goes against it),
    so `optax.apply_updates` lands on W_new. Norms stay at their initial values, which is why
    this group has no weight decay. `learning_rate` is a float or an optax schedule.
    """
    tiny = jnp.finfo(jnp.float32).tiny

    def init_fn(params):
        del params
        return HyperballState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("hyperball needs the parameters: call update(updates, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        def step(u, w):
            if w.ndim < 2:
                raise ValueError(f"hyperball acts on matrices; got a parameter of shape {w.shape}")
            w32, u32 = w.astype(jnp.float32), u.astype(jnp.float32)
            norm = matrix_norm(w32)
            moved = w32 - lr * norm * u32 / jnp.maximum(matrix_norm(u32), tiny)
            new_w = moved * (norm / jnp.maximum(matrix_norm(moved), tiny))
            return (new_w - w32).astype(w.dtype)

        new_updates = jax.tree.map(lambda u, w: per_layer(step, u, w), updates, params)
        return new_updates, HyperballState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def muonh(learning_rate, momentum: float = 0.95, ns_steps: int = 5, ns_dtype=jnp.float32,
          ns_eps: float = 1e-7) -> optax.GradientTransformation:
    # Nesterov in optax's sum form (g + β·m); it differs from the EMA form only by the factor
    # (1 − β), which orthogonalisation and the hyperball normalisation both remove. The
    # momentum stays fp32 whatever ns_dtype is.
    return optax.chain(optax.trace(decay=momentum, nesterov=True, accumulator_dtype=jnp.float32),
                       scale_by_newton_schulz(ns_steps, ns_dtype, ns_eps), hyperball(learning_rate))


def adamh(learning_rate, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), hyperball(learning_rate))
