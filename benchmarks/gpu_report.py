"""benchmarks/gpu.py's results as Markdown: one table per part (the page docs/performance.md quotes)."""
from __future__ import annotations


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows), ""]


def _problem(result) -> str | None:
    if isinstance(result, dict) and ("error" in result or "skipped" in result):
        return result.get("error", "").splitlines()[0][:300] if "error" in result else f"skipped: {result['skipped']}"
    return None


def markdown(results: dict) -> str:
    parts = results["parts"]
    lines = [f"# GPU check, {results['started']}" + (" (--tiny)" if results.get("tiny") else ""), ""]
    env = parts.get("env")
    if env and not _problem(env):
        lines += [f"jax {env['jax']} (jaxlib {env['jaxlib']}), {env['backend']}: {', '.join(sorted(set(env['devices'])))}; "
                  f"CUDA {env.get('cuda', '–')}, cuDNN {env.get('cudnn', '–')}; Python {env['python']}", ""]
    for name in ("env", "ceilings", "steps", "profile", "attention", "grouped"):
        result = parts.get(name)
        if result is None:
            continue
        problem = _problem(result)
        if problem:
            lines += [f"## {name}", "", problem, ""]
            continue
        if name == "ceilings":
            lines += ["## ceilings", "", *_table(["measure", "value"], [[k, v] for k, v in result.items()])]
        elif name == "steps":
            rows = [[r["preset"], r["variant"], r.get("resolved", {}).get("attention.impl"),
                     r.get("compile_s"), r.get("step_ms"), r.get("tokens_per_s"),
                     f"{r['mfu']:.1%}" if r.get("mfu") is not None else None, r.get("peak_gib"), r.get("plan_gib"),
                     r.get("error", r.get("skipped", ""))[:120] if "error" in r or "skipped" in r else ""]
                    for r in result]
            lines += ["## steps", "", *_table(["preset", "variant", "attention", "compile s", "ms/step", "tokens/s",
                                               "MFU", "peak GiB", "plan GiB", "note"], rows)]
        elif name == "profile":
            prof = result.get("profile", {})
            if not prof:
                lines += ["## profile", "", _problem(result) or "no profile", ""]
                continue
            total = prof["kernel_ms"] or 1.0
            lines += [f"## profile (one step: wall {prof['wall_ms']} ms, kernels {prof['kernel_ms']} ms; "
                      f"GEMM + attention kernels {prof['matmul_and_attention_share']:.0%})", "",
                      *_table(["part", "ms", "share", "instructions"],
                              [[k, v, f"{v / total:.0%}", prof.get("ops_by_part", {}).get(k, "")]
                               for k, v in prof["by_part_ms"].items()]),
                      *_table(["kernel class", "ms", "share"],
                              [[k, v, f"{v / total:.0%}"] for k, v in prof["by_class_ms"].items()]),
                      *_table(["top op", "part", "kernel", "count", "ms"],
                              [[o["op"], o["part"], o["kernel"], o["count"], o["ms"]] for o in prof["top_ops"][:10]])]
        elif name in ("attention", "grouped"):
            rows = [[k, *(v.get(c) for c in ("ms", "tflops_per_s", "flops_over_useful", "max_abs_diff")), v.get("error", "")]
                    for k, v in result["results"].items()]
            lines += [f"## {name} ({result['shape']})", "",
                      *_table(["kernel", "ms fwd+bwd", "useful TFLOP/s", "compiled/useful FLOPs", "max |Δ|", "note"], rows)]
    return "\n".join(lines)
