"""Numerics switches of the model: `model.router_dtype` (the router matmul's output dtype, then
fp32) and `attention.qk_norm_eps` (auto = model.norm_eps). The published run: bf16 and 1e-6."""
import jax
import jax.numpy as jnp
import numpy as np

from marin.model.attention import Attention
from marin.model.moe import MoE
from tests.helpers import make_config

B, T = 2, 8


def _router_jaxpr(*overrides):
    cfg = make_config("model=tiny", *overrides)
    moe = MoE(cfg)
    x = jax.random.normal(jax.random.key(0), (B, T, cfg.model.d_model))
    bias = jnp.zeros(cfg.model.num_experts)
    params = jax.eval_shape(lambda: moe.init(jax.random.key(1), x, bias, train=True))
    return cfg, str(jax.make_jaxpr(lambda p: moe.apply(p, x, bias, train=True))(params))


def test_router_dtype_sets_the_router_matmul_output():
    cfg, fp32 = _router_jaxpr()
    _, bf16 = _router_jaxpr("model.router_dtype=bfloat16")
    logits = f"[{B * T},{cfg.model.num_experts}] = dot_general"   # tokens × experts: the router
    assert f"f32{logits}" in fp32 and f"bf16{logits}" not in fp32
    assert f"bf16{logits}" in bf16 and f"f32{logits}" not in bf16
    assert "convert_element_type[new_dtype=float32" in bf16.split(f"bf16{logits}")[1]  # then fp32


def _attention(*overrides):
    cfg = make_config("model=tiny", *overrides)
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.model.d_model))
    segments, is_global = jnp.ones((1, T), jnp.int32), jnp.array(False)
    params = Attention(cfg).init(jax.random.key(0), x, segments, is_global)
    return cfg, Attention(cfg).apply(params, x, segments, is_global)


def test_qk_norm_eps_defaults_to_norm_eps_and_changes_the_norm():
    cfg, auto = _attention()
    assert cfg.attention.qk_norm_eps == cfg.model.norm_eps
    _, same = _attention(f"attention.qk_norm_eps={cfg.model.norm_eps}")
    np.testing.assert_array_equal(auto, same)
    _, large = _attention("attention.qk_norm_eps=10.0")   # q and k shrink: flatter attention
    assert float(jnp.max(jnp.abs(large - auto))) > 1e-3
