"""MuonH / AdamH pieces and whole optimizers on a toy model."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marin.optim import build_optimizer, param_groups
from marin.optim.muonh import hyperball, matrix_norm, orthogonalize
from tests.optim import config


@pytest.mark.parametrize("shape", [(3, 4, 32, 48), (2, 48, 32)])
def test_newton_schulz_batched_singular_values(shape):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    y = orthogonalize(x, ns_steps=5)
    s = np.linalg.svd(np.asarray(y), compute_uv=False)
    # The standard quintic is tuned for speed, not convergence: it leaves σ in ≈[0.68, 1.13].
    assert s.min() > 0.65 and s.max() < 1.2
    # Leading dims are independent matrices (normalised one by one), not one big matrix.
    np.testing.assert_allclose(y[1], orthogonalize(x[1]), atol=1e-5)


def test_newton_schulz_matches_optax_muon():
    # optax's Muon with zero momentum is exactly its orthogonaliser (2-D matrices only).
    x = jax.random.normal(jax.random.PRNGKey(3), (24, 40))
    ref = optax.contrib.scale_by_muon(beta=0.0, ns_steps=5)
    expected, _ = ref.update(x, ref.init(x))
    np.testing.assert_allclose(orthogonalize(x, ns_steps=5), expected, atol=1e-5)


def test_fused_muonh_is_the_optax_chain_layer_by_layer():
    # muonh runs momentum → Newton–Schulz → hyperball one stacked layer at a time; the result
    # and the state are those of the plain optax chain on whole leaves.
    from marin.optim.muonh import HyperballState, muonh, scale_by_newton_schulz

    lr = optax.linear_schedule(0.1, 0.01, 10)
    chain = optax.chain(optax.trace(decay=0.9, nesterov=True, accumulator_dtype=jnp.float32),
                        scale_by_newton_schulz(5), hyperball(lr))
    fused = muonh(lr, momentum=0.9)
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    params = {"stack": jax.random.normal(keys[0], (3, 2, 8, 12)), "matrix": jax.random.normal(keys[1], (8, 4))}
    s_chain, s_fused = chain.init(params), fused.init(params)
    assert jax.tree.structure(s_chain) == jax.tree.structure(s_fused)   # checkpoints stay compatible
    for step in range(3):
        grads = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(step), p.shape), params)
        u_chain, s_chain = chain.update(grads, s_chain, params)
        u_fused, s_fused = jax.jit(fused.update)(grads, s_fused, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), (u_chain, s_chain), (u_fused, s_fused))
    assert isinstance(s_fused[2], HyperballState) and int(s_fused[2].count) == 3


def test_hyperball_keeps_matrix_norms():
    kw, ku = jax.random.split(jax.random.PRNGKey(1))
    w = jax.random.normal(kw, (2, 3, 8, 16)) * jnp.arange(1.0, 7.0).reshape(2, 3, 1, 1)
    u = jax.random.normal(ku, w.shape)
    hb = hyperball(0.1)
    updates, _ = hb.update(u, hb.init(w), w)
    new_w = optax.apply_updates(w, updates)
    np.testing.assert_allclose(matrix_norm(new_w), matrix_norm(w), rtol=1e-5)
    assert float(jnp.sum(updates * u)) < 0  # moved against the direction
    # The move is lr·‖W‖ before rescaling, so the angle is ≈ lr for a direction ⟂ W.
    cos = jnp.sum(new_w * w, axis=(-2, -1)) / jnp.sum(w * w, axis=(-2, -1))
    assert np.all(np.asarray(cos) > np.cos(0.2))


def test_hyperball_zero_direction_is_a_no_op():
    w = jnp.ones((4, 4))
    hb = hyperball(0.1)
    updates, _ = hb.update(jnp.zeros_like(w), hb.init(w), w)
    assert np.all(np.isfinite(updates)) and float(jnp.max(jnp.abs(updates))) < 1e-6


V, D, L = 16, 32, 2


def toy_params(key):
    """A 2-layer residual model whose names follow CONTRACTS, so muonh routes every group."""
    k = jax.random.split(key, 4)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (V, D))},
        "layers": {"attn": {"wq": jax.random.normal(k[1], (L, D, D)) / np.sqrt(D)},
                   "attn_norm": {"scale": jnp.ones((L, D))}},
        "head": {"kernel": jax.random.normal(k[2], (D, V))},
    }


def toy_loss(params, tokens, targets):
    h = params["embed"]["embedding"][tokens]
    for layer in range(L):
        x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * params["layers"]["attn_norm"]["scale"][layer]
        h = h + jnp.tanh(x @ params["layers"]["attn"]["wq"][layer])
    logits = h @ params["head"]["kernel"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.parametrize("name,grad_clip", [("adamw", None), ("muonh", None), ("muonh", 1.0)])
def test_optimizer_trains_toy_model(name, grad_clip):
    cfg = config(name, steps=60, lr=1e-2)
    cfg.optim.grad_clip = grad_clip
    opt = build_optimizer(cfg)
    params = toy_params(jax.random.PRNGKey(0))
    tokens = jnp.arange(V)
    targets = (5 * tokens + 3) % V

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(toy_loss)(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = opt.init(params)
    first = None
    trained = params
    for _ in range(cfg.train.steps):
        trained, state, loss = step(trained, state)
        first = float(loss) if first is None else first
    final = float(toy_loss(trained, tokens, targets))
    assert final < 0.3 * first, (first, final)
    if name == "muonh":  # hyperball groups keep their norms; adam groups move freely
        groups = param_groups(params)
        for group, before, after in zip(jax.tree.leaves(groups), jax.tree.leaves(params), jax.tree.leaves(trained)):
            if group in ("muonh", "adamh"):
                np.testing.assert_allclose(matrix_norm(after), matrix_norm(before), rtol=1e-4)
                assert float(jnp.max(jnp.abs(after - before))) > 1e-2  # and they did train


def test_muonh_alone_solves_regression_on_the_sphere():
    # Only a stacked muonh matrix trains; the target has the same per-matrix norm as the start,
    # so the hyperball (norm-preserving) step can reach it.
    kx, kw, k0 = jax.random.split(jax.random.PRNGKey(2), 3)
    x = jax.random.normal(kx, (64, 16))
    target = jax.random.normal(kw, (2, 16, 8))
    start = jax.random.normal(k0, target.shape)
    start = start * matrix_norm(target) / matrix_norm(start)
    params = {"layers": {"attn": {"wq": start}}}
    loss = lambda p: jnp.mean((x @ p["layers"]["attn"]["wq"] - x @ target) ** 2)
    opt = build_optimizer(config("muonh", steps=100, lr=0.02))
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        updates, state = opt.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    first = float(loss(params))
    for _ in range(100):
        params, state = step(params, state)
    assert float(loss(params)) < 0.05 * first


def test_shipped_muonh_config_builds():
    from tests.helpers import make_config

    cfg = make_config("model=tiny", "optim=muonh")
    opt = build_optimizer(cfg)
    params = toy_params(jax.random.PRNGKey(0))
    updates, _ = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
    assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
