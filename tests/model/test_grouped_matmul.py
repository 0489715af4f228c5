"""kernels.grouped_matmul (`model.grouped_matmul`): the custom VJP's algebra against autodiff of
`jax.lax.ragged_dot` (the XLA implementation, on CPU: empty, uneven and short groups, f32 and
bf16); the Mosaic implementation's padding and masking around stand-ins of JAX's kernels that
enforce their tile constraints (the kernels themselves need a Hopper GPU: benchmarks/gpu.py
--parts grouped); the config switch; the ragged dispatch through it; the guard's lines."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.config import derive
from marin.config.validate import ConfigError
from marin.model import dispatch, grouped
from marin.model.dispatch import ExpertWeights
from marin.model.kernels import grouped_matmul as gm
from tests.helpers import make_config

# rows 40, 36 of them in groups: uneven, two empty (one first), 4 rows past the last group
SIZES = [0, 7, 0, 20, 9]
M, K, N = 40, 24, 40


def _problem(dtype, sizes=SIZES, m=M, k=K, n=N, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(ks[1], (len(sizes), k, n), jnp.float32)).astype(dtype)
    c = jax.random.normal(ks[2], (m, n), jnp.float32)
    return x, w, c, jnp.asarray(sizes, jnp.int32)


def _value_and_grads(matmul, x, w, c, sizes):
    loss = lambda x, w: jnp.sum(jnp.sin(matmul(x, w, sizes).astype(jnp.float32)) * c)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def _close(got, want, dtype):
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", [SIZES, [40, 0, 0, 0, 0], [0, 0, 0, 0, 0], [8, 8, 8, 8, 8]])
def test_custom_vjp_matches_autodiff_of_ragged_dot(dtype, sizes):
    x, w, c, s = _problem(dtype, sizes)
    got = _value_and_grads(gm.grouped_matmul, x, w, c, s)
    want = _value_and_grads(jax.lax.ragged_dot, x, w, c, s)
    _close(got, want, dtype)
    dx, dw = got[1]
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    empty = np.asarray(s) == 0
    assert not np.any(np.asarray(dw, np.float32)[empty])          # an empty group's weights get nothing
    assert not np.any(np.asarray(dx, np.float32)[int(np.sum(sizes)):])   # nor rows past the groups


def test_each_product_is_its_reference():
    x, w, c, s = _problem(jnp.float32)
    dy = c
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    y, dx, dw = np.zeros((M, N)), np.zeros((M, K)), np.zeros((len(SIZES), K, N))
    for g in range(len(SIZES)):
        rows = slice(starts[g], starts[g + 1])
        y[rows] = np.asarray(x)[rows] @ np.asarray(w)[g]
        dx[rows] = np.asarray(dy)[rows] @ np.asarray(w)[g].T
        dw[g] = np.asarray(x)[rows].T @ np.asarray(dy)[rows]
    np.testing.assert_allclose(gm.ragged_matmul(x, w, s), y, atol=1e-4)
    np.testing.assert_allclose(gm.ragged_matmul_t(dy, w, s), dx, atol=1e-4)
    np.testing.assert_allclose(gm.ragged_weight_grad(x, dy, s), dw, atol=1e-4)


def test_unknown_impl_is_refused():
    x, w, _, s = _problem(jnp.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        gm.grouped_matmul(x, w, s, impl="triton")


# --- the Mosaic path's padding and masking, around stand-ins of the kernels -----------------

def _fake_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n,
                     transpose_rhs=False):
    """ragged_dot_mgpu.ragged_dot's contract: same dtypes, K % block_k (checked there), whole tiles
    (padded by the caller); rows past the groups are never written (here: NaN)."""
    m, k = lhs.shape
    assert lhs.dtype == rhs.dtype and lhs.dtype in gm.MOSAIC_DTYPES
    assert k % block_k == 0 and m % block_m == 0
    assert (rhs.shape[1] if transpose_rhs else rhs.shape[2]) % (block_n * grid_block_n) == 0
    out = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)
    rows = jnp.arange(m)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.nan)


def _fake_transposed(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n):
    """transposed_ragged_dot's contract: K % block_m, N % block_n (checked there); row tiles of block_k."""
    rows, k = lhs.shape
    assert lhs.dtype == rhs.dtype and k % block_m == 0 and rhs.shape[1] % block_n == 0 and rows % block_k == 0
    return gm.ragged_weight_grad(lhs, rhs, group_sizes)


@pytest.fixture
def fake_kernels(monkeypatch):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    monkeypatch.setattr(ragged_dot_mgpu, "ragged_dot", _fake_ragged_dot)
    monkeypatch.setattr(transposed_ragged_dot_mgpu, "transposed_ragged_dot", _fake_transposed)


