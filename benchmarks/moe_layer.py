"""MoE layer speed, forward + backward, as ratios measured in one run (machine noise cancels).

    python benchmarks/moe_layer.py                      # CPU defaults: 4096 tokens, d 256, E16 k2
    python benchmarks/moe_layer.py --tokens 65536 --d 2048 --latent 1024 --width 1024 \
        --experts 64 --top-k 8 --dtype bfloat16         # a GPU-sized layer

Three jitted steps are timed back to back, round after round, and compared by their medians:
- `matmul`: an N×N×N `jnp.dot` in the compute dtype (N = --matmul, 2048), the machine's dense
  FLOP rate for the dtype the layers compute in (a float32 reference made bfloat16 layers look
  faster than the machine on a GPU);
- `dense`: the same layer with the routed experts replaced by one SwiGLU of width k·I (same
  router, latent projections, norm and shared experts): a dense MLP with the same active FLOPs;
- `moe`: the real `marin.model.moe.MoE` layer (router, dispatch, experts, combine).
Useful FLOPs (both layers) = 3 (forward + backward) × T × [2·d·E (router) + 2·2·d·ℓ (latent
down/up) + 2·3·ℓ·k·I (k experts) + 2·3·d·I_s·S (shared)]. Targets (spec of the dispatch work):
moe ≤ 2.0× dense, and moe's useful FLOP rate ≥ 35 % of the matmul rate. The last column is XLA's
compiled FLOP count over the useful FLOPs (≈ capacity factor for `sort`; E/k for dense dispatch),
then each MoE step's data movement (`marin.model.census`: StableHLO scatters, gathers, sorts).
`--pallas-ragged` times `moe[ragged_dot]` with JAX's Pallas-Triton lowering of ragged_dot (GPU).
`--grouped-matmul mosaic` times `moe[ragged_dot]` with JAX's Mosaic GPU grouped GEMM (Hopper, bf16;
`model.grouped_matmul`); default xla (`jax.lax.ragged_dot`).
`--ragged-probe` adds the grouped matmuls of `ragged_dot` at the layer's shapes (T·k rows, E
groups), compiled forward + backward, with JAX's Pallas-Triton lowering off and (on a GPU whose
jax has it) on, and on a Hopper GPU through `grouped_matmul`'s Mosaic kernels: XLA's FLOPs over the
useful ones, and the guard's verdict (marin/model/grouped.py).

With `--ep-devices 8` it instead compares the expert-parallel training transports on 8 forced host
devices (mesh data 2 × expert 4): `fixed` and `pooled` (the published pooled-wave transport),
same capacity factor for C, the sender pool and the receive buffers, `--waves` waves (the local experts, --experts / 4, must divide by it),
forward + backward, reporting median ms, the time ratio and the dropped fraction of assignments
in all and by stage (sender, receiver). On a GPU node (8 GPUs) `--transports fixed,pooled,ragged` adds the
ragged all-to-all, the published run's transport after step 81,716. `--skew` shifts each device's tokens by its own random
direction (a per-device topic), so each device favours a few experts, as real batches do.

Needs only jax, flax, optax and numpy (plus this repository on the path).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--ep-devices", type=int, default=0)
if (_ep := _pre.parse_known_args()[0].ep_devices) > 1:  # forced host devices: before JAX starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_ep}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from marin.config.schema import Config  # noqa: E402
from marin.model.census import MOVEMENT_OPS, op_census  # noqa: E402
from marin.model.moe import MoE  # noqa: E402
from marin.model.norms import rms_normalize  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d", type=int, default=256, help="model width d")
    p.add_argument("--latent", type=int, default=256, help="latent width ℓ of the routed path")
    p.add_argument("--width", type=int, default=512, help="expert width I")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--shared", type=int, default=0, help="shared experts S (width --width)")
    p.add_argument("--dispatch", default="sort", help="sort | ragged_dot | dense, or a comma list")
    p.add_argument("--router", default="qb", help="qb | softmax_aux | bias_update")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32 | bfloat16")
    p.add_argument("--matmul", type=int, default=2048, help="N of the paired N³ matmul (in --dtype)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up)")
    p.add_argument("--ep-devices", type=int, default=0, help="compare transports on this many host CPU devices")
    p.add_argument("--transports", default="fixed,pooled", help="with --ep-devices: fixed | pooled | ragged (ragged on GPUs only: XLA:CPU cannot compile it), comma list")
    p.add_argument("--waves", type=int, default=2,
                   help="pooled: model.ep_waves; the local experts (--experts / (devices/2)) divide by it "
                        "(production: 3 waves of 6 local experts, e.g. --ep-devices 8 --experts 24 --waves 3)")
    p.add_argument("--skew", type=float, default=0.12, help="with --ep-devices: per-device topic shift")
    p.add_argument("--pallas-ragged", action="store_true",
                   help="lower ragged_dot through JAX's Pallas-Triton kernel (GPU; a jax that has it): times moe[ragged_dot] with it")
    p.add_argument("--grouped-matmul", default="xla", choices=("xla", "mosaic"),
                   help="the ragged paths' grouped GEMM (model.grouped_matmul): xla = ragged_dot, mosaic = JAX's "
                        "Mosaic GPU kernels (Hopper, bf16)")
    p.add_argument("--ragged-probe", action="store_true",
                   help="also: ragged_dot's compiled/useful FLOPs at these shapes, Pallas lowering off and on")
    return p.parse_args(argv)


def make_cfg(a, dispatch: str) -> Config:
    cfg = Config()
    m, r = cfg.model, cfg.router
    m.d_model, m.latent_dim, m.expert_width, m.shared_width = a.d, a.latent, a.width, a.width
    m.num_experts, m.num_shared_experts, m.capacity_factor = a.experts, a.shared, a.capacity_factor
    m.dispatch, m.compute_dtype, m.init_std = dispatch, a.dtype, 0.5 / a.d ** 0.5
    m.grouped_matmul = a.grouped_matmul
    r.kind, r.top_k = a.router, a.top_k
    r.combine = "softmax" if a.router == "softmax_aux" else "sigmoid"
    return cfg


def dense_layer(params, x, a):
    """The MoE layer's dense twin: routed experts → one SwiGLU of width k·I in the latent."""
    dtype = jnp.dtype(a.dtype)
    mm = lambda u, w: jnp.dot(u.astype(dtype), w.astype(dtype))  # noqa: E731
    logits = jnp.dot(x, params["router"])                          # computed, as in the MoE
    h = (rms_normalize(mm(x, params["latent_down"]), 1e-5) * params["scale"]).astype(dtype)
    h = mm(jax.nn.silu(mm(h, params["gate"])) * mm(h, params["up"]), params["down"])
    y = mm(h, params["latent_up"]).astype(jnp.float32) + 0.0 * jnp.sum(logits)
    if a.shared:
        hs = jax.nn.silu(jnp.einsum("td,sdi->tsi", x.astype(dtype), params["shared_gate"].astype(dtype)))
        hs = hs * jnp.einsum("td,sdi->tsi", x.astype(dtype), params["shared_up"].astype(dtype))
        y = y + jnp.einsum("tsi,sid->td", hs, params["shared_down"].astype(dtype)).astype(jnp.float32)
    return y


