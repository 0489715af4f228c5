"""Numerics switches of the model: `model.router_dtype` (the router matmul's output dtype, then
fp32), `attention.qk_norm_eps` (auto = model.norm_eps), `model.residual_dtype` (the residual
stream), `attention.xsa_dtype` and `attention.rope_pairing` (halves | interleaved). The published
run (spec §8 "Numerics"): bf16, 1e-6, a bf16 residual stream, combine and XSA, interleaved RoPE."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from marin.config.validate import ConfigError
from marin.model import transformer
from marin.model.attention import Attention, apply_rope, exclude_self_value, rope_permutation
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
    params = jax.jit(lambda key: Attention(cfg).init(key, x, segments, is_global))(jax.random.key(0))
    return cfg, jax.jit(lambda p: Attention(cfg).apply(p, x, segments, is_global))(params)


def test_qk_norm_eps_defaults_to_norm_eps_and_changes_the_norm():
    cfg, auto = _attention()
    assert cfg.attention.qk_norm_eps == cfg.model.norm_eps
    _, same = _attention(f"attention.qk_norm_eps={cfg.model.norm_eps}")
    np.testing.assert_array_equal(auto, same)
    _, large = _attention("attention.qk_norm_eps=10.0")   # q and k shrink: flatter attention
    assert float(jnp.max(jnp.abs(large - auto))) > 1e-3


# --- RoPE pairing ------------------------------------------------------------------------------

def _numpy_rope(x, positions, rotary, theta, pairing):
    """The rotation written out pair by pair: pair i turns by position · theta^(-i / (rotary/2))."""
    y = np.array(x, np.float64)
    half = rotary // 2
    for t, pos in enumerate(positions):
        for i in range(half):
            a, b = (i, i + half) if pairing == "halves" else (2 * i, 2 * i + 1)
            angle = pos * theta ** (-i / half)
            c, s = np.cos(angle), np.sin(angle)
            y[:, t, :, a] = x[:, t, :, a] * c - x[:, t, :, b] * s
            y[:, t, :, b] = x[:, t, :, b] * c + x[:, t, :, a] * s
    return y


@pytest.mark.parametrize("pairing", ["halves", "interleaved"])
def test_rope_equals_a_hand_written_rotation(pairing):
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, 5, 2, 6)))   # h 6, 4 of them rotated
    positions = np.arange(5)
    got = apply_rope(jnp.asarray(x), jnp.asarray(positions), 4, 100.0, pairing)
    np.testing.assert_allclose(got, _numpy_rope(x, positions, 4, 100.0, pairing), atol=1e-5)
    np.testing.assert_array_equal(got[..., 4:], x[..., 4:])               # the tail is untouched


def test_rope_pairings_are_one_rotation_up_to_a_permutation():
    x = jax.random.normal(jax.random.key(0), (2, 7, 3, 16))
    positions, p = jnp.arange(7), rope_permutation(16, 8)
    interleaved = apply_rope(x, positions, 8, 1e4, "interleaved")
    halves = apply_rope(x[..., p], positions, 8, 1e4, "halves")
    np.testing.assert_array_equal(interleaved[..., p], halves)
    assert not np.allclose(interleaved, apply_rope(x, positions, 8, 1e4, "halves"))  # they differ unpermuted
    with pytest.raises(ValueError, match="attention.rope_pairing"):
        apply_rope(x, positions, 8, 1e4, "adjacent")


def _permute_heads(w, head_dim, p):
    """Columns [..., n·h] permuted by p inside each of the n heads."""
    heads = w.reshape(*w.shape[:-1], -1, head_dim)
    return heads[..., jnp.asarray(p)].reshape(w.shape)


def test_attention_layer_agrees_across_pairings_with_permuted_q_k_columns():
    """A checkpoint in production's (interleaved) layout, its q/k columns permuted per head, gives
    the same attention output under halves pairing: q·k is blind to a shared permutation."""
    overrides = ("model=tiny", "attention.head_dim=16", "attention.kv_heads_local=2",
                 "attention.kv_heads_global=1", "attention.window=4")
    inter_cfg = make_config(*overrides, "attention.rope_pairing=interleaved")
    halves_cfg = make_config(*overrides)
    assert halves_cfg.attention.rope_pairing == "halves"                  # today's behaviour is the default
    T, h = 10, 16
    x = jax.random.normal(jax.random.key(1), (1, T, inter_cfg.model.d_model))
    segments, is_local = jnp.asarray([[1] * 6 + [2] * 4]), jnp.array(False)
    params = jax.jit(lambda key: Attention(inter_cfg).init(key, x, segments, is_local))(jax.random.key(0))["params"]
    params = dict(params, gate=0.1 * jax.random.normal(jax.random.key(2), params["gate"].shape),
                  conv_k=jax.random.normal(jax.random.key(3), params["conv_k"].shape))
    p = rope_permutation(h, int(h * inter_cfg.attention.rope_fraction))
    permuted = dict(params, **{name: _permute_heads(params[name], h, p) for name in ("wq", "wk", "conv_k")})

    run = lambda cfg, prm: jax.jit(lambda q: Attention(cfg).apply({"params": q}, x, segments, is_local))(prm)  # noqa: E731
    interleaved = run(inter_cfg, params)
    np.testing.assert_allclose(run(halves_cfg, permuted), interleaved, atol=1e-5, rtol=1e-5)
    assert not np.allclose(run(halves_cfg, params), interleaved, atol=1e-3)   # unpermuted: not the same
    # Global layers have no RoPE: the pairing changes nothing there.
    np.testing.assert_array_equal(Attention(inter_cfg).apply({"params": params}, x, segments, jnp.array(True)),
                                  Attention(halves_cfg).apply({"params": params}, x, segments, jnp.array(True)))


# --- residual stream, XSA ---------------------------------------------------------------------

def _tiny_forward(*overrides):
    cfg = make_config("model=tiny", *overrides)
    params = transformer.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens, "segment_ids": jnp.ones_like(tokens).at[:, 11:].set(2)}
    bias = jnp.zeros((cfg.model.num_layers, cfg.model.num_experts), jnp.float32)
    logits = jax.jit(lambda p: transformer.forward(p, batch, bias, cfg, train=True)[0])(params)
    return cfg, params, batch, bias, logits


def _layer_carries(cfg, params, batch, bias):
    """Dtypes of the [B, T, d] carries of the layer scan, read from the forward pass's jaxpr."""
    jaxpr = jax.make_jaxpr(lambda p: transformer.forward(p, batch, bias, cfg, train=True)[0])(params)
    found = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "scan":
                carries = eqn.outvars[:eqn.params["num_carry"]]
                found.extend(str(v.aval.dtype) for v in carries if v.aval.shape == (*batch["inputs"].shape, cfg.model.d_model))
            for sub in jax_core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jaxpr.jaxpr)
    return found


