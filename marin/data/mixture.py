"""Mixture checks (pure Python; run at validation time, before JAX).

PLACEHOLDER written by the integrator: the data work replaces this with the full mixture logic.
"""
from __future__ import annotations

import glob
import math
import os


def check(cfg) -> list[tuple[str, str]]:
    data = cfg.data
    problems = []
    if not data.sources and not data.cells_file:
        return [("data.sources", "the mixture is empty: give at least one source")]
    phases = len(data.phase_boundaries) + 1
    for i, src in enumerate(data.sources):
        field = f"data.sources[{i}]"
        if len(src.weights) != phases:
            problems.append((f"{field}.weights", f"needs one weight per phase ({phases}); got {len(src.weights)}"))
        if any(w < 0 for w in src.weights):
            problems.append((f"{field}.weights", f"weights must be ≥ 0; got {list(src.weights)}"))
        if src.kind != "builtin":
            for pattern in src.paths:
                path = pattern if os.path.isabs(pattern) else os.path.join(data.root, pattern)
                if not glob.glob(path):
                    problems.append((f"{field}.paths", f"no file matches {path!r}"))
    for p in range(phases):
        total = sum(s.weights[p] for s in data.sources if len(s.weights) == phases)
        if total == 0:
            problems.append(("data.sources", f"phase {p} weights are all zero"))
        elif not math.isclose(total, 1.0, abs_tol=1e-6):
            problems.append(("data.sources", f"phase {p} weights sum to {total:g}, not 1"))
    return problems
