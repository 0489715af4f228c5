"""`dry_run=compile`: the plan plus what XLA says about the real steps.

Output: progress lines on stderr while it compiles (`compile: ...`), then on stdout the verdict
first (`fits: yes|NO|unknown` with each step's compiled peak against the limit), the dry run's
table and a compiled-memory block (`format_compiled`). `dry_run=compile_json` prints the same as
one JSON object instead: the plan of `dry_run=json` plus the keys below.

The very train and eval steps a run executes (`marin.train.step.jit_steps`: same state layout,
mesh axes, micro-batches) are lowered and compiled ahead of time for ONE replica (a rack: the
replica_dcn replicas are identical) on forced host devices, with shape-only inputs: the state is
`jax.eval_shape`'d and nothing is allocated, so the 535B hero compiles on a laptop-sized CPU.

Per step it reports, per device (GiB = 2^30 bytes):
  argument / output / alias / temp   XLA's memory analysis, device memory only;
  host                               bytes in pinned host memory (offloaded optimizer state and
                                     carries). XLA:CPU counts host buffers as device ones, so
                                     they are read from the compiled HLO (memory space S(5)) and
                                     subtracted from the device figures;
  peak                               argument + output − alias + temp: what the device holds at
                                     the step's high-water mark (donated state counted once);
  collectives                        per kind, executions per step (loop trip counts applied)
                                     and GiB moved per device (the larger side of each
                                     collective: all-gather's output, reduce-scatter's input).
The top level adds `memory_limit_gib` (derive.memory_limit_gib) and `fits` (every step's peak ≤
the limit, and the pinned host bytes within `host_memory_limit_gib` where the hardware has that
figure: `host_fits`; null where the hardware has no memory figure).

`model.ep_transport=ragged` on XLA:CPU (which cannot compile `ragged_all_to_all`): the real step
is lowered and its ragged collectives counted, the compiled figures are a stand-in's with the
same buffer sizes (`train_step.stand_in`), and one `note:` line on stderr says so.

A CPU compile is a close estimate, not a GPU measurement: docs/memory.md, "What a CPU compile can and cannot tell about a GPU".
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import time

from marin.cli import fail
from marin.config import derive
from marin.config.derive import batch_shards
from marin.launch.distributed import FORCED_DEVICES_FLAG
from marin.launch.memory import host_limit_gib
from marin.launch.plan import plan
from marin.model.mesh import MeshError, make_mesh
from marin.optim import build_optimizer

GIB = 2 ** 30
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1}
HOST_SPACE = "S(5)"  # XLA's memory space of pinned host buffers in layouts


class CompilePlanError(ValueError):
    """The config cannot be compiled here (one line for the user)."""


def replica_devices(cfg) -> int:
    """Devices of one replica: the job's devices over replica_dcn."""
    return derive.device_count(cfg.hardware) // cfg.hardware.mesh.replica_dcn


