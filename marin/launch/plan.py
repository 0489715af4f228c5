"""The dry run: what a resolved config would train, on what, at what cost, and what would be
submitted, as a readable table or as one JSON object (`dry_run=json`, stdout only).

Every number comes from `marin.config.derive` (already resolved), `marin.model.accounting` and,
for the data epochs, `marin.data.mixture`; the Slurm request is the launcher's own. Pure Python:
no JAX and no data or tokenizer files (only the config's cells file), so the 535B plan prints in
about a second.
"""
from __future__ import annotations

import json
import sys

from marin.config import derive
from marin.config.schema import Config
from marin.data import mixture
from marin.launch.memory import (device_peak, fits, host_fits, host_limit_gib, offload_reason, over_machine_memory,
                                 over_memory)
from marin.launch.slurm import describe, slurm_parameters
from marin.model import accounting
from marin.optim.decay import describe as decay_lines

MFU_FOR_DAYS = 0.2  # the low end of the published run's 20–23% MFU (spec §6)
DATA_ROWS = 12      # the table lists the most repeated sources; the JSON lists all


def plan(cfg: Config) -> dict:
    """The plan of a resolved config as plain JSON-able values."""
    s = accounting.Shapes.of(cfg)
    t, hw, o = cfg.train, cfg.hardware, cfg.optim
    tokens_per_step = t.seq_len * t.global_batch
    first, last = derive.stage_steps(cfg)  # a context-extension stage trains only its own part
    steps = last - first
    tokens = steps * tokens_per_step
    train_flops = accounting.train_flops(cfg, steps=steps)
    devices = derive.device_count(hw)
    memory = accounting.memory_per_device(cfg)
    out = {
        "run": {"name": cfg.run.name, "experiment": cfg.run.experiment},
        "model": {
            "d_model": s.d, "num_layers": s.L, "global_layers": sum(s.global_layers),
            "num_heads": s.H, "head_dim": s.h, "kv_heads_local": s.kv_local,
            "kv_heads_global": s.kv_global, "window": cfg.attention.window,
            "qk_mult": cfg.attention.qk_mult, "num_experts": s.E, "top_k": s.k,
            "latent_dim": s.latent, "expert_width": s.I, "num_shared_experts": s.S,
            "shared_width": s.I_s, "vocab_size": s.V, "gated_norm_rank": s.r,
            "router": cfg.router.kind, "capacity_factor": cfg.model.capacity_factor,
            "ep_transport": cfg.model.ep_transport, "ep_send_capacity_factor": cfg.model.ep_send_capacity_factor,
            "ep_recv_capacity_factor": cfg.model.ep_recv_capacity_factor, "ep_waves": cfg.model.ep_waves,
            "ep_expert_chunks": cfg.model.ep_expert_chunks, "expert_parallel": hw.mesh.expert,
        },
        "total_params": accounting.total_params_of(s),
        "total_params_all_leaves": accounting.all_leaves_of(s),
        "active_params": accounting.active_params_of(s),
        "flops_per_token": accounting.flops_per_token(cfg),
        "flops_per_token_no_head": accounting.flops_per_token(cfg, with_head=False),
        "train_flops": float(train_flops),
        "train_flops_no_head": float(accounting.train_flops(cfg, with_head=False, steps=steps)),
        "forecast_C": float(accounting.forecast_flops(cfg)),  # the ladder forecast's C over the run's horizon
        "forecast_global_layers": sum(accounting.forecast_shapes(cfg).global_layers),
        "steps": steps,
        "run_steps": t.steps,
        "tokens": tokens,
        "seq_len": t.seq_len,
        "global_batch": t.global_batch,
        "micro_batch": t.micro_batch,
        "tokens_per_step": tokens_per_step,
        "optimizer": o.name,
        "lr": derive.group_lrs(cfg),
        "b1": o.b1,
        "b2": o.b2,
        "eps": o.eps,
        "warmup_steps": derive.warmup_steps(cfg),
        "decay": decay_lines(cfg),  # optim.decay: each rule's line and where it switches on
        "final_lr_ratio": cfg.schedule.final_ratio,
        "hardware": hw.name,
        "racks": hw.racks,
        "mesh": {"replica_dcn": hw.mesh.replica_dcn, "data": hw.mesh.data,
                 "expert": hw.mesh.expert, "model": hw.mesh.model},
        "devices": devices,
        "remat": derive.remat_mode(cfg.model.remat),
        "layout": layout(cfg),
        "memory_per_device_gib": memory["total"],
        "memory_parts_gib": {k: v for k, v in memory.items() if k not in ("total", "host", "peak_phase")},
        "memory_peak_phase": accounting.PHASES[memory["peak_phase"]],
        "memory_eval_per_device_gib": accounting.eval_memory_per_device(cfg),
        # what `dry_run=compile` (XLA:CPU, bf16 buffers held in fp32) should report; a verdict
        # takes the larger of it and the GPU figure above (marin.launch.memory.verdict_backends)
        "memory_cpu_compile_gib": accounting.memory_per_device(cfg, backend="cpu")["total"],
        "memory_eval_cpu_compile_gib": accounting.eval_memory_per_device(cfg, backend="cpu"),
        "memory_backend": accounting.backend_of(cfg),
        "memory_host_gib": memory["host"],  # optim.offload / model.offload_carry: pinned host memory
        "memory_host_limit_gib": host_limit_gib(hw),  # hardware.host_memory_per_device_gib (None: no figure)
        "host_fits": host_fits(cfg, memory["host"]),
        "memory_limit_gib": derive.memory_limit_gib(hw),
        "fits": fits(cfg, device_peak(cfg)),
        "offload": offload(cfg),
    }
    out["evaluation"] = evaluation(cfg)
    out["checkpoints"] = checkpoints(cfg)
    if t.init_from is not None or t.init_seq_len is not None:
        out["init"] = {"from": t.init_from, "mode": t.init_from_mode, "seq_lens": derive.stage_seq_lens(cfg),
                       "first_step": first, "last_step": last,
                       # the recipe the stage keeps (spec §9 "Context launcher"): stated, not implied
                       "qk_mult": cfg.attention.qk_mult,
                       "qk_mult_rule": derive.qk_mult_through(cfg.attention.qk_mult_base, derive.stage_seq_lens(cfg)),
                       "eval_seq_len": cfg.train.eval_seq_len, "transport": cfg.model.ep_transport,
                       "mixture": cfg.data.name, "shuffle_window": cfg.data.shuffle_window,
                       "decay": [{"pattern": r.pattern, "start": r.start} for r in cfg.optim.decay]}
    if hw.peak_flops_per_device > 0:
        out["days_at_20pct_mfu"] = train_flops / (devices * hw.peak_flops_per_device * MFU_FOR_DAYS) / 86400
    if hw.launcher == "slurm":
        out["submission"] = submission(cfg)
    epochs = data_epochs(cfg)
    if epochs is not None:
        out["data"] = epochs
        out["data_phases"] = list(cfg.data.phase_names)
        out["data_phase_starts"] = derive.phase_boundary_steps(cfg)
    if (simulated := mixture.simulated_summary(cfg)) is not None:
        out["simulated_epoching"] = simulated
    return out


