"""Grouped matmuls for the ragged paths, and the guard against their dense rewrite.

The ragged paths (`model.dispatch=ragged_dot`, `model.ep_transport=ragged`) run each expert on
its own rows with `kernels.grouped_matmul`, by `model.grouped_matmul`:
- `mosaic` (auto on gpu in bf16): JAX's Hopper Pallas Mosaic-GPU grouped GEMM, forward and both
  gradients (`marin/model/kernels/grouped_matmul.py`);
- `xla`: `jax.lax.ragged_dot`. Unless the backend has a grouped kernel, XLA rewrites it into a
  dense dot over every expert: E× the useful FLOPs (benchmarks/moe_layer.py on an H200 with cuDNN
  9.19: 51.8× a dense MLP of equal FLOPs at E64; XLA keeps the grouped form only with cuDNN
  ≥ 9.22). There it uses JAX's Pallas-Triton lowering of ragged_dot where the installed jax has
  it (`use_grouped_kernel`; the flag is read when a program is lowered, so it is set for the
  process, as the compilation cache is).
On GPU a ragged path is refused before training (`check_ragged`) when `mosaic` cannot run on this
machine (not Hopper, or the kernels missing from this jax, or they fail to compile at the run's
shapes), or when XLA's compiled FLOPs of the layer's three grouped matmuls, forward and backward
(`ragged_probe`), exceed RAGGED_FLOPS_LIMIT × the useful FLOPs (`ragged_refusal`: one line naming
the cuDNN version and the ways out).
On CPU ragged_dot is a dropless reference for tests (≈ E× the useful FLOPs as well): not guarded.

A Pallas or cuDNN kernel is a custom call, which XLA's cost analysis counts as no FLOPs: with
one the probe's ratio is below 1 (the elementwise work only), and `custom_calls` says so.
"""
from __future__ import annotations

import importlib.util
import re

RAGGED_FLOPS_LIMIT = 1.3
PALLAS_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
# The module JAX's GPU lowering rule imports when the flag is on (absent from some wheels, e.g.
# jax 0.10.2's: there the flag would make every lowering of ragged_dot on GPU fail).
PALLAS_MODULE = "jax._src.lax.pallas_lowerings.gpu.ragged_dot"


def ragged_setting(cfg, peers: int = 1) -> str | None:
    """The override that puts ragged_dot in the training step ("model.dispatch=ragged_dot",
    "model.ep_transport=ragged"), or None. Under expert parallelism (`peers` > 1) only the
    transport decides (`model.dispatch` is for one device)."""
    m = cfg.model
    if m.ep_transport == "ragged" and (peers > 1 or m.dispatch == "sort"):
        return "model.ep_transport=ragged"
    if m.dispatch == "ragged_dot" and peers == 1:
        return "model.dispatch=ragged_dot"
    return None


def pallas_lowering_available() -> bool:
    """Whether the installed jax can lower ragged_dot through Pallas-Triton on GPU."""
    import jax

    try:
        return PALLAS_FLAG in jax.config.values and importlib.util.find_spec(PALLAS_MODULE) is not None
    except ModuleNotFoundError:   # a parent package is missing
        return False


def cudnn_version() -> int | None:
    """cuDNN's version as an int (9.19.0 → 91900), None without CUDA."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:   # no CUDA plugin, or no cuDNN library loaded
        return None


def _cudnn_text(version: int | None) -> str:
    if not version:
        return "cuDNN unknown"
    return f"cuDNN {version // 10000}.{version // 100 % 100}.{version % 100}"


def ragged_refusal(compiled_flops: float, useful_flops: float, platform: str, cudnn: int | None,
                   setting: str = "model.ep_transport=ragged", pallas: bool = False,
                   limit: float = RAGGED_FLOPS_LIMIT) -> str | None:
    """None if the ragged path may run; else the one line that refuses it.

    Only on GPU (on CPU ragged_dot is a test reference and is dense by design). `compiled_flops`:
    XLA's cost analysis of the grouped matmuls, forward and backward; `useful_flops`: the same
    matmuls on only each expert's own rows (`ragged_probe`)."""
    if platform != "gpu" or compiled_flops <= limit * useful_flops:
        return None
    field = setting.split("=")[0]
    return (f"{field}: {setting} compiles its grouped matmuls to {compiled_flops / useful_flops:.1f}× their useful "
            f"FLOPs (XLA rewrote ragged_dot into a dense dot over every expert; {_cudnn_text(cudnn)}, "
            f"Pallas-Triton lowering {'on' if pallas else 'not in this jax'}); allowed ≤ {limit}×: "
            f"use model.grouped_matmul=mosaic (JAX's Mosaic GPU grouped GEMM; Hopper, bf16), "
            f"model.ep_transport=fixed or pooled (model.dispatch=sort), or cuDNN ≥ 9.22 or a jax with "
            f"the Pallas ragged_dot lowering")


def ragged_shapes(cfg, peers: int = 1) -> tuple[int, int, int, int]:
    """(rows, groups, latent, width) of one device's grouped matmuls: the T·k sorted assignments
    over E experts on one device; under expert parallelism the shared receive buffer over the
    device's E/peers local experts (`expert_parallel.ragged_buffer_rows`)."""
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch * t.seq_len
    k, experts = cfg.router.top_k, m.num_experts
    if peers > 1:
        from marin.model.expert_parallel import ragged_buffer_rows
        return (ragged_buffer_rows(tokens, k, experts, peers, m.ep_recv_capacity_factor), experts // peers,
                int(m.latent_dim), int(m.expert_width))
    return tokens * k, experts, int(m.latent_dim), int(m.expert_width)