def replica_config(cfg):
    """`cfg` for one replica: replica_dcn = 1 and its share of the global batch, so the
    per-device micro-batch and the gradient accumulation are the run's own. Attention that
    would run through cuDNN on the GPU compiles as the memory-efficient blockwise kernel, and the
    ragged paths' grouped matmuls as XLA's ragged_dot (the Mosaic GPU kernel needs a GPU)."""
    r = copy.deepcopy(cfg)
    replicas = r.hardware.mesh.replica_dcn
    r.hardware.mesh.replica_dcn = 1
    r.train.global_batch //= replicas
    r.train.eval_batch_size = max(1, r.train.eval_batch_size // replicas)   # 64 per rack: one replica's
    if r.attention.impl in ("auto", "cudnn"):
        r.attention.impl = "blockwise"
    if r.model.grouped_matmul in ("auto", "mosaic"):   # the Mosaic GPU kernel lowers only on a GPU
        r.model.grouped_matmul = "xla"
    return r


def force_host_devices(count: int) -> None:
    """Make JAX see `count` CPU devices; must run before JAX starts its backend."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FORCED_DEVICES_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{FORCED_DEVICES_FLAG}={count}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


# --- Reading the compiled HLO ---

def _shapes(text: str) -> list[tuple[float, bool]]:
    """(bytes, in host memory) of every array shape written in `text`, e.g. `f32[8,4]{1,0:S(5)}`."""
    out = []
    for dtype, dims, layout in re.findall(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?", text):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((n * DTYPE_BYTES[dtype], HOST_SPACE in (layout or "")))
    return out


def _split_top(text: str) -> list[str]:
    """Top-level comma-separated parts of `text` (commas inside brackets ignored)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + ([cur] if cur.strip() else [])


def host_bytes(hlo: str, carry_shape: str | None = None) -> dict[str, float]:
    """Bytes in pinned host memory per device, from the compiled HLO: entry arguments, outputs
    and aliased outputs (entry_computation_layout and input_output_alias: memory space S(5)),
    and temporaries.

    XLA:CPU drops in-program placements (a `device_put` to host inside `jit` lowers to nothing
    on CPU), so the stacked layer carries that `model.offload_carry` sends to pinned host memory
    stay in XLA:CPU's device temp: they are found by their shape `carry_shape` (e.g.
    ``f32[48,16,4096,6144]``, one buffer of the layer scan) and counted as host temp instead."""
    header = hlo.split("\n", 1)[0]
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}", header)
    args, outs = (_split_top(layout.group(1)), layout.group(2)) if layout else ([], "")
    outs = _split_top(outs[1:-1]) if outs.startswith("(") else [outs]
    arg_host = [b for a in args for b, host in _shapes(a) if host]
    out_host = [sum(b for b, host in _shapes(o) if host) for o in outs]
    aliased = {int(i) for i in re.findall(r"\{(\d+)\}: \(\d+, \{\}, (?:may|must)-alias\)", header)}
    temp = 0.0
    if carry_shape and carry_shape in hlo:
        temp = sum(b for b, _ in _shapes(carry_shape))
    return {"argument": sum(arg_host), "output": sum(out_host), "temp": temp,
            "alias": sum(out_host[i] for i in aliased if i < len(out_host))}


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        n = 1
        for axis in re.findall(r"'(\w+)'", m.group(2)):
            n *= int(sizes.get(axis, 1))
        return n
    return 1