def offload(cfg: Config) -> dict:
    """The offload switches as resolved (`auto` from the memory plan), why, and what they move
    over the host link per step (bytes per device) and how long that takes at hardware.host_link_gbps."""
    traffic = accounting.host_traffic(cfg)
    return {"optim": cfg.optim.offload, "carry": cfg.model.offload_carry, "reason": offload_reason(cfg),
            "host_to_device_bytes": traffic["in"], "device_to_host_bytes": traffic["out"],
            "bytes_by_part": {k: v for k, v in traffic.items() if k not in ("in", "out")},
            "host_link_gbps": cfg.hardware.host_link_gbps,
            "host_link_seconds_per_step": accounting.host_link_seconds(cfg, traffic)}


def _offload_rows(o: dict) -> list[tuple[str, str]]:
    """The plan table's offload lines: the switches and why, the bytes moved and their time."""
    switches = f"optimizer {'on' if o['optim'] else 'off'}, carries {'on' if o['carry'] else 'off'}"
    rows = [("offload", f"{switches}  ({o['reason']})")]
    if o["host_to_device_bytes"] or o["device_to_host_bytes"]:
        parts = o["bytes_by_part"]
        by = ", ".join(f"{name} {parts[name + '_in'] / 1e9:.3g}/{parts[name + '_out'] / 1e9:.3g}"
                       for name in ("optimizer", "masters", "carries") if parts[name + "_in"] or parts[name + "_out"])
        secs = o["host_link_seconds_per_step"]
        time = ("host_link_gbps unknown" if secs is None else
                f"{secs:.3g} s at {o['host_link_gbps']:g} GB/s per direction")
        rows.append(("host link / step", f"{o['host_to_device_bytes'] / 1e9:.3g} GB in, "
                                         f"{o['device_to_host_bytes'] / 1e9:.3g} GB out ({by} GB in/out); {time}"))
    return rows