def test_residual_float32_is_the_default_bit_for_bit():
    cfg, params, batch, bias, default = _tiny_forward()
    assert (cfg.model.residual_dtype, cfg.attention.xsa_dtype, cfg.model.combine_dtype) == ("float32",) * 3
    _, _, _, _, explicit = _tiny_forward("model.residual_dtype=float32", "attention.xsa_dtype=float32")
    np.testing.assert_array_equal(explicit, default)
    assert _layer_carries(cfg, params, batch, bias) == ["float32"]


@pytest.mark.parametrize("remat", ["none", "full"])
def test_bfloat16_residual_keeps_the_carry_in_bf16_and_stays_near_fp32(remat):
    _, _, _, _, fp32 = _tiny_forward(f"model.remat={remat}")
    cfg, params, batch, bias, bf16 = _tiny_forward(f"model.remat={remat}", "model.residual_dtype=bfloat16",
                                                    "attention.xsa_dtype=bfloat16")
    assert _layer_carries(cfg, params, batch, bias) == ["bfloat16"]
    assert bf16.dtype == jnp.float32                                     # logits stay fp32
    assert not np.array_equal(bf16, fp32)                                # the switch does something
    np.testing.assert_allclose(bf16, fp32, atol=0.05 * float(jnp.max(jnp.abs(fp32))))


