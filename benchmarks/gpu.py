"""The GPU check: what one accelerator does with the project's train step, in one command.

    python benchmarks/gpu.py                    # on a machine with one GPU: ≤ 8 minutes
    python benchmarks/gpu.py --tiny             # the same parts at toy size, on any machine (the suite runs it)
    python benchmarks/gpu.py --parts env,steps --preset d768 --variant 'blockwise: attention.impl=blockwise'

Every part is budgeted (`--budget-s`) and guarded: a part that fails or would overrun is recorded
as such and the others go on. `--out` (default outputs/gpu/<date>) receives `gpu.json` and
`gpu.md` (one Markdown table per part), rewritten as each part finishes.

Parts, in order:
  env       jax, jaxlib, CUDA, cuDNN, the device, XLA_FLAGS
  ceilings  bf16 matmul TFLOP/s, device-memory copy GB/s, pinned-host ↔ device GB/s (the denominators)
  steps     the real train step of each preset × variant, built as the loop builds it
            (`init_sharded`, `jit_steps`, `hyperparams`), each in a process of its own (clean peak
            memory; a crash or an out-of-memory costs that variant only): compile s, ms/step,
            tokens/s, MFU (3 × forward FLOPs/token × tokens / `hardware.peak_flops_per_device`),
            the device's peak memory against the plan's estimate
  profile   one step of the first preset under jax.profiler, its kernel time by model part
            (attention, routing, dispatch, expert GEMMs, head and loss, optimizer, other) from the
            HLO op metadata (benchmarks/gpu_profile.py)
  attention the attention kernels (`attention.impl`) fwd+bwd on packed rows (benchmarks/gpu_probes.py)
  grouped   `jax.lax.ragged_dot` and (GPU) `grouped_matmul` with JAX's Mosaic GPU kernels fwd+bwd
            against the capacity-padded batched einsum: time, the compiled FLOPs over the useful
            ones (a dense rewrite shows as ≈ the group count) and the kernel's max |Δ| from XLA's

Configs are composed through Hydra as launch.py composes them (`marin.config.store.compose`); a
preset is a list of overrides and a variant adds more (`NAME: k=v k=v`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from presets import PRESETS, TINY_PRESETS, TINY_VARIANTS, VARIANTS  # noqa: E402


class Check:
    """The results so far, their files, and the time budget."""

    def __init__(self, out: Path, budget_s: float, tiny: bool):
        self.out, self.budget_s, self.tiny, self.t0 = out, budget_s, tiny, time.time()
        self.results: dict = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "tiny": tiny, "parts": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def run(self, name: str, fn, need_s: float):
        """fn() under the budget: its result recorded, or why there is none."""
        if self.left() < need_s:
            self.record(name, {"skipped": f"{self.left():.0f} s of the budget left, needs about {need_s:.0f} s"})
            return None
        start = time.time()
        try:
            result = fn()
        except Exception as exc:  # a part that fails must not take the others with it
            self.record(name, {"error": f"{type(exc).__name__}: {str(exc)[:2000]}", "trace": traceback.format_exc()[-3000:]})
            say(f"[{name}] FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            return None
        say(f"[{name}] done in {time.time() - start:.1f} s")
        self.record(name, result)
        return result

    def record(self, name: str, result) -> None:
        self.results["parts"][name] = result
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1, default=str))
        from gpu_report import markdown
        (self.out / "gpu.md").write_text(markdown(self.results))


def say(line: str) -> None:
    print(line, flush=True)


def compose(overrides: list[str]):
    from marin.config.store import compose as hydra_compose
    from marin.launch.checks import load
    return load(hydra_compose(list(overrides)))[1]


# --- parts --------------------------------------------------------------------------------------

def part_env() -> dict:
    import jax
    import jaxlib
    info = {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    from gpu_probes import cuda_versions
    info.update(cuda_versions())
    say(f"[env] {json.dumps(info)}")
    return info


def bench(fn, *args, rounds: int, warmup: int = 1) -> float:
    """Median seconds of fn(*args) over `rounds`, after `warmup` calls."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part_ceilings(tiny: bool) -> dict:
    import jax
    import jax.numpy as jnp
    n = 512 if tiny else 8192
    a = jnp.full((n, n), 0.01, jnp.bfloat16)
    res = {"matmul_n": n, "bf16_matmul_tflops": 2 * n ** 3 / bench(jax.jit(lambda x: x @ x), a, rounds=10) / 1e12}
    x = jnp.ones(((1 << 20) if tiny else (1 << 30),), jnp.float32)   # 4 MiB / 4 GiB
    res["device_copy_GBps"] = 2 * x.nbytes / bench(jax.jit(lambda v: v * 1.0001), x, rounds=5) / 1e9
    dev = jax.devices()[0]
    if "pinned_host" in {m.kind for m in dev.addressable_memories()}:
        from jax.sharding import SingleDeviceSharding
        host, on_device = SingleDeviceSharding(dev, memory_kind="pinned_host"), SingleDeviceSharding(dev)
        y = x[: x.size // 4]
        res["device_to_host_GBps"] = y.nbytes / bench(lambda v: jax.device_put(v, host), y, rounds=3) / 1e9
        y_host = jax.device_put(y, host)
        res["host_to_device_GBps"] = y.nbytes / bench(lambda v: jax.device_put(v, on_device), y_host, rounds=3) / 1e9
    say(f"[ceilings] {json.dumps({k: round(v, 1) for k, v in res.items()})}")
    return res


def in_child(args: list[str], timeout_s: float, xla_flags: str = "") -> dict:
    """This script's `--child` mode in a process of its own; its last `RESULT ` line, parsed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip())
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1), env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)[-1500:]}


def part_steps(check: Check, presets: dict, variants: dict, args) -> list[dict]:
    rows = []
    for preset, overrides in presets.items():
        for name, extra in variants[preset].items():
            spec = {"preset": preset, "variant": name, "overrides": overrides + extra, "docs": args.docs,
                    "doc_len": args.doc_len, "rounds": args.rounds}
            need = 20 if check.tiny else 60
            if check.left() < need:
                rows.append({**spec, "skipped": f"{check.left():.0f} s of the budget left"})
                continue
            start = time.time()
            result = in_child(["--child", "step", json.dumps(spec)], min(check.left() - 5, args.variant_timeout_s))
            rows.append({**spec, **result, "wall_s": round(time.time() - start, 1)})
            say(f"[steps] {preset} / {name}: " + json.dumps({k: v for k, v in result.items() if k != "trace"})[:600])
            check.record("steps", rows)
    return rows


def child_step(spec: dict) -> dict:
    """One variant's train step, measured (and profiled with spec["profile"])."""
    from gpu_step import measure
    return measure(compose(spec["overrides"]), spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--tiny", action="store_true", help="toy sizes on any backend (the suite's check)")
    p.add_argument("--out", type=Path, help="folder for gpu.json and gpu.md (default outputs/gpu/<UTC time>)")
    p.add_argument("--budget-s", type=float, default=470.0, help="the whole check's time (default: under 8 minutes)")
    p.add_argument("--parts", default="env,ceilings,steps,profile,attention,grouped")
    p.add_argument("--preset", action="append", help="preset(s) to measure (default: all of the mode's)")
    p.add_argument("--only", help="comma-separated variant names to measure (default: every variant; names hold no comma)")
    p.add_argument("--variant", action="append", default=[],
                   help="'NAME: k=v k=v', an extra variant of every chosen preset (Hydra overrides)")
    p.add_argument("--docs", choices=("packed", "single"), default="packed",
                   help="synthetic rows: packed documents (as the loader writes them) or one document a row")
    p.add_argument("--doc-len", type=int, default=1024, help="mean document length of packed rows (tokens)")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per variant (after two warm-up steps)")
    p.add_argument("--variant-timeout-s", type=float, default=150.0)
    p.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        kind, spec = args.child[0], json.loads(args.child[1])
        try:
            result = {"step": child_step}[kind](spec)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {str(exc)[:1500]}", "trace": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return

    presets, variants = (TINY_PRESETS, TINY_VARIANTS) if args.tiny else (PRESETS, VARIANTS)
    if args.preset:
        unknown = sorted(set(args.preset) - set(presets))
        if unknown:
            p.error(f"--preset: {', '.join(unknown)} not one of {', '.join(presets)}")
        presets = {k: presets[k] for k in args.preset}
    variants = {k: dict(v) for k, v in variants.items()}
    for item in args.variant:
        name, sep, overrides = item.partition(":")
        if not sep or not name.strip():
            p.error(f"--variant {item!r}: expected 'NAME: key=value ...'")
        for preset in presets:
            variants[preset][name.strip()] = overrides.split()
    if args.only:
        keep = set(args.only.split(","))
        variants = {k: {n: o for n, o in v.items() if n in keep} for k, v in variants.items()}
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"env", "ceilings", "steps", "profile", "attention", "grouped"})
    if unknown:
        p.error(f"--parts: {', '.join(unknown)} not among env, ceilings, steps, profile, attention, grouped")

    out = args.out or ROOT / "outputs" / "gpu" / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    check = Check(out, args.budget_s, args.tiny)
    say(f"[gpu check] writing {out}/gpu.json and gpu.md; budget {args.budget_s:.0f} s")
    import gpu_probes
    if "env" in parts:
        check.run("env", part_env, 5)
    if "ceilings" in parts:
        check.run("ceilings", lambda: part_ceilings(args.tiny), 10 if args.tiny else 30)
    if "steps" in parts:
        check.run("steps", lambda: part_steps(check, presets, variants, args), 20 if args.tiny else 60)
    if "profile" in parts:
        first = next(iter(presets))
        spec = {"preset": first, "variant": "base", "overrides": presets[first], "docs": args.docs,
                "doc_len": args.doc_len, "rounds": 1, "profile": True}
        # Without command buffers (CUDA graphs show as one event each, hiding the kernels).
        no_graphs = "" if args.tiny else "--xla_gpu_enable_command_buffer="
        check.run("profile", lambda: in_child(["--child", "step", json.dumps(spec)],
                                              min(check.left() - 5, args.variant_timeout_s), no_graphs),
                  20 if args.tiny else 60)
    probe_cfg = lambda: compose(next(iter(presets.values())))
    if "attention" in parts:
        check.run("attention", lambda: gpu_probes.attention(probe_cfg(), args.doc_len, args.tiny, check.left), 15)
    if "grouped" in parts:
        check.run("grouped", lambda: gpu_probes.grouped(probe_cfg(), args.tiny, check.left), 15)
    say(f"[gpu check] finished in {time.time() - check.t0:.0f} s: {out}/gpu.md")


if __name__ == "__main__":
    main()
