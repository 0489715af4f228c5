"""Compile-time census of the data movement in the MoE layer: StableHLO op counts, backend-free.

The step time of a small-expert MoE on one GPU went to copies, dynamic slices and scatters, not
to its matmuls (ladder_d768 on an H200: GEMMs ≈ 60 ms of a 1,150 ms step, dynamic-slice fusions
311 ms, scatters 125 ms). Each such op is visible already in the lowered program, before any
backend compiles it, so a test on CPU can pin how many the layer has (`tests/model/test_census.py`)
and a GPU benchmark can print the same numbers beside its timings.

    op_census(jax.jit(f).lower(*args).as_text()) -> {"scatter": 3, "gather": 12, ...}
    moe_layer_census(cfg, tokens) -> the counts of one routed-experts layer, forward + backward
    hlo_census(jax.jit(f).lower(*args).compile().as_text()) -> the optimised HLO's (per backend)
    router_census(cfg, tokens) -> the counts of the routing alone (forward)

Counts are static: an op inside a function that is called twice (a `jax.checkpoint`ed wave, a
custom VJP's rule) counts once per definition, an op inside a loop body once.
"""
from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp

# The ops that move data without computing (and the ones worth seeing beside them).
MOVEMENT_OPS = ("scatter", "gather", "dynamic_slice", "dynamic_update_slice", "sort")
REPORTED_OPS = MOVEMENT_OPS + ("dot_general", "while", "all_to_all")

# An op, pretty (`stablehlo.add %a`) or generic (`"stablehlo.scatter"(...)`); not an attribute or a
# type (`#stablehlo.scatter<...>`, `!stablehlo.token`), which name the op again.
_OP = re.compile(r"(?<![#!\w.])stablehlo\.([a-z_]+)\b")


_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([^\s(]+)", re.M)
_CALL = re.compile(r"\bcall @([^\s(]+)")


def op_census(lowered_text: str) -> dict[str, int]:
    """How many times each StableHLO op runs in a lowered module (`Lowered.as_text()`), once per
    call of the function holding it (a helper that JAX outlined and calls twice counts twice);
    every op in REPORTED_OPS (zero when absent) plus any other op that occurs."""
    starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(lowered_text)]
    if not starts:   # a bare region or op list: count it as it stands
        found = Counter(_OP.findall(lowered_text))
    else:
        bodies = {name: lowered_text[pos:end] for (pos, name), (end, _) in
                  zip(starts, starts[1:] + [(len(lowered_text), "")])}
        totals: dict[str, Counter] = {}

        def total(name: str) -> Counter:
            if name not in totals:
                body = bodies[name]
                own = Counter(_OP.findall(body))
                for callee in _CALL.findall(body):
                    if callee in bodies:
                        own += total(callee)
                totals[name] = own
            return totals[name]

        entry = "main" if "main" in bodies else starts[0][1]
        found = total(entry)
    return {op: found.get(op, 0) for op in REPORTED_OPS} | {op: n for op, n in sorted(found.items())
                                                             if op not in REPORTED_OPS}


_HLO_OP = re.compile(r"= [^=]*?\b(gather|scatter|dynamic-slice|dynamic-update-slice|sort|custom-call|fusion)\(")


def hlo_census(compiled_text: str) -> dict[str, int]:
    """Op counts in a compiled (optimised, backend-specific) HLO module (`Compiled.as_text()`),
    static, fused computations included: where XLA turned gathers into dynamic slices, and the
    custom calls (cuDNN, Pallas/Triton kernels). Beside `op_census` in a benchmark on the target
    backend; tests pin `op_census`, which does not depend on the backend."""
    found = Counter(_HLO_OP.findall(compiled_text))
    return {op.replace("-", "_"): found.get(op, 0) for op in
            ("gather", "scatter", "dynamic-slice", "dynamic-update-slice", "sort", "custom-call", "fusion")}


def _layer_inputs(cfg, tokens: int):
    m = cfg.model
    dtype = jnp.dtype(m.compute_dtype)
    latent, width, experts = int(m.latent_dim), int(m.expert_width), m.num_experts
    shape = jax.ShapeDtypeStruct
    return (shape((tokens, latent), dtype), shape((tokens, experts), jnp.float32),
            shape((experts,), jnp.float32),
            shape((experts, latent, width), dtype), shape((experts, latent, width), dtype),
            shape((experts, width, latent), dtype))


def moe_layer_census(cfg, tokens: int | None = None, compiled: bool = False) -> dict[str, int]:
    """Op counts of one routed-experts layer on one device, forward and backward (gradients of the
    layer's input, router logits and expert weights), as `model.dispatch` and `model.ep_transport`
    of the resolved `cfg` choose it. `tokens`: the layer's T (default: one device's micro-batch).
    `compiled`: compile it for the default backend and count the optimised HLO (`hlo_census`)."""
    from marin.model.dispatch import ExpertWeights, routed_experts

    tokens = tokens or cfg.train.micro_batch * cfg.train.seq_len

    def loss(x, logits, bias, gate, up, down):
        y, stats = routed_experts(x, logits, bias, ExpertWeights(gate, up, down), cfg, train=True)
        return jnp.sum(y.astype(jnp.float32)), stats

    grad = jax.grad(loss, argnums=(0, 1, 3, 4, 5), has_aux=True)
    lowered = jax.jit(grad).lower(*_layer_inputs(cfg, tokens))
    return hlo_census(lowered.compile().as_text()) if compiled else op_census(lowered.as_text())


def router_census(cfg, tokens: int | None = None) -> dict[str, int]:
    """Op counts of `routers.route` alone (forward: the router's statistics have no gradient)."""
    from marin.model import routers

    tokens = tokens or cfg.train.micro_batch * cfg.train.seq_len
    _, logits, bias, *_ = _layer_inputs(cfg, tokens)
    return op_census(jax.jit(lambda lg, b: routers.route(lg, b, cfg)).lower(logits, bias).as_text())


def main(argv=None) -> None:
    """`python -m marin.model.census [--tokens T] [--compiled] [override ...]`: one MoE layer's
    census per transport on one device (and `model.dispatch=ragged_dot`), and the routing's."""
    import argparse

    from marin.config.store import compose
    from marin.config.validate import load

    p = argparse.ArgumentParser(prog="python -m marin.model.census", description=main.__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="the layer's T (tokens on the device)")
    p.add_argument("--compiled", action="store_true", help="count the optimised HLO of the default backend")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. experiment=ladder_d768")
    a = p.parse_args(argv)
    one_device = ["hardware.mesh.expert=1", "dry_run=true"]   # dry run: ragged may be planned on CPU
    variants = {t: [f"model.ep_transport={t}"] for t in ("fixed", "pooled", "ragged")}
    variants["dispatch=ragged_dot"] = ["model.dispatch=ragged_dot"]
    shown = MOVEMENT_OPS + ("dot_general",) if not a.compiled else None
    for name, extra in variants.items():
        cfg = load(compose([*a.overrides, *one_device, *extra]))[1]
        census = moe_layer_census(cfg, a.tokens, compiled=a.compiled)
        print(f"{name:<20}", " ".join(f"{op}={n}" for op, n in census.items() if shown is None or op in shown))
    cfg = load(compose([*a.overrides, *one_device]))[1]
    print(f"{'routing (' + cfg.router.kind + ')':<20}",
          " ".join(f"{op}={n}" for op, n in router_census(cfg, a.tokens).items() if op in MOVEMENT_OPS))


if __name__ == "__main__":
    main()