def layout(cfg: Config) -> dict:
    """The layout the memory estimate models (as `dry_run=compile` reports it under `compiled`)."""
    return {"fsdp": cfg.hardware.mesh.fsdp, "optim_offload": cfg.optim.offload,
            "remat": derive.remat_mode(cfg.model.remat), "offload_carry": cfg.model.offload_carry,
            "expert_masters_on_host": accounting.offloaded_masters(cfg),
            "attention_impl": cfg.attention.impl, "attention_kernel": derive.attention_kernel(cfg),
            "micro_batches": accounting.micro_batches(cfg)}


def evaluation(cfg: Config) -> dict:
    """How the run is evaluated and what its loss scores (spec §9: eval batches, the with-drops
    pass, the headline metric; data.loss_targets)."""
    t = cfg.train
    return {"batch_size": t.eval_batch_size, "seq_len": t.eval_seq_len, "every": t.eval_every,
            "batches": t.eval_batches, "sets": [s.name for s in cfg.data.eval_sets],
            "with_drops": cfg.eval.with_drops, "headline": cfg.eval.headline,
            "loss_targets": cfg.data.loss_targets}


def checkpoints(cfg: Config) -> dict:
    """Retention and where the run stops (train.checkpoint, stop_at / stop_after)."""
    c, t = cfg.train.checkpoint, cfg.train
    return {"every_minutes": c.every_minutes, "every_steps": c.every_steps, "keep_last": c.keep_last,
            "permanent_every": c.permanent_every, "permanent_steps": list(c.permanent_steps),
            "stop_at": t.stop_at, "stop_after": t.stop_after}


def submission(cfg: Config) -> dict:
    """What a Slurm launch would request: the launcher's own submitit parameters (so the plan
    cannot drift from the submission), plus the totals."""
    hw = cfg.hardware
    return {**slurm_parameters(cfg), "gpus_per_node": hw.gpus_per_node,
            "tasks": derive.process_count(hw), "max_requeues": hw.max_requeues}


def data_epochs(cfg: Config) -> dict | None:
    """{source: [epochs in each phase]} over the run, if the mixture module offers them (from
    the configured token counts only: the dry run reads no data)."""
    epochs_per_source = getattr(mixture, "epochs_per_source", None)
    return None if epochs_per_source is None else epochs_per_source(cfg)


# --- The readable table ---

def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f}{unit}  ({n:,})"
    return f"{n:,}"


