"""A grouped GEMM with its VJP: `grouped_matmul(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]`
(`model.grouped_matmul`, for the ragged paths: `model.dispatch=ragged_dot`, `model.ep_transport=ragged`).

Rows are sorted by group: rows [start_g, start_g + group_sizes[g]) are multiplied by w[g]; rows
past sum(group_sizes) give zeros (`jax.lax.ragged_dot`'s semantics). The three products of the
forward and backward pass are each one function with two implementations:

  forward        y    = x_g · w_g            `ragged_matmul`          [M, N]
  input grad     dx   = dy_g · w_gᵀ          `ragged_matmul_t`        [M, K]
  weight grad    dw_g = x_gᵀ · dy_g          `ragged_weight_grad`     [G, K, N]

- `xla`: `jax.lax.ragged_dot` / `ragged_dot_general` (any backend; the reference the kernel is
  tested against, and the custom VJP's algebra is tested with it on CPU against autodiff of
  `ragged_dot`). On GPU without cuDNN ≥ 9.22 XLA rewrites it into a dense dot over every group.
- `mosaic`: JAX's own Hopper Pallas Mosaic-GPU kernels (`jax.experimental.pallas.ops.gpu`:
  `ragged_dot_mgpu.ragged_dot`, with `transpose_rhs=True` for the input gradient, and
  `transposed_ragged_dot_mgpu.transposed_ragged_dot` for the weight gradient): a real grouped
  GEMM, one kernel launch per product (a custom call: XLA's cost analysis counts no FLOPs for
  it). Hopper (sm_90) only, 16-bit operands (wgmma). Same signatures in jax 0.10.2 and 0.11.2.
"""
from __future__ import annotations

import importlib.util
from functools import partial

import jax
import jax.numpy as jnp

IMPLS = ("mosaic", "xla")
MOSAIC_MODULES = ("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu",
                  "jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu")
MOSAIC_DTYPES = (jnp.bfloat16, jnp.float16)

# Tiles of the Mosaic kernels. wgmma wants 64-multiples; the contraction tile 64 (128 B of bf16:
# the widest swizzle); 4 pipeline stages of (128×64 + 64×128) bf16 plus the 128×128 output tile
# is ~160 KiB of the H100/H200's 227 KiB shared memory per SM.
BLOCK_M, BLOCK_K, MAX_STAGES = 128, 64, 4


def mosaic_unavailable() -> str | None:
    """None if the Mosaic GPU kernels can run here (a Hopper GPU, the modules importable); else why not."""
    try:
        missing = [name for name in MOSAIC_MODULES if importlib.util.find_spec(name) is None]
    except ModuleNotFoundError:   # a parent package is missing
        missing = list(MOSAIC_MODULES)
    if missing:
        return f"jax {jax.__version__} has no {missing[0]}"
    if jax.default_backend() != "gpu":
        return f"no GPU (backend {jax.default_backend()})"
    capability = str(getattr(jax.devices()[0], "compute_capability", "?"))
    if not capability.startswith("9"):
        return f"the kernels are Hopper's (sm_90); this GPU is compute capability {capability}"
    return None


# --- the three products, each with both implementations --------------------------------------

def ragged_matmul(x, w, group_sizes, impl: str = "xla"):
    """x [M, K] · w [G, K, N] per group → [M, N]."""
    if impl == "mosaic":
        return _mosaic_ragged_dot(x, w, group_sizes, transpose_rhs=False)
    return jax.lax.ragged_dot(x, w, group_sizes)


def ragged_matmul_t(dy, w, group_sizes, impl: str = "xla"):
    """dy [M, N] · w_gᵀ (w [G, K, N]) per group → [M, K]."""
    if impl == "mosaic":
        return _mosaic_ragged_dot(dy, w, group_sizes, transpose_rhs=True)
    return jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), group_sizes)


def ragged_weight_grad(x, dy, group_sizes, impl: str = "xla"):
    """x_gᵀ · dy_g per group (x [M, K], dy [M, N]) → [G, K, N]; zeros for an empty group."""
    if impl == "mosaic":
        return _mosaic_transposed_ragged_dot(x, dy, group_sizes)
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(x, dy, group_sizes, numbers)


# --- the custom VJP ----------------------------------------------------------------------------