@pytest.mark.parametrize("shape", [(40, 24, 40), (300, 64, 200), (128, 130, 64)])
def test_mosaic_path_pads_to_the_tiles_and_masks_unwritten_rows(fake_kernels, shape):
    m, k, n = shape
    sizes = [0, m // 5, 0, m // 2, m // 5]   # uneven, empty, rows past the groups
    x, w, c, s = _problem(jnp.bfloat16, sizes, m, k, n)
    got = _value_and_grads(lambda a, b, g: gm.grouped_matmul(a, b, g, impl="mosaic"), x, w, c, s)
    want = _value_and_grads(lambda a, b, g: gm.grouped_matmul(a, b, g, impl="xla"), x, w, c, s)
    _close(got, want, jnp.bfloat16)


def test_mosaic_path_takes_only_16_bit_operands(fake_kernels):
    x, w, _, s = _problem(jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        gm.grouped_matmul(x, w, s, impl="mosaic")


def test_mosaic_unavailable_on_cpu_says_why():
    # The kernels themselves are checked on a GPU by benchmarks/gpu.py's `grouped` part (values and
    # gradients against XLA's ragged_dot): the suite runs on CPU only.
    assert "no GPU" in gm.mosaic_unavailable()


# --- the switch, the dispatch through it, the guard ------------------------------------------

def test_switch_resolves_auto_by_platform_and_dtype():
    cfg = make_config("model=tiny")
    assert cfg.model.grouped_matmul == "xla"                       # auto on CPU
    assert make_config("model=tiny", "model.grouped_matmul=xla").model.grouped_matmul == "xla"
    gpu = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, grouped_matmul="auto", compute_dtype="bfloat16"),
                              hardware=dataclasses.replace(cfg.hardware, platform="gpu"))
    assert derive.grouped_matmul_impl(gpu) == "mosaic"
    f32 = dataclasses.replace(gpu, model=dataclasses.replace(gpu.model, compute_dtype="float32"))
    assert derive.grouped_matmul_impl(f32) == "xla"                # wgmma: 16-bit operands only


@pytest.mark.parametrize("value,words", [("triton", "model.grouped_matmul"),
                                         ("mosaic", "model.grouped_matmul: mosaic needs hardware.platform=gpu")])
def test_switch_refuses_a_bad_value_naming_the_field(value, words):
    with pytest.raises(ConfigError, match=words):
        make_config("model=tiny", f"model.grouped_matmul={value}")


def _old_ragged_dot_dispatch(x, expert_idx, weights, w):
    """ragged_dot_dispatch as it was before grouped_matmul: jax.lax.ragged_dot's own autodiff."""
    tokens, k = expert_idx.shape
    n = tokens * k
    q = dispatch.expert_queues(expert_idx, w.gate.shape[0])
    sorted_pos = jnp.zeros((n,), jnp.int32).at[q.order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    xs = dispatch.take_rows(x, q.order % tokens, sorted_pos.reshape(k, tokens))
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w.gate, q.counts)) * jax.lax.ragged_dot(xs, w.up, q.counts)
    ys = jax.lax.ragged_dot(h, w.down, q.counts)
    y_assign = dispatch.take_rows(ys, sorted_pos, q.order[None]).reshape(k, tokens, -1)
    return jnp.einsum("kt,ktl->tl", weights.T.astype(jnp.float32), y_assign.astype(jnp.float32)).astype(x.dtype)


def test_ragged_dispatch_through_grouped_matmul_equals_the_old_path():
    tokens, latent, width, experts, k = 48, 16, 24, 8, 2
    ks = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(ks[0], (tokens, latent))
    idx = jax.vmap(lambda r: jax.random.choice(r, 6, (k,), replace=False))(jax.random.split(ks[1], tokens))  # 2 experts empty
    wts = jax.random.uniform(ks[2], (tokens, k), minval=0.5, maxval=1.5)
    w = ExpertWeights(*(0.3 * jax.random.normal(r, s) for r, s in
                        zip(ks[3:], [(experts, latent, width), (experts, latent, width), (experts, width, latent)])))

    def value_and_grads(fn):
        loss = lambda x, wts, w: jnp.sum(jnp.sin(fn(x, idx.astype(jnp.int32), wts, w)))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, wts, w)
    _close(value_and_grads(dispatch.ragged_dot_dispatch), value_and_grads(_old_ragged_dot_dispatch), jnp.float32)


def test_guard_lines_name_the_mosaic_way_out():
    line = grouped.ragged_refusal(64.2e12, 1e12, "gpu", 91900, "model.dispatch=ragged_dot")
    assert "model.grouped_matmul=mosaic" in line and "\n" not in line
    line = grouped.mosaic_refusal("no GPU (backend cpu)", "model.dispatch=ragged_dot")
    assert line.startswith("model.grouped_matmul: mosaic (for model.dispatch=ragged_dot) cannot run here: no GPU")
    assert "model.grouped_matmul=xla" in line and "\n" not in line


def test_probe_through_grouped_matmul_on_cpu():
    """The guard's probe takes the configured grouped matmul (here XLA's, dense on CPU)."""
    from functools import partial
    probe = grouped.ragged_probe(256, 8, 32, 48, "float32", grouped_matmul=partial(gm.grouped_matmul, impl="xla"))
    assert 0.5 * 8 < probe["ratio"] < 1.5 * 8, probe