def test_a_bf16_carry_is_staged_as_its_bits_with_the_same_values_and_gradients():
    """`name_carry`: XLA:CPU would slice a stacked bf16 carry in fp32 (a whole fp32 copy of the
    layers' carries in `dry_run=compile`); as uint16 bits it is sliced as it is. The value and the
    gradient are bit for bit those of the bf16 carry, and offload_carry stages the bits on the host."""
    x = jax.random.normal(jax.random.key(0), (B, T, 8)).astype(jnp.bfloat16)
    f = lambda y: jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(8.0))
    np.testing.assert_array_equal(transformer.name_carry(x), x)
    np.testing.assert_array_equal(jax.grad(lambda y: f(transformer.name_carry(y)))(x), jax.grad(f)(x))
    cfg, params, batch, bias, _ = _tiny_forward("model.remat=full", "model.offload_carry=true",
                                                "model.residual_dtype=bfloat16")
    grad = lambda: jax.grad(lambda p: transformer.forward(p, batch, bias, cfg, train=True)[0].sum())(params)
    jaxpr = str(jax.make_jaxpr(grad)())
    staged = [line for line in jaxpr.splitlines() if "device_put" in line and "<host>" in line]
    assert staged and all("u16<host>" in line for line in staged), staged


def test_combine_dtype_sums_the_moe_output_in_that_dtype():
    _, _, _, _, fp32 = _tiny_forward()
    _, _, _, _, explicit = _tiny_forward("model.combine_dtype=float32")
    np.testing.assert_array_equal(explicit, fp32)                        # float32: today's sum, bit for bit
    _, _, _, _, bf16 = _tiny_forward("model.combine_dtype=bfloat16")
    assert not np.array_equal(bf16, fp32)                                # the switch does something
    np.testing.assert_allclose(bf16, fp32, atol=0.05 * float(jnp.max(jnp.abs(fp32))))


def test_xsa_dtype_sets_the_projection_precision():
    out, v = (jax.random.normal(jax.random.key(i), (1, 4, 2, 8)) for i in (0, 1))
    fp32 = exclude_self_value(out, v)
    bf16 = exclude_self_value(out, v, jnp.bfloat16)
    assert (fp32.dtype, bf16.dtype) == (jnp.float32, jnp.bfloat16)
    np.testing.assert_allclose(bf16.astype(jnp.float32), fp32, atol=0.05)
    assert float(jnp.max(jnp.abs(jnp.sum(bf16.astype(jnp.float32) * v, -1)))) < 0.1   # ⟂ own value, to bf16
    _, default = _attention()
    _, explicit = _attention("attention.xsa_dtype=float32")
    np.testing.assert_array_equal(explicit, default)


@pytest.mark.parametrize("field, bad", [("model.residual_dtype", "float16"), ("model.combine_dtype", "fp8"),
                                        ("attention.xsa_dtype", "half"), ("attention.rope_pairing", "adjacent")])
def test_bad_numerics_values_are_refused_naming_the_field(field, bad):
    with pytest.raises(ConfigError) as err:
        make_config("model=tiny", f"{field}={bad}")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(field), lines


@pytest.mark.parametrize("name", ["mochi_535b_a23b", "ladder_d768"])
def test_hero_and_ladder_run_productions_numerics(name):
    """Production's bf16 residual stream, combine and XSA and interleaved RoPE."""
    cfg = make_config(f"experiment={name}", "dry_run=true")
    assert (cfg.model.residual_dtype, cfg.model.combine_dtype, cfg.attention.xsa_dtype) == ("bfloat16",) * 3
    assert cfg.attention.rope_pairing == "interleaved"
