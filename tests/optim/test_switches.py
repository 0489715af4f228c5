"""Newton–Schulz numerics switches: `optim.ns_dtype` and `optim.ns_eps` (the published run: bf16,
eps 1e-8; the default: fp32, eps 1e-7)."""
import jax
import jax.numpy as jnp
import numpy as np

from marin.optim import build_optimizer
from marin.optim.muonh import orthogonalize
from tests.optim import config


def test_bf16_newton_schulz_differs_from_fp32_within_bf16_accuracy():
    x = jax.random.normal(jax.random.key(0), (2, 48, 32))
    fp32 = orthogonalize(x, 5, 1e-7)
    bf16 = orthogonalize(x, 5, 1e-8, jnp.bfloat16)
    assert (fp32.dtype, bf16.dtype) == (jnp.float32, jnp.bfloat16)
    rel = float(jnp.linalg.norm(bf16.astype(jnp.float32) - fp32) / jnp.linalg.norm(fp32))
    assert 1e-3 < rel < 0.15, rel            # bf16 keeps 8 significant bits: a few percent
    s = np.linalg.svd(np.asarray(bf16, np.float32), compute_uv=False)
    assert s.min() > 0.6 and s.max() < 1.2   # still the quintic's band, as in fp32


def _muonh_update(**optim):
    cfg = config("muonh", steps=10)
    for name, value in optim.items():
        setattr(cfg.optim, name, value)
    opt = build_optimizer(cfg)
    w = jax.random.normal(jax.random.key(1), (2, 16, 24))
    params = {"layers": {"attn": {"wq": w}}}
    grads = {"layers": {"attn": {"wq": jax.random.normal(jax.random.key(2), w.shape)}}}
    update = jax.jit(lambda g, s: opt.update(g, s, params)[0])
    state = opt.update(grads, opt.init(params), params)[1]   # step 1: past lr(0) = 0 (the warmup's start)
    return update(grads, state)["layers"]["attn"]["wq"], jax.make_jaxpr(update)(grads, state)


def _dot_dtypes(jaxpr) -> set[str]:
    text = str(jaxpr)
    return {line.split(":")[1].split("[")[0] for line in text.splitlines()
            if "dot_general" in line and ":" in line.split("=")[0]}


def test_optim_switches_reach_the_muonh_optimizer():
    base, base_jaxpr = _muonh_update()
    bf16, bf16_jaxpr = _muonh_update(ns_dtype="bfloat16", ns_eps=1e-8)
    assert _dot_dtypes(base_jaxpr) == {"f32"} and "bf16" in _dot_dtypes(bf16_jaxpr)
    assert bf16.dtype == jnp.float32      # the update (and the momentum) stay fp32
    rel = float(jnp.linalg.norm(bf16 - base) / jnp.linalg.norm(base))
    assert 1e-4 < rel < 0.15, rel
    # eps enters the normalisation x / (‖x‖ + eps): a huge one leaves the quintic far from 1.
    big_eps, _ = _muonh_update(ns_eps=1e3)
    assert float(jnp.linalg.norm(big_eps - base) / jnp.linalg.norm(base)) > 0.05