def useful_flops(rows: int, latent: int, width: int) -> float:
    """The SwiGLU's three grouped matmuls on only their own rows, forward and backward (the
    input gradient and the weight gradient each cost one more matmul): 3 × 3 × 2·rows·ℓ·I."""
    return 3 * 3 * 2.0 * rows * latent * width


def ragged_probe(rows: int, groups: int, latent: int, width: int, dtype="bfloat16", grouped_matmul=None,
                 pallas: bool | None = None) -> dict:
    """Compile (not run) the SwiGLU's grouped matmuls at these shapes, forward and backward, on
    the default backend: {"compiled_flops", "useful_flops", "ratio", "custom_calls", "platform"}.
    XLA's FLOP count does not depend on the group sizes, so none are given. `pallas`: lower with
    JAX's Pallas-Triton lowering of ragged_dot on (True) or off (False) for this probe only
    (GPU; it needs `pallas_lowering_available()`); None: as the process has it."""
    import jax
    import jax.numpy as jnp

    if pallas is not None:
        before = jax.config.values[PALLAS_FLAG]
        jax.config.update(PALLAS_FLAG, pallas)
        try:
            return ragged_probe(rows, groups, latent, width, dtype, grouped_matmul) | {"pallas": pallas}
        finally:
            jax.config.update(PALLAS_FLAG, before)

    matmul = grouped_matmul or jax.lax.ragged_dot
    dt = jnp.dtype(dtype)

    def swiglu(xs, gate, up, down, sizes):
        h = jax.nn.silu(matmul(xs, gate, sizes)) * matmul(xs, up, sizes)
        return jnp.sum(matmul(h, down, sizes).astype(jnp.float32))

    shape = jax.ShapeDtypeStruct
    args = (shape((rows, latent), dt), shape((groups, latent, width), dt), shape((groups, latent, width), dt),
            shape((groups, width, latent), dt), shape((groups,), jnp.int32))
    compiled = jax.jit(jax.grad(swiglu, argnums=(0, 1, 2, 3))).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops, useful = float(cost.get("flops", 0.0)), useful_flops(rows, latent, width)
    text = compiled.as_text() or ""
    return {"compiled_flops": flops, "useful_flops": useful, "ratio": flops / useful,
            "custom_calls": len(re.findall(r"custom-call\(", text)), "platform": jax.default_backend()}


def use_grouped_kernel(cfg, peers: int = 1) -> bool:
    """Before the step is lowered: on GPU, with a ragged path running XLA's ragged_dot
    (`model.grouped_matmul=xla`), lower ragged_dot through Pallas-Triton where this jax can (a
    process-wide JAX flag, read at lowering time). Returns whether it is on."""
    import jax

    from marin.config import derive

    if (ragged_setting(cfg, peers) is None or derive.grouped_matmul_impl(cfg) != "xla"
            or jax.default_backend() != "gpu" or not pallas_lowering_available()):
        return False
    jax.config.update(PALLAS_FLAG, True)
    return True


def mosaic_refusal(reason: str, setting: str = "model.ep_transport=ragged") -> str:
    """The one line that refuses `model.grouped_matmul=mosaic` where its kernel cannot run."""
    return (f"model.grouped_matmul: mosaic (for {setting}) cannot run here: {reason}; use "
            f"model.grouped_matmul=xla (allowed on GPU only where XLA keeps ragged_dot grouped: cuDNN ≥ 9.22), "
            f"or model.ep_transport=fixed or pooled (model.dispatch=sort)")


def check_ragged(cfg, peers: int = 1) -> dict | None:
    """On GPU with a ragged path: the probe at this run's shapes, through the configured
    `model.grouped_matmul`; raises ValueError (one line) when the Mosaic kernel cannot run here
    (`mosaic_refusal`) or XLA would compute more than RAGGED_FLOPS_LIMIT × the useful FLOPs
    (`ragged_refusal`). None where there is nothing to check (no ragged path, or not a GPU)."""
    from functools import partial

    import jax

    from marin.config import derive
    from marin.model.kernels import grouped_matmul as kernel

    setting = ragged_setting(cfg, peers)
    if setting is None or jax.default_backend() != "gpu":
        return None
    impl = derive.grouped_matmul_impl(cfg)
    shapes = ragged_shapes(cfg, peers)
    if impl == "mosaic":
        reason = kernel.mosaic_unavailable()
        if reason is None:
            try:   # compiles the three kernels at the run's shapes: a failure here, not in the step
                probe = ragged_probe(*shapes, dtype=cfg.model.compute_dtype,
                                     grouped_matmul=partial(kernel.grouped_matmul, impl="mosaic"))
            except Exception as e:  # noqa: BLE001 - any lowering or compile error refuses, in one line
                reason = f"the kernel failed to compile at {shapes}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if reason is not None:
            raise ValueError(mosaic_refusal(reason, setting))
        pallas = False
    else:
        pallas = use_grouped_kernel(cfg, peers)
        probe = ragged_probe(*shapes, dtype=cfg.model.compute_dtype)
    line = ragged_refusal(probe["compiled_flops"], probe["useful_flops"], probe["platform"], cudnn_version(),
                          setting, pallas)
    if line:
        raise ValueError(line)
    return probe | {"pallas": pallas, "impl": impl}
