"""Where one train step's kernel time goes, by model part (benchmarks/gpu.py's `profile`).

One step runs under `jax.profiler`; every kernel event that names its HLO instruction (`hlo_op`:
the GPU streams' kernels, XLA:CPU's thunks) is looked up in the compiled module's text for that
instruction's `op_name` metadata, the path JAX wrote from the Flax modules and named scopes
(`…/layers/attn/…`, `…/moe/routing/…`), and the time is summed by part. On a GPU the profiled
process runs without XLA's command buffers (CUDA graphs hide the kernels inside one event each);
the timed steps of `steps` keep them.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile
import time
from collections import Counter, defaultdict

# First match wins; the rest is "other" (norms, convolutions, embedding, copies XLA inserted). The
# scopes are the model's own names: Flax modules (attn, moe, head) and the
# named scopes of marin/model (routing, expert_gemm, head_loss) and marin/train/step.py (optimizer).
PARTS = [
    ("optimizer", re.compile(r"/optimizer/|optax|muon|newton|scale_by")),
    ("head and loss", re.compile(r"head_loss|/head/|cross_entropy|logsumexp")),
    ("attention", re.compile(r"/attn/")),
    ("routing", re.compile(r"/routing/|/router|histogram|quantile")),
    ("expert GEMMs", re.compile(r"/expert_gemm/|/shared_")),
    ("dispatch", re.compile(r"/moe/")),
    # The layer scan's own data movement: each layer's slice of the stacked parameters read, its
    # outputs (residuals, gradients) written into the stacked [L, ...] buffers.
    ("layer scan", re.compile(r"dynamic_(update_)?index_in_dim")),
]
KERNEL_CLASSES = [
    ("host copy", re.compile(r"memcpy.*(htod|dtoh|h2d|d2h)|MemcpyH|MemcpyD2H|MemcpyH2D", re.I)),
    ("device copy", re.compile(r"memcpy|memset", re.I)),
    ("attention kernel", re.compile(r"cudnn|fmha|flash|sdpa", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|triton_dot|\bdot\b|ragged|mosaic", re.I)),
    ("sort", re.compile(r"sort|radix", re.I)),
    ("scatter", re.compile(r"scatter", re.I)),
    ("gather/slice", re.compile(r"gather|dynamic.?slice|dynamic.?update", re.I)),
]
# Events of these wrap other events (XLA:CPU's control-flow thunks): counting them would count twice.
CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
# name = shape opcode(...): the shape may be a tuple with spaces (a while's state), so the opcode is
# the first word that opens a parenthesis after a space.
_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def hlo_index(text: str) -> dict[str, tuple[str, str]]:
    """instruction name → (opcode and custom-call target, op_name). A fusion without metadata of its own takes the
    op_name of the first instruction inside its fused computation that has one."""
    index, calls, first_in = {}, {}, {}
    computation = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = line.split()[0].lstrip("%") if not line.startswith("ENTRY") else line.split()[1].lstrip("%")
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        name, opcode = found.groups()
        op_name = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]+)"', line)   # __cublas$gemm, __cudnn$fmha…
        index[name] = (f"{opcode} {target.group(1)}" if target else opcode, op_name.group(1) if op_name else "")
        if op_name and computation and computation not in first_in:
            first_in[computation] = op_name.group(1)
        called = _CALLS.search(line)
        if called:
            calls[name] = called.group(1)
    for name, (opcode, op_name) in index.items():
        if not op_name and name in calls:
            index[name] = (opcode, first_in.get(calls[name], ""))
    return index


def part_of(op_name: str) -> str:
    for part, pattern in PARTS:
        if pattern.search(op_name):
            return part
    return "other"


def kernel_class(kernel: str, opcode: str) -> str:
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(kernel) or pattern.search(opcode):
            return cls
    return "elementwise/reduction"


def _events(path: str):
    """(kernel name, hlo_op, duration ns) of every kernel event that names its instruction."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(path)
    for plane in data.planes:
        if not (plane.name.startswith("/device:") or plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats and not event.name.startswith("end:"):
                    yield event.name, str(stats["hlo_op"]), float(event.duration_ns)


def profile_step(run_one, hlo_text: str, top: int = 20) -> dict:
    """Profile one call of run_one() (one train step); its kernel time by part and by class."""
    import jax
    folder = tempfile.mkdtemp(prefix="marin_gpu_profile_")
    jax.profiler.start_trace(folder)
    start = time.perf_counter()
    jax.block_until_ready(run_one())
    wall_ms = (time.perf_counter() - start) * 1e3
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise RuntimeError(f"the profiler wrote no .xplane.pb under {folder}")
    index = hlo_index(hlo_text)
    by_part, by_class, by_op = defaultdict(float), defaultdict(float), defaultdict(lambda: [0.0, 0, "", ""])
    unmatched = 0.0
    for kernel, hlo_op, ns in _events(files[0]):
        opcode, op_name = index.get(hlo_op, ("", ""))
        if opcode.split(" ")[0] in CONTAINERS:
            continue
        if not op_name:
            unmatched += ns
        part = part_of(op_name)
        by_part[part] += ns
        by_class[kernel_class(kernel, opcode)] += ns
        row = by_op[hlo_op]
        row[0] += ns
        row[1] += 1
        row[2], row[3] = part, kernel
    total = sum(by_part.values()) or 1.0
    ms = lambda ns: round(ns / 1e6, 3)
    return {
        "wall_ms": round(wall_ms, 2), "kernel_ms": ms(total),
        "by_part_ms": {k: ms(v) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
        "by_class_ms": {k: ms(v) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "unattributed_ms": ms(unmatched),
        # How many of the step's instructions each part holds: unlike the times, this does not move
        # when a thread of a shared machine is descheduled mid-kernel.
        "ops_by_part": dict(sorted(Counter(row[2] for row in by_op.values()).items(), key=lambda kv: -kv[1])),
        "matmul_and_attention_share": (by_class["GEMM"] + by_class["attention kernel"]) / total,
        "top_ops": [{"op": op, "ms": ms(v[0]), "count": v[1], "part": v[2], "kernel": v[3][:60]}
                    for op, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]],
    }