def collectives(hlo: str) -> dict[str, dict]:
    """{kind: {count, gib}} per step: each collective instruction times the trip counts of the
    while loops around it (scan over layers, micro-batches)."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            comps[name] = []
        elif name is not None and line.startswith("  "):
            comps[name].append(line)
    memo: dict[str, dict] = {}

    def total(comp: str, stack=()) -> dict:
        if comp in memo:
            return memo[comp]
        acc = {k: [0, 0.0] for k in COLLECTIVES}
        for line in comps.get(comp, []):
            op = re.match(r"\s+(?:ROOT )?%\S+ = (.*?) ([a-z\-]+)\(", line)
            if op and op.group(2).removesuffix("-start") in COLLECTIVES:
                kind = op.group(2).removesuffix("-start")
                sizes = [b for b, _ in _shapes(op.group(1))]
                nbytes = max(sizes, default=0) if op.group(2).endswith("-start") else sum(sizes)
                if kind == "reduce-scatter":
                    nbytes *= _group_size(line)
                acc[kind][0] += 1
                acc[kind][1] += nbytes
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            for attr, callee in re.findall(r"(body|calls|to_apply|branch_computations|true_computation|"
                                           r"false_computation)=\{?%([\w.\-]+)", line):
                if callee in stack:
                    continue
                mult = int(trips.group(1)) if attr == "body" and trips else 1
                sub = total(callee, stack + (comp,))
                for k in COLLECTIVES:
                    acc[k][0] += mult * sub[k][0]
                    acc[k][1] += mult * sub[k][1]
            for callee in re.findall(r"branch_computations=\{([^}]*)\}", line):
                for c in re.findall(r"%([\w.\-]+)", callee)[1:]:
                    sub = total(c, stack + (comp,))
                    for k in COLLECTIVES:
                        acc[k][0] += sub[k][0]
                        acc[k][1] += sub[k][1]
        memo[comp] = acc
        return acc

    counts = total("ENTRY")
    return {k: {"count": int(c), "gib": round(b / GIB, 4)} for k, (c, b) in counts.items()}


def progress(line: str) -> None:
    """A progress line on stderr (stdout keeps the result), at once: a compile takes minutes."""
    print(f"compile: {line}", file=sys.stderr, flush=True)


def step_report(lowered_fn, *args, carry_shape: str | None = None, staging: float = 0.0,
                name: str = "step") -> dict:
    """Compile one jitted step on abstract inputs; its memory and collectives.

    With the optimizer state offloaded, the update reads it on the device: XLA:CPU computes on
    host buffers in place, XLA:GPU copies each leaf in and out. `staging` (bytes, see
    `staged_bytes`: the largest host leaf the step copies in whole; `offload_staging_gib`) is
    added to the device peak: the least any schedule stages."""
    progress(f"lowering the {name}")
    t0 = time.perf_counter()
    lowered = lowered_fn.lower(*args)
    t1 = time.perf_counter()
    progress(f"compiling the {name} (lowered in {t1 - t0:.1f} s)")
    compiled = lowered.compile()
    t2 = time.perf_counter()
    progress(f"{name} compiled in {t2 - t1:.1f} s")
    ma = compiled.memory_analysis()
    hlo = compiled.as_text()
    host = host_bytes(hlo, carry_shape)
    # On backends that report host memory themselves (GPU) the device figures exclude it already.
    if ma.host_argument_size_in_bytes or ma.host_temp_size_in_bytes:
        host = {"argument": ma.host_argument_size_in_bytes, "output": ma.host_output_size_in_bytes,
                "alias": ma.host_alias_size_in_bytes, "temp": ma.host_temp_size_in_bytes}
        device = {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
                  "alias": ma.alias_size_in_bytes, "temp": ma.temp_size_in_bytes}
    else:
        device = {"argument": ma.argument_size_in_bytes - host["argument"],
                  "output": ma.output_size_in_bytes - host["output"],
                  "alias": ma.alias_size_in_bytes - host["alias"],
                  "temp": max(0, ma.temp_size_in_bytes - host["temp"])}
    peak = device["argument"] + device["output"] - device["alias"] + device["temp"] + staging
    return {
        "argument_gib": round(device["argument"] / GIB, 6),
        "temp_gib": round(device["temp"] / GIB, 6),
        "output_gib": round(device["output"] / GIB, 6),
        "alias_gib": round(device["alias"] / GIB, 6),
        "host_gib": round((host["argument"] + host["temp"]) / GIB, 6),
        "offload_staging_gib": round(staging / GIB, 6),
        "peak_gib": round(peak / GIB, 6),
        "collectives": collectives(hlo),
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
    }


def staged_bytes(state, shardings) -> float:
    """Per device, the largest leaf of the offloaded optimizer state that the train step copies
    to the device whole (marin.train.step.opt_state_to_device). MuonH's momentum and the
    offloaded fp32 masters are streamed one layer at a time instead: their slices are device
    temporaries of the compiled loop, in XLA's own figure."""
    import jax
    import numpy as np

    from marin.train.state import HOST  # JAX: imported only when this runs
    from marin.train.step import streamed  # JAX: imported only when this runs

    sizes = [np.prod(s.shard_shape(leaf.shape)) * leaf.dtype.itemsize
             for (path, leaf), s in zip(jax.tree_util.tree_flatten_with_path(state.opt_state)[0],
                                        jax.tree.leaves(shardings.opt_state))
             if s.memory_kind == HOST and not streamed(path)]
    return float(max(sizes, default=0.0))


def compile_steps(cfg) -> dict:
    """Lower and compile one replica's train and eval steps; {train_step: ..., eval_step: ...}.
    JAX must already see `replica_devices(cfg)` devices."""
    import jax
    import jax.numpy as jnp

    from marin.train.state import (  # JAX: imported only when this runs
        batch_sharding,
        check_host_memory,
        init_state,
        state_sharding,
    )
    from marin.train.step import hyperparams, jit_steps  # JAX: imported only when this runs

    r = replica_config(cfg)
    if (cfg.optim.offload or cfg.model.offload_carry) and (why := check_host_memory()) is not None:
        raise CompilePlanError(why)
    try:
        mesh = make_mesh(r)
    except MeshError as err:
        raise CompilePlanError(str(err)) from None
    tx = build_optimizer(r)
    abstract = jax.eval_shape(lambda k: init_state(r, tx, k), jax.random.key(0))
    shardings = state_sharding(r, abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    rows, spec = (r.train.global_batch, r.train.seq_len), batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(rows, dtype, sharding=spec) for k, dtype in
             (("inputs", jnp.int32), ("targets", jnp.int32), ("segment_ids", jnp.int32), ("loss_mask", jnp.float32))}
    eval_batch = {k: jax.ShapeDtypeStruct((r.train.eval_batch_size, r.train.eval_seq_len), v.dtype, sharding=spec)
                  for k, v in batch.items()}  # evaluation's own batch; a context stage scores at pretraining's length
    hp = hyperparams(r, mesh)  # the optimizer's numbers: an input of the step
    stand_in = None
    if r.model.ep_transport == "ragged" and r.hardware.mesh.expert > 1 and jax.default_backend() == "cpu":
        stand_in = ragged_stand_in(r, tx, mesh, shardings, state, batch, hp)
    train_step, eval_step = jit_steps(r, tx, mesh, shardings)
    carry = None
    if r.model.offload_carry:  # the layer scan's stacked carries [L, rows per device, T, d]
        from marin.train.step import num_microbatches  # JAX: imported only when this runs

        per_device = r.train.global_batch // batch_shards(r.hardware) // num_microbatches(r)
        # a 16-bit carry is staged as its raw bits (marin.model.transformer.name_carry)
        dtype = {"bfloat16": "u16", "float16": "u16"}.get(str(getattr(r.model, "residual_dtype", "float32")), "f32")
        carry = f"{dtype}[{r.model.num_layers},{per_device},{r.train.seq_len},{r.model.d_model}]"
    staging = staged_bytes(abstract, shardings) if r.optim.offload else 0.0
    try:
        out = {"train_step": step_report(train_step, state, batch, hp, carry_shape=carry, staging=staging,
                                         name="train step"),
               "eval_step": step_report(eval_step, state, eval_batch, name="eval step")}
    finally:
        if stand_in is not None:
            stand_in.pop("_restore")()
    if stand_in is not None:
        out["train_step"]["stand_in"] = stand_in
    return out