def dense_params(a, key):
    shapes = {"router": (a.d, a.experts), "latent_down": (a.d, a.latent), "latent_up": (a.latent, a.d),
              "gate": (a.latent, a.top_k * a.width), "up": (a.latent, a.top_k * a.width),
              "down": (a.top_k * a.width, a.latent), "shared_gate": (a.shared, a.d, a.width),
              "shared_up": (a.shared, a.d, a.width), "shared_down": (a.shared, a.width, a.d)}
    keys = jax.random.split(key, len(shapes))
    params = {n: 0.5 / a.d ** 0.5 * jax.random.truncated_normal(k, -3, 3, s) for (n, s), k in zip(shapes.items(), keys)}
    params["scale"] = jnp.ones((a.latent,))
    return params


def useful_flops(a) -> float:
    per_token = 2 * a.d * a.experts + 4 * a.d * a.latent + 6 * a.latent * a.top_k * a.width + 6 * a.d * a.width * a.shared
    return 3.0 * a.tokens * per_token


def fwd_bwd(loss):
    """A jitted step returning the gradients w.r.t. the parameters and the input."""
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def build(a):
    key_x, key_p, key_m = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (a.tokens, a.d), jnp.float32)
    steps = {}
    n = a.matmul
    mats = jax.random.normal(key_m, (2, n, n), jnp.float32).astype(jnp.dtype(a.dtype))
    steps["matmul"] = (jax.jit(lambda m: jnp.dot(m[0], m[1])), (mats,), 2.0 * n ** 3)
    dp = dense_params(a, key_p)
    steps["dense"] = (fwd_bwd(lambda p, x: jnp.sum(dense_layer(p, x, a))), (dp, x), useful_flops(a))
    for dispatch in a.dispatch.split(","):
        module = MoE(make_cfg(a, dispatch))
        bias = jnp.zeros((a.experts,))
        params = module.init(key_p, x[None], bias, train=True)

        def loss(p, x, module=module, bias=bias):
            y, stats = module.apply(p, x[None], bias, train=True)
            return jnp.sum(y) + stats["aux_loss"]
        steps[f"moe[{dispatch}]"] = (fwd_bwd(loss), (params, x), useful_flops(a))
    return steps