@jax.named_scope("expert_gemm")   # the profile's part for the experts' matmuls (benchmarks/gpu_profile.py)
def grouped_matmul(x, w, group_sizes, impl: str = "xla"):
    """x [M, K] · w [G, K, N] per group of rows (`group_sizes` [G] int32) → [M, N], in x and w's
    promoted dtype, differentiable in x and w; `impl`: mosaic | xla (see the module's docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul: impl must be one of {IMPLS}; got {impl!r}")
    dtype = jnp.result_type(x.dtype, w.dtype)
    x, w, group_sizes = x.astype(dtype), w.astype(dtype), group_sizes.astype(jnp.int32)
    x, w, group_sizes = _varying_alike(x, w, group_sizes)
    return _grouped_matmul(x, w, group_sizes, impl)


def _varying_alike(*operands):
    """Inside shard_map, the operands cast to vary over every mesh axis any of them varies over
    (e.g. the expert-sharded w over the batch axes too; a Pallas kernel takes operands alike). A
    custom VJP's cotangents must have their primals' types: cast here, outside it, the cast's
    transpose (a psum over those axes) is what reduces dw over the batch shards, as autodiff of
    ragged_dot does itself."""
    union = frozenset().union(*(_varying_axes(a) for a in operands))

    def cast(a):
        missing = tuple(sorted(union - _varying_axes(a)))
        if not missing:
            return a
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(a, missing, to="varying")
        return jax.lax.pvary(a, missing)   # older jax
    return tuple(cast(a) for a in operands)


def _varying_axes(a) -> frozenset:
    """The manual mesh axes `a` varies over (jax 0.10/0.11: `typeof(a).mat.varying`; older: `.vma`)."""
    t = jax.typeof(a)
    mat = getattr(t, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(t, "vma", None) or ())


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x, w, group_sizes, impl):
    return ragged_matmul(x, w, group_sizes, impl)


def _forward(x, w, group_sizes, impl):
    return ragged_matmul(x, w, group_sizes, impl), (x, w, group_sizes)


def _backward(impl, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = ragged_matmul_t(dy, w, group_sizes, impl).astype(x.dtype)
    dw = ragged_weight_grad(x, dy, group_sizes, impl).astype(w.dtype)
    return dx, dw, None   # group sizes: integers, no cotangent


_grouped_matmul.defvjp(_forward, _backward)


# --- the Mosaic GPU kernels, padded to their tiles ---------------------------------------------

def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_to(a, shape):
    return jnp.pad(a, [(0, s - d) for d, s in zip(a.shape, shape)])


def _block_n(n: int) -> int:
    return 128 if n >= 128 else 64


def _check_dtype(*arrays):
    for a in arrays:
        if a.dtype not in MOSAIC_DTYPES:
            raise ValueError(f"grouped_matmul impl=mosaic takes bfloat16 or float16 operands (wgmma); got {a.dtype}: "
                             "use impl=xla (model.grouped_matmul=xla)")


def _rows_in_groups(out, group_sizes):
    """Zeros past sum(group_sizes): the kernel never writes those rows (and padding rows)."""
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def _mosaic_ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs: bool):
    """`ragged_dot_mgpu.ragged_dot`: lhs [M, K] · rhs [G, K, N] (or rhs [G, N, K] transposed).

    The kernel needs K % block_k == 0 (checked) and reads and writes whole tiles of M and N: the
    operands are zero-padded here to multiples of the tiles (zero columns of the contraction add
    nothing; padded rows and columns are cut off after), then rows past sum(group_sizes), which
    it leaves unwritten, are zeroed."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    _check_dtype(lhs, rhs)
    m, k = lhs.shape
    g, n = rhs.shape[0], (rhs.shape[1] if transpose_rhs else rhs.shape[2])
    block_n = _block_n(n)
    mp, kp, np_ = _round_up(m, BLOCK_M), _round_up(k, BLOCK_K), _round_up(n, block_n)
    lhs = _pad_to(lhs, (mp, kp))
    rhs = _pad_to(rhs, (g, np_, kp) if transpose_rhs else (g, kp, np_))
    out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, block_m=BLOCK_M, block_n=block_n,
                                     block_k=BLOCK_K, max_concurrent_steps=MAX_STAGES, grid_block_n=1,
                                     transpose_rhs=transpose_rhs)
    return _rows_in_groups(out[:m, :n], group_sizes)


def _mosaic_transposed_ragged_dot(x, dy, group_sizes):
    """`transposed_ragged_dot_mgpu.transposed_ragged_dot`: x [M, K], dy [M, N] → [G, K, N].

    The kernel needs K % block_m == 0 and N % block_n == 0 (checked), and walks each group's rows
    in tiles of block_k masked to the group: K and N are zero-padded to the tiles, M to a whole
    number of row tiles with zero rows (so no tile reads past the array), and the result cut back.
    The kernel masks rows outside the group by multiplying x's tile by 0, which would keep a NaN or
    inf of dy there: rows past sum(group_sizes) are zeroed in both first."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    _check_dtype(x, dy)
    m, k = x.shape
    n = dy.shape[1]
    block_m, block_n = _block_n(k), _block_n(n)
    mp, kp, np_ = _round_up(m, BLOCK_K), _round_up(k, block_m), _round_up(n, block_n)
    out = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        _pad_to(_rows_in_groups(x, group_sizes), (mp, kp)), _pad_to(_rows_in_groups(dy, group_sizes), (mp, np_)), group_sizes=group_sizes, block_m=block_m, block_n=block_n,
        block_k=BLOCK_K, max_concurrent_steps=MAX_STAGES, grid_block_n=1)
    return out[:, :k, :n]