RAGGED_NOTE = ("XLA:CPU cannot compile ragged_all_to_all (ThunkEmitter: not supported): the train step's memory "
               "and collectives are those of a stand-in with the same buffers (all_to_all + batched matmuls)")


def ragged_stand_in(r, tx, mesh, shardings, state, batch, hp) -> dict:
    """`model.ep_transport=ragged` on XLA:CPU, which lowers `ragged_all_to_all` but cannot compile
    it: the real train step is lowered (its ragged collectives counted from the StableHLO), then
    `expert_parallel`'s hooks are swapped for stand-ins with the same buffer sizes
    (`stand_in_ragged_all_to_all`, `stand_in_grouped_matmul`) so the compiled memory figure is
    the ragged transport's. Returns what it did (and a `_restore` to undo the swap)."""
    import jax

    from marin.model import expert_parallel as ep  # JAX: imported only when this runs
    from marin.train import step  # JAX: imported only when this runs

    real_train, _ = step._jit_steps(r, tx, mesh, shardings)   # not memoised: the stand-in's is traced anew
    text = real_train.lower(state, batch, hp).as_text()
    del real_train
    saved = ep.RAGGED_ALL_TO_ALL, ep.GROUPED_MATMUL
    ep.RAGGED_ALL_TO_ALL, ep.GROUPED_MATMUL = ep.stand_in_ragged_all_to_all, ep.stand_in_grouped_matmul
    step._JITTED.clear()
    jax.clear_caches()

    def restore():
        ep.RAGGED_ALL_TO_ALL, ep.GROUPED_MATMUL = saved
        step._JITTED.clear()

    print(f"note: {RAGGED_NOTE}", file=sys.stderr)
    return {"note": RAGGED_NOTE, "lowered_ragged_all_to_all": text.count("ragged_all_to_all"),
            "lowered_ragged_dot": text.count("ragged_dot"), "_restore": restore}


def compile_plan(cfg) -> dict:
    """Everything `dry_run=json` prints, plus `compiled`, `memory_limit_gib` and `fits`."""
    out = plan(cfg)
    r = replica_config(cfg)
    steps = compile_steps(cfg)
    out["compiled"] = {
        **steps,
        "replica": {"devices": replica_devices(cfg), "global_batch": r.train.global_batch,
                    "mesh": {"data": r.hardware.mesh.data, "expert": r.hardware.mesh.expert,
                             "model": r.hardware.mesh.model},
                    "backend": "cpu (forced host devices)"},
        "layout": {"fsdp": cfg.hardware.mesh.fsdp, "optim_offload": cfg.optim.offload,
                   "remat": derive.remat_mode(cfg.model.remat), "offload_carry": cfg.model.offload_carry,
                   "attention_impl": r.attention.impl},
    }
    out["estimate_fits"] = out["fits"]  # the plan's verdict from the estimate; `fits` is now the compiled one
    out["memory_limit_gib"], out["fits"] = fits(steps, derive.memory_limit_gib(cfg.hardware))
    host_limit = host_limit_gib(cfg.hardware)
    out["host_memory_limit_gib"] = "unknown" if host_limit is None else round(host_limit, 3)
    host = max(s["host_gib"] for s in steps.values())
    out["host_fits"] = None if host_limit is None else host <= host_limit
    if out["fits"] is not None and out["host_fits"] is False:
        out["fits"] = False
    return out