def compiled_flops(fn, args) -> float:
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan")))


def time_once(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def transports_main(a):
    """Expert-parallel transports on forced host devices, one run: time and drop rate."""
    from marin.model.mesh import make_mesh

    devices = jax.device_count()
    key_x, key_v, key_p = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (devices, a.tokens // devices, a.d), jnp.float32)
    x = (x + a.skew * jax.random.normal(key_v, (devices, 1, a.d))).reshape(a.tokens, a.d)
    steps = {}
    for transport in a.transports.split(","):
        cfg = make_cfg(a, "sort")
        m = cfg.model
        m.ep_transport, m.ep_waves = transport, a.waves
        m.ep_send_capacity_factor = m.ep_recv_capacity_factor = a.capacity_factor
        cfg.hardware.host_devices, cfg.hardware.mesh.expert, cfg.hardware.mesh.data = devices, devices // 2, 2
        mesh, module, bias = make_mesh(cfg), MoE(cfg), jnp.zeros((a.experts,))
        params = module.init(key_p, x[None], bias, train=True)

        def step(p, x, module=module, bias=bias, mesh=mesh):
            def loss(p, x):
                y, stats = module.apply(p, x[None], bias, train=True, mesh=mesh)
                return jnp.sum(y) + stats["aux_loss"], {k: v for k, v in stats.items() if k.startswith("dropped_frac")}
            return jax.grad(loss, argnums=(0, 1), has_aux=True)(p, x)
        steps[transport] = (jax.jit(step), (params, x))
    dropped = {}
    for name, (fn, args) in steps.items():     # compile + warm up
        dropped[name] = {k: float(v) for k, v in jax.block_until_ready(fn(*args))[1].items()}
    times = {name: [] for name in steps}
    for _ in range(a.rounds):
        for name, (fn, args) in steps.items():
            times[name].append(time_once(fn, args))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    first = next(iter(steps))
    print(f"backend {jax.default_backend()}, {devices} devices (data 2 × expert {devices // 2}), "
          f"jax {jax.__version__}; "
          f"T={a.tokens} d={a.d} ℓ={a.latent} I={a.width} E={a.experts} k={a.top_k} cf={a.capacity_factor} "
          f"waves={a.waves} skew={a.skew} dtype={a.dtype}")
    print(f"{'transport':<12}{'ms':>9}{'vs ' + first:>12}{'dropped':>10}{'send':>9}{'recv':>9}")
    for name in steps:
        d = dropped[name]
        print(f"{name:<12}{med[name] * 1e3:>9.1f}{med[name] / med[first]:>11.2f}x{100 * d['dropped_frac']:>9.3f}%"
              f"{100 * d['dropped_frac/send']:>8.3f}%{100 * d['dropped_frac/recv']:>8.3f}%")


def main(argv=None):
    a = parse_args(argv)
    if a.pallas_ragged:
        from marin.model import grouped
        if not grouped.pallas_lowering_available():
            sys.exit(f"--pallas-ragged: jax {jax.__version__} has no Pallas-Triton lowering of ragged_dot")
        jax.config.update(grouped.PALLAS_FLAG, True)
    if a.ep_devices > 1:
        return transports_main(a)
    steps = build(a)
    for fn, args, _ in steps.values():         # compile + warm up
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in steps}
    for _ in range(a.rounds):                  # interleaved, so load changes hit all alike
        for name, (fn, args, _) in steps.items():
            times[name].append(time_once(fn, args))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    matmul_rate = steps["matmul"][2] / med["matmul"]
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"T={a.tokens} d={a.d} ℓ={a.latent} I={a.width} E={a.experts} k={a.top_k} S={a.shared} "
          f"cf={a.capacity_factor} router={a.router} dtype={a.dtype}")
    print(f"{'step':<18}{'ms':>9}{'vs dense':>10}{'GFLOP/s':>10}{'% matmul':>10}{'XLA/useful':>12}")
    for name, (fn, args, flops) in steps.items():
        rate = flops / med[name]
        ratio = "" if name == "matmul" else f"{med[name] / med['dense']:.2f}x"
        xla = compiled_flops(fn, args) / flops
        print(f"{name:<18}{med[name] * 1e3:>9.2f}{ratio:>10}{rate / 1e9:>10.1f}"
              f"{100 * rate / matmul_rate:>9.0f}%{xla:>12.2f}")
    print("targets: moe ≤ 2.00x dense, moe ≥ 35% of the matmul rate")
    for name, (fn, args, _) in steps.items():
        if name.startswith("moe"):
            census = op_census(fn.lower(*args).as_text())
            print(f"{name:<18}data movement: " + ", ".join(f"{census[op]} {op}" for op in MOVEMENT_OPS))
    if a.ragged_probe:
        ragged_probe_main(a)


