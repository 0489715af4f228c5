"""Newton–Schulz coefficient schedules of MuonH (`optim.ns_coefficients`). Pure Python: no JAX.

Each iteration maps X ← a·X + b·(X Xᵀ)X + c·(X Xᵀ)²X with its own (a, b, c):

- `simple`: one triple for every iteration, (3.4445, −4.7750, 2.0315) (Keller Jordan's Muon;
  the runs before the hero);
- `quintic`: the published hero's 5-step schedule (spec §8), one triple per iteration, which
  reaches σ ≈ 1 more tightly in the same 5 steps;
- or an explicit list of ns_steps [a, b, c] triples.

`check` (a launch check, marin.launch.checks) refuses a name it does not know or a list whose
length is not `optim.ns_steps`, with one line.
"""
from __future__ import annotations

import math

from marin.config.schema import Config

SIMPLE = (3.4445, -4.7750, 2.0315)
QUINTIC = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
NAMES = ("simple", "quintic")


def coefficients(spec, ns_steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of the ns_steps iterations for `optim.ns_coefficients` = `spec`
    (assumed valid: see `check`)."""
    if spec == "simple":
        return (SIMPLE,) * ns_steps
    if spec == "quintic":
        return QUINTIC
    return tuple(tuple(float(x) for x in triple) for triple in spec)


def _triple_ok(triple) -> bool:
    return (isinstance(triple, (list, tuple)) and len(triple) == 3
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in triple))


def problems(spec, ns_steps: int) -> list[tuple[str, str]]:
    field = "optim.ns_coefficients"
    if isinstance(spec, str):
        if spec not in NAMES:
            return [(field, f"must be one of {', '.join(NAMES)} or a list of optim.ns_steps [a, b, c] triples; got {spec!r}")]
        if spec == "quintic" and ns_steps != len(QUINTIC):
            return [(field, f"quintic is a {len(QUINTIC)}-iteration schedule: needs optim.ns_steps={len(QUINTIC)} "
                     f"(or use simple, or list ns_steps triples); got ns_steps={ns_steps}")]
        return []
    if not isinstance(spec, (list, tuple)) or not all(_triple_ok(t) for t in spec):
        return [(field, f"must be simple, quintic or a list of [a, b, c] triples of finite numbers; got {spec!r}")]
    if len(spec) != ns_steps:
        return [(field, f"needs one [a, b, c] triple per iteration: optim.ns_steps={ns_steps} triples; got {len(spec)}")]
    return []


def check(cfg: Config) -> list[tuple[str, str]]:
    """Problems with `optim.ns_coefficients` of a resolved config, as (field, message)."""
    return problems(cfg.optim.ns_coefficients, cfg.optim.ns_steps)