def _rows(p: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    m = p["model"]
    sections = [
        (f"run {p['run']['name']}" + (f"  (experiment {p['run']['experiment']})" if p["run"]["experiment"] else ""), []),
        ("model", [
            ("width × layers", f"{m['d_model']} × {m['num_layers']}  ({m['global_layers']} global, window {m['window']})"),
            ("attention", f"{m['num_heads']} heads × {m['head_dim']}, KV {m['kv_heads_local']} local / "
                          f"{m['kv_heads_global']} global, qk_mult {m['qk_mult']:.4f}"),
            ("experts", f"{m['num_experts']} top-{m['top_k']} ({m['router']}, capacity {m['capacity_factor']}), "
                        f"latent {m['latent_dim']}, width {m['expert_width']}"),
            ("expert transport", _transport(m)),
            ("shared experts", f"{m['num_shared_experts']} × width {m['shared_width']}"),
            ("vocabulary", f"{m['vocab_size']:,}  (GatedNorm rank {m['gated_norm_rank']})"),
        ]),
        ("size and compute", [
            ("total params (matrices)", _count(p["total_params"])),
            ("total params (all leaves)", _count(p["total_params_all_leaves"])),
            ("active params", _count(p["active_params"])),
            ("FLOPs / token (fwd)", f"{p['flops_per_token']:.4e}  (no head {p['flops_per_token_no_head']:.4e})"),
            ("train FLOPs", f"{p['train_flops']:.4e}  (no head {p['train_flops_no_head']:.4e})"),
            ("forecast C", f"{p['forecast_C']:.4e}  (no head, the run's horizon: the ladder forecast's C)"),
        ] + _forecast_layers(p) + ([("days at 20% MFU", f"{p['days_at_20pct_mfu']:.1f}")] if "days_at_20pct_mfu" in p else [])),
        ("schedule", [
            ("steps", f"{p['steps']:,}  (warmup {p['warmup_steps']:,}: lr 0 at step 0, the peak at step "
                      f"{p['warmup_steps']:,}; final lr × {p['final_lr_ratio']})"),
            ("tokens", _count(p["tokens"])),
            ("seq_len × global batch", f"{p['seq_len']:,} × {p['global_batch']:,} = {p['tokens_per_step']:,} tokens/step"),
            ("micro batch / device", f"{p['micro_batch']}"),
            ("optimizer", f"{p['optimizer']}: " + ", ".join(f"lr[{g}] {v:.4e}" for g, v in p["lr"].items())),
            ("b1, b2, eps", f"{p['b1']}, {p['b2']:.6g}, {p['eps']:.4e}"),
        ] + [("decay" if i == 0 else "", line) for i, line in enumerate(p.get("decay", []))]),
        ("layout", [
            ("hardware", p["hardware"] + (f" × {p['racks']} racks" if p.get("racks", 1) != 1 else "")),
            ("mesh", " × ".join(f"{k} {v}" for k, v in p["mesh"].items()) + f" = {p['devices']} devices"),
            ("memory / device", f"{p['memory_per_device_gib']:.1f} GiB  ({p.get('memory_backend', 'cpu')} estimate, peak in the "
                                f"{p['memory_peak_phase']} phase; {_layout(p['layout'])})"
                                + ("" if p["fits"] is None else
                                   f"; limit {p['memory_limit_gib']:.1f} GiB: {'fits' if p['fits'] else 'DOES NOT FIT'}")),
        ] + [(f"  {k}", f"{v:.2f} GiB") for k, v in p["memory_parts_gib"].items()]
          + [("eval step / device", f"{p['memory_eval_per_device_gib']:.1f} GiB  (estimate)")]
          + ([("CPU compile / device", f"{p['memory_cpu_compile_gib']:.1f} GiB train, {p['memory_eval_cpu_compile_gib']:.1f} "
                                       "eval  (estimate of dry_run=compile; the verdict takes the larger)")]
             if p.get("memory_backend", "cpu") != "cpu" else [])
          + ([("host memory / device", f"{p['memory_host_gib']:.1f} GiB  (offloaded)" + (
              "" if p["host_fits"] is None else
              f"; limit {p['memory_host_limit_gib']:.1f} GiB: {'fits' if p['host_fits'] else 'DOES NOT FIT'}"))]
             if p["memory_host_gib"] else [])
          + (_offload_rows(p["offload"]) if "offload" in p else [])),
    ]
    if "evaluation" in p:   # plans saved before these fields have neither
        sections.append(("evaluation and checkpoints", _evaluation_rows(p["evaluation"]) + _checkpoint_rows(p["checkpoints"])))
    if "init" in p:
        sections.append(("context extension", [
            ("init from", f"{p['init']['from']} ({p['init'].get('mode', 'continue')} mode)"),
            ("sequence lengths", " → ".join(f"{n:,}" for n in p["init"]["seq_lens"])),
            ("stage steps", f"{p['init']['first_step']:,} → {p['init']['last_step']:,} of the run's "
                            f"{p['run_steps']:,} (steps, tokens and FLOPs above are the stage's)"),
            *_stage_rows(p["init"]),
        ]))
    if p.get("data"):
        most = sorted(p["data"].items(), key=lambda kv: (-max(kv[1], default=0.0), kv[0]))
        rows = [(name, " / ".join(f"{e:.3f}" for e in epochs)) for name, epochs in most[:DATA_ROWS]]
        if len(most) > DATA_ROWS:
            rows.append(("…", f"{len(most) - DATA_ROWS} more (dry_run=json lists all)"))
        phases = " / ".join(p["data_phases"])
        starts = ", ".join(f"{s:,}" for s in p.get("data_phase_starts", []))
        starts = f"; later phases from step {starts}" if starts else ""
        sections.append((f"data: epochs per source in {phases} (most repeated first{starts})",
                         _simulated_rows(p.get("simulated_epoching")) + rows))
    return sections


def _evaluation_rows(e: dict) -> list[tuple[str, str]]:
    batches = "every batch" if e["batches"] is None else f"{e['batches']} batch(es)"
    every = "only at the end" if e["every"] == 0 else f"every {e['every']:,} steps"
    return [("eval", f"{batches} of {e['batch_size']:,} × {e['seq_len']:,} tokens per set ({', '.join(e['sets']) or 'none'}), "
                     f"{every}; with-drops pass {'on' if e['with_drops'] else 'off'}"),
            ("headline metric", e["headline"]),
            ("loss targets", e["loss_targets"] + ("  (Levanter's: T−1 a row, boundary targets scored)"
                                                  if e["loss_targets"] == "causal" else "  (same-document targets only)"))]


def _checkpoint_rows(c: dict) -> list[tuple[str, str]]:
    rolling = [f"every {c['every_minutes']:g} min" if c["every_minutes"] else "",
               f"every {c['every_steps']:,} steps" if c["every_steps"] else ""]
    permanent = ([f"every {c['permanent_every']:,} steps"] if c["permanent_every"] else []) + \
        [f"{s:,}" for s in c["permanent_steps"]]
    stop = (f"; stops at step {c['stop_at']:,} (train.stop_at)" if c["stop_at"] else "") + \
        (f"; stops after step {c['stop_after']:,}" if c["stop_after"] else "")
    return [("checkpoints", f"rolling {' and '.join(r for r in rolling if r) or 'at the end only'}, "
                            f"{c['keep_last']} kept; permanent {', '.join(permanent) or 'none'}{stop}")]


def _forecast_layers(p: dict) -> list[tuple[str, str]]:
    """Why C counts fewer global layers than the model runs (forecast.c_last_layer_global false)."""
    counted, runs = p["forecast_global_layers"], p["model"]["global_layers"]
    if counted == runs:
        return []
    return [("", f"C counts {counted} global layers, the model runs {runs}: Marin's ladder FLOPs took every 4th "
                 "layer as global, not the last one too (forecast.c_last_layer_global false), and the "
                 "published C is that count")]


def _simulated_rows(sim: dict | None) -> list[tuple[str, str]]:
    """data.simulated_epoching in one line: on (each cell's share, how many repeat) or off and why."""
    if sim is None:
        return []
    if not sim["on"]:
        return [("simulated epoching", f"off: the run's {sim['run_flops']:.3g} training FLOPs are above "
                                       f"data.simulated_epoching.below_flops {sim['below_flops']:.3g}: whole cells")]
    return [("simulated epoching", f"on: each cell cut to {sim['fraction']:.4%} of its tokens (the run's "
                                   f"{_short(sim['run_tokens'])} of a {sim['target_tokens'] / 1e12:g}T-token target), "
                                   f"so epochs are the target's: {sim['cells_repeated']} of {sim['cells']} "
                                   f"cells repeat, at most {sim['max_epochs']:.2f} epochs")]


def _stage_rows(init: dict) -> list[tuple[str, str]]:
    """What a context stage keeps of the run before it, as the dry run shows it."""
    if "qk_mult" not in init:  # a plan saved before these fields
        return []
    decay = ", ".join(f"{d['pattern']} from step {d['start']:,}" if d["start"] else d["pattern"]
                      for d in init["decay"]) or "none"
    window = f"{init['shuffle_window']:,}-token shuffle windows" if init["shuffle_window"] else "no shuffle window"
    return [("qk_mult", f"{init['qk_mult']:.5g} (stated; the §7 rule gives {init['qk_mult_rule']:.5g})"),
            ("eval seq_len", f"{init['eval_seq_len']:,}"),
            ("kept", f"{init['transport']} transport; mixture {init['mixture']}; decay {decay}"),
            ("read positions", f"each source at its next whole chunk ({window})")]


def _layout(lay: dict) -> str:
    """The modelled layout in words, e.g. 'remat full, FSDP, optimizer state on host, carries on host'."""
    words = [f"remat {lay['remat']}", f"{lay['attention_kernel']} attention", f"{lay['micro_batches']} micro-batch(es)"]
    words += [w for on, w in ((lay["fsdp"], "FSDP"), (lay["optim_offload"], "optimizer state on host"),
                              (lay["expert_masters_on_host"], "expert masters on host"),
                              (lay["offload_carry"], "carries on host")) if on]
    return ", ".join(words)


def format_plan(p: dict) -> str:
    sections = _rows(p)
    width = max(len(k) for _, rows in sections for k, _ in rows)
    lines = []
    for title, rows in sections:
        lines.append(title)
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def print_plan(cfg: Config, as_json: bool = False) -> None:
    p = plan(cfg)
    if as_json:
        print(json.dumps(p, indent=2))
        return
    print(format_plan(p))
    for warning in (over_memory(cfg), over_machine_memory(cfg)):
        if warning is not None:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    if "submission" in p:
        print(describe(cfg))


# --- A multirun dry run: one row per job ---

ROW = "{job:>5}  {shape:>9}  {active:>9}  {steps:>9}  {tokens:>9}  {flops:>10}  {lr:>10}  {memory:>18}  {overrides}"


def row_header() -> str:
    return ROW.format(job="job", shape="d × L", active="active", steps="steps", tokens="tokens", flops="train FLOPs",
                      lr="lr", memory="memory / device", overrides="overrides")


def plan_row(p: dict, job: str, overrides: str) -> str:
    """One line of a multirun dry run (`launch.py -m ... dry_run=true`): what differs between jobs."""
    m = p["model"]
    memory = f"{p['memory_per_device_gib']:.3g} GiB" + {True: "", False: " OVER", None: ""}[p["fits"]]
    return ROW.format(job=job, shape=f"{m['d_model']} × {m['num_layers']}", active=_short(p["active_params"]),
                      steps=f"{p['steps']:,}", tokens=_short(p["tokens"]), flops=f"{p['train_flops']:.3e}",
                      lr=f"{max(p['lr'].values()):.3g}", memory=memory, overrides=overrides or "–")


def _short(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,}"


def _transport(m: dict) -> str:
    """The training-time expert transport and its capacities (model.ep_*)."""
    kind, send, recv = m["ep_transport"], m["ep_send_capacity_factor"], m["ep_recv_capacity_factor"]
    if kind == "pooled":
        if m.get("expert_parallel", 1) == 1:   # dispatch.pooled_one_device
            return (f"pooled: send {send} / receive {recv} × T·k, {m['ep_waves']} waves in one pass "
                    f"(one device: the waves only add bookkeeping; the same drops)")
        return f"pooled: send {send} / receive {recv} × T·k, {m['ep_waves']} waves"
    if kind == "ragged":
        peers = m.get("expert_parallel", 1)
        if peers == 1:   # dispatch.ragged_dot_dispatch: no exchange, no receive buffer
            return "ragged: one device, grouped matmuls over the sorted assignments (exact)"
        chunks = max(1, min(m.get("ep_expert_chunks", 1), m["num_experts"] // peers))
        return f"ragged: receive buffer {recv} × T·k in {chunks} chunk(s) of local experts, one after another"
    return f"fixed: capacity {m['capacity_factor']} per expert"