def ragged_probe_main(a):
    """ragged_dot's grouped matmuls at this layer's shapes: XLA's FLOPs over the useful ones, the
    Pallas-Triton lowering off and (where this jax has it, on a GPU) on, and (on a Hopper GPU)
    `grouped_matmul` with JAX's Mosaic GPU kernels; the guard's verdict on each."""
    from functools import partial

    from marin.model import grouped
    from marin.model.kernels import grouped_matmul as kernel

    modes = [False] + ([True] if jax.default_backend() == "gpu" and grouped.pallas_lowering_available() else [])
    cudnn = grouped.cudnn_version()
    for pallas in modes:
        probe = grouped.ragged_probe(a.tokens * a.top_k, a.experts, a.latent, a.width, a.dtype, pallas=pallas)
        verdict = grouped.ragged_refusal(probe["compiled_flops"], probe["useful_flops"], probe["platform"], cudnn,
                                         "model.dispatch=ragged_dot", pallas) or "allowed"
        print(f"ragged_dot probe, Pallas lowering {'on ' if pallas else 'off'}: XLA/useful {probe['ratio']:.2f}, "
              f"{probe['custom_calls']} custom calls; guard: {verdict}")
    why_not = kernel.mosaic_unavailable()
    if why_not:
        print(f"grouped_matmul (Mosaic GPU) probe: skipped ({why_not})")
        return
    probe = grouped.ragged_probe(a.tokens * a.top_k, a.experts, a.latent, a.width, a.dtype,
                                 grouped_matmul=partial(kernel.grouped_matmul, impl="mosaic"))
    verdict = grouped.ragged_refusal(probe["compiled_flops"], probe["useful_flops"], probe["platform"], cudnn,
                                     "model.dispatch=ragged_dot") or "allowed"
    print(f"grouped_matmul (Mosaic GPU) probe: XLA/useful {probe['ratio']:.2f}, {probe['custom_calls']} custom calls; "
          f"guard: {verdict}")


if __name__ == "__main__":
    main()