def fits(steps: dict, limit: float | None) -> tuple:
    """(memory_limit_gib, fits): every step's device peak within the limit; ("unknown", None)
    where the hardware has no memory figure."""
    if limit is None:
        return "unknown", None
    return round(limit, 3), all(s["peak_gib"] <= limit for s in steps.values())


def verdict(result: dict) -> str:
    """The first line: whether one replica's compiled steps fit, with the figures behind it."""
    steps = result["compiled"]
    peaks = ", ".join(f"{name.replace('_', ' ')} {steps[name]['peak_gib']:.4g} GiB" for name in ("train_step", "eval_step"))
    word = {True: "yes", False: "NO", None: "unknown"}[result["fits"]]
    limit = result["memory_limit_gib"]
    limit = f"limit {limit:.1f} GiB" if isinstance(limit, (int, float)) else "no memory figure for this hardware"
    host = max(steps[name]["host_gib"] for name in ("train_step", "eval_step"))
    host_limit = result.get("host_memory_limit_gib")
    host_text = f"; pinned host {host:.4g} GiB" + (f" of {host_limit:.1f}" if isinstance(host_limit, (int, float)) else "") \
        if host else ""
    return f"fits: {word} (compiled peak per device: {peaks}; {limit}{host_text})"


def format_compiled(result: dict) -> str:
    """The human form of `compile_plan`: the verdict, the dry run's table, the compiled steps."""
    from marin.launch.plan import format_plan

    steps, replica = result["compiled"], result["compiled"]["replica"]
    table = format_plan({**result, "fits": result.get("estimate_fits", result["fits"])})
    head = f"  {'step':<10}{'peak':>9}{'argument':>10}{'output':>9}{'alias':>9}{'temp':>9}{'host':>9}{'staging':>9}{'compile':>9}"
    rows = [f"  {name.replace('_step', ''):<10}{s['peak_gib']:>9.4g}{s['argument_gib']:>10.4g}{s['output_gib']:>9.4g}"
            f"{s['alias_gib']:>9.4g}{s['temp_gib']:>9.4g}{s['host_gib']:>9.4g}{s['offload_staging_gib']:>9.4g}"
            f"{s['compile_s']:>8.1f}s" for name, s in steps.items() if name.endswith("_step")]
    moved = ", ".join(f"{kind} {c['count']}× {c['gib']:.4g} GiB" for kind, c in steps["train_step"]["collectives"].items()
                      if c["count"])
    mesh = " × ".join(f"{k} {v}" for k, v in replica["mesh"].items())
    lines = [verdict(result), "", table, "",
             f"compiled (XLA, one replica: {replica['devices']} {replica['backend']}, {mesh}, "
             f"global batch {replica['global_batch']:,}; GiB per device)", head, *rows,
             f"  collectives per train step: {moved or 'none'}"]
    if "stand_in" in steps["train_step"]:
        lines.append("  (ragged transport: the train step's figures are a same-buffers stand-in's)")
    lines.append("(dry_run=compile_json prints all of this as one JSON object)")
    return "\n".join(lines)


def run(cfg, as_json: bool = False) -> None:
    """The `dry_run=compile` entry: force the replica's devices, compile, print the verdict and
    tables (`as_json`: one JSON object). A config this machine cannot compile prints one line and
    exits with status 2."""
    devices = replica_devices(cfg)
    if "jax" in sys.modules:
        import jax

        if jax.device_count() != devices or jax.default_backend() != "cpu":
            fail(f"dry_run=compile: JAX already started with {jax.device_count()} {jax.default_backend()} "
                 f"device(s); one replica of hardware {cfg.hardware.name} needs {devices} CPU devices "
                 "(run it in a fresh process)")
    else:
        force_host_devices(devices)
    progress(f"one replica of {cfg.hardware.name} on {devices} forced CPU devices; nothing is allocated "
             "(the hero takes about a minute on 2 cores)")
    try:
        result = compile_plan(cfg)
    except CompilePlanError as err:
        fail(str(err))
    print(json.dumps(result, indent=2) if as_json else format_compiled(result))
