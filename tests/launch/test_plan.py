"""The dry run: `launch.py dry_run=json` prints one JSON object (and nothing else on stdout),
never imports JAX, and its memory estimate follows the spec's layout (§6)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from marin.config import derive
from marin.launch.plan import format_plan, plan
from marin.model import accounting
from tests.helpers import make_config

ROOT = Path(__file__).resolve().parents[2]
HERO = "experiment=mochi_535b_a23b"
RUNG = "experiment=ladder_d768"
KEYS = {"total_params", "total_params_all_leaves", "active_params", "flops_per_token", "train_flops",
        "train_flops_no_head", "steps", "tokens", "seq_len", "global_batch", "tokens_per_step", "lr",
        "mesh", "devices", "memory_per_device_gib"}


def planned(*overrides: str):
    """A resolved config validated as a dry run is (the hero's data files are site-specific)."""
    return make_config(*overrides, "dry_run=true")


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "launch.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `-X importtime` lines: 'import time: self | cumulative | name'."""
    return {line.rsplit("|", 1)[-1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:")}


@pytest.fixture(scope="module")
def hero_json():
    out = launch(HERO, "dry_run=json")
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_dry_run_json_is_one_object_with_every_key(hero_json):
    p = json.loads(hero_json.stdout)  # fails on anything printed besides the object
    assert KEYS <= set(p)
    assert p["mesh"] == {"replica_dcn": 11, "data": 1, "expert": 64, "model": 1}
    assert p["devices"] == 704
    assert set(p["lr"]) == {"muonh", "adamh", "adam"}
    assert p["memory_per_device_gib"] == pytest.approx(sum(p["memory_parts_gib"].values()))
    # The hero mixture's 200 cells, epochs per phase (pretrain, midtrain), from the cells file.
    assert len(p["data"]) == 200 and all(len(e) == 2 for e in p["data"].values())


def test_dry_run_never_imports_jax(hero_json):
    modules = imported_modules(hero_json.stderr)
    assert "marin.launch.plan" in modules  # the probe sees the plan's imports
    assert not {m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax")}


def test_gb200_submission_is_176_nodes_of_4_gpus(hero_json):
    sub = json.loads(hero_json.stdout)["submission"]
    assert (sub["nodes"], sub["ntasks_per_node"], sub["gpus_per_node"], sub["tasks"]) == (176, 4, 4, 704)
    assert any("XLA_FLAGS" in line for line in sub["setup"])  # the environment every task gets


def test_dry_run_table_shows_the_plan():
    out = launch(HERO, "dry_run=true")
    assert out.returncode == 0, out.stderr[-2000:]
    for text in ("535.305B", "22.762B", "390,251", "176 nodes × 4 tasks = 704 processes", "replica_dcn 11", "GiB"):
        assert text in out.stdout


def test_the_hero_and_its_stage_show_how_they_evaluate_and_keep_checkpoints():
    """Spec §9 in the dry run: eval batches and the with-drops pass (off from the ragged switch, so
    in the 8K stage), the headline metric, the loss targets, the warmup from lr 0, the retention."""
    hero = format_plan(plan(planned(HERO)))
    assert "every batch of 704 × 4,096 tokens per set (paloma)" in hero and "with-drops pass on" in hero
    assert "headline metric            eval/paloma/macro_loss" in hero and "loss targets               causal" in hero
    assert "lr 0 at step 0, the peak at step 3,902" in hero
    assert "rolling every 60 min, 1 kept; permanent 55,000" in hero
    stage = format_plan(plan(planned("experiment=mochi_535b_a23b_8k")))
    assert "with-drops pass off" in stage and "4,096 tokens per set" in stage
    stopped = format_plan(plan(planned(HERO, "train.stop_at=81716")))
    assert "stops at step 81,716 (train.stop_at)" in stopped


def test_local_plan_has_no_submission():
    p = plan(make_config("model=tiny"))
    assert "submission" not in p and p["devices"] == 1
    assert "run default" in format_plan(p)


def test_all_leaf_count_is_the_spec_formula():
    """Spec §1a 'every leaf', written out independently of the accounting code."""
    cfg = planned(HERO)
    a, m = cfg.attention, cfg.model
    d, L, H, h, kv, r, ell = (m.d_model, m.num_layers, a.num_heads, a.head_dim, a.kv_heads_local,
                              m.gated_norm_rank, m.latent_dim)
    per_layer = 2 * (d * r + r * d) + d * H + 2 * d + ell + kv * h * 4 + 2 * d * 4
    once = 2 * (d + d * r + r * d)
    expected = accounting.total_params(cfg) + L * per_layer + once
    assert plan(cfg)["total_params_all_leaves"] == expected == 535_477_088_256
    assert sum(leaf.size for leaf in accounting.leaves_of(accounting.Shapes.of(cfg))) == expected


def test_leaf_table_groups_follow_the_optimizer_rules():
    from marin.optim.groups import group_of  # imports JAX: fine in a test

    for leaf in accounting.leaves_of(accounting.Shapes.of(planned(HERO))):
        assert group_of(tuple(leaf.path.split("/"))) == leaf.group, leaf.path


def test_hero_memory_parts_follow_the_layout():
    """The hero's own layout (FSDP; optimizer state, expert masters and carries in host memory;
    remat full): the parts follow from the leaf table, the mesh and the switches."""
    cfg = planned(HERO)
    assert (cfg.hardware.mesh.fsdp, cfg.optim.offload, cfg.model.offload_carry) == (True, True, True)
    leaves = accounting.leaves_of(accounting.Shapes.of(cfg))
    experts = sum(leaf.size for leaf in leaves if leaf.expert)
    assert experts == 48 * 384 * 3 * 3072 * 3072
    small = sum(leaf.size for leaf in leaves if not leaf.expert and leaf.size < accounting.FSDP_MIN_SIZE)
    others = sum(leaf.size for leaf in leaves) - experts
    gib = lambda elements: elements * 4 / 2**30  # fp32
    sharded = gib(experts / 64 + (others - small) / 64 + small)  # experts over 64, the rest FSDP but the smallest
    on_device = accounting.memory_per_device(planned(HERO, "optim.offload=false"))
    replicated = accounting.memory_per_device(planned(HERO, "optim.offload=false", "hardware.mesh.fsdp=false"))
    assert replicated["params"] == pytest.approx(gib(experts / 64 + others))
    assert on_device["params"] == pytest.approx(sharded)
    # MuonH keeps one momentum on matrices, so its state is near the parameters' size; AdamW's twice.
    assert on_device["params"] < on_device["optimizer"] < 1.01 * on_device["params"]
    adamw = accounting.memory_per_device(planned(HERO, "optim=adamw", "optim.offload=false"))
    assert adamw["optimizer"] == pytest.approx(2 * on_device["params"])
    # Offloaded under MuonH: the experts' masters and all optimizer state live in host memory,
    # with every layer's bf16 carry; the device keeps the rest of the weights and stages one
    # Adam moment at a time (MuonH streams its momentum per layer).
    mem = accounting.memory_per_device(cfg)
    assert mem["params"] == pytest.approx(sharded - gib(experts / 64))
    assert mem["gradients"] == pytest.approx(sharded)  # every gradient, one micro-batch: no accumulator
    adam_leaves = [leaf for leaf in leaves if leaf.group != "muonh"]
    assert mem["optimizer"] == pytest.approx(max(gib(leaf.size / accounting.leaf_shards(leaf, cfg)) for leaf in adam_leaves))
    carries = gib(48 * 16 * 4096 * 6144) / 2  # L × one micro-batch's tokens × d, bf16
    assert mem["host"] == pytest.approx(on_device["optimizer"] + gib(experts / 64) + carries)
    assert mem["activations"] == 0  # remat full with the carries in host memory: nothing saved on the device


def test_offload_moves_state_to_the_host():
    device = accounting.memory_per_device(planned(HERO, "optim.offload=false", "model.offload_carry=false"))
    offload = accounting.memory_per_device(planned(HERO, "model.offload_carry=false"))
    masters = device["params"] - offload["params"]  # the experts' (MuonH streams them per layer)
    assert masters > 0 and offload["optimizer"] < device["optimizer"]
    assert offload["host"] == pytest.approx(device["optimizer"] + masters)
    assert offload["total"] < device["total"]
    carry = accounting.memory_per_device(planned(HERO, "optim.offload=false"))
    assert carry["host"] > 0 and carry["activations"] == 0 < device["activations"]
    assert device["activations"] == pytest.approx(carry["host"])  # the same carries, on the device


def test_the_plan_compares_host_memory_with_the_trays():
    """The offloaded bytes beside the host memory per device (one Grace's 480 GB for 2 GPUs) and a
    verdict, as the device side has; a run larger than the host is said to be so."""
    text = format_plan(plan(planned(HERO)))
    line = next(line for line in text.splitlines() if "host memory / device" in line)
    assert line.split()[-1] == "fits" and "limit 223.5 GiB" in line, line
    over = format_plan(plan(planned(HERO, "hardware.host_memory_per_device_gib=50")))
    assert "limit 50.0 GiB: DOES NOT FIT" in next(l for l in over.splitlines() if "host memory / device" in l)


def test_memory_scales_with_the_rack_not_the_racks():
    one_rack = accounting.memory_per_device(planned(RUNG))
    half_rack = accounting.memory_per_device(planned(RUNG, "hardware.nodes=8", "hardware.mesh.expert=32"))
    experts = one_rack["params"] - accounting.memory_per_device(planned(RUNG, "model.num_experts=192"))["params"]
    assert experts > 0 and half_rack["params"] > one_rack["params"]  # expert weights over half the devices
    two_racks = accounting.memory_per_device(planned(RUNG, "hardware.racks=2", "train.global_batch=2048"))
    assert two_racks["params"] == one_rack["params"]  # replicated across racks (replica_dcn)
    assert two_racks["working"] == one_rack["working"]  # same micro-batch per device


def test_activations_follow_remat_attention_and_the_micro_batch():
    cfg = planned(RUNG, "model.offload_carry=false")
    full = accounting.memory_per_device(cfg)
    # a layer's backward is the largest phase as compiled on CPU (fp32 buffers) and on a GPU (bf16
    # ones): the fused loss holds one [row chunk, vocabulary tile] of fp32 logits, not a chunk of
    # 16 rows by 512 positions by 128K columns (marin/model/loss.py)
    assert accounting.PHASES[accounting.memory_per_device(cfg, backend="cpu")["peak_phase"]] == "backward"
    assert accounting.PHASES[full["peak_phase"]] == "backward"
    s = accounting.Shapes.of(cfg)
    assert full["activations"] == pytest.approx(s.L * 16 * 4096 * s.d * 2 / 2**30)  # the bf16 carries
    none = accounting.memory_per_device(planned(RUNG, "model.offload_carry=false", "model.remat=none"))
    dots = accounting.memory_per_device(planned(RUNG, "model.offload_carry=false", "model.remat=dots"))
    assert none["activations"] > dots["activations"] > full["activations"]
    half = accounting.memory_per_device(planned(RUNG, "model.offload_carry=false", "train.micro_batch=8"))
    assert half["activations"] == pytest.approx(full["activations"] / 2)
    small_vocab = "model.vocab_size=1024"  # so that a layer's backward, not the loss, is the largest phase
    whole = accounting.memory_per_device(planned(RUNG, small_vocab))
    halves = accounting.memory_per_device(planned(RUNG, small_vocab, "train.micro_batch=8"))
    assert accounting.PHASES[halves["peak_phase"]] == "backward"
    assert halves["working"] == pytest.approx(whole["working"] / 2, rel=0.05)  # one micro-batch's buffers
    assert halves["gradients"] == pytest.approx(2 * whole["gradients"])  # + the accumulator
    blockwise = accounting.memory_per_device(planned(RUNG, "attention.impl=blockwise"))
    reference = accounting.memory_per_device(planned(RUNG, "attention.impl=reference"))
    scores = 16 * cfg.attention.num_heads * 4096 ** 2 * 4 / 2**30  # one [B, H, T, T] fp32 array
    assert reference["working"] - blockwise["working"] > scores


def test_plan_names_the_layout_it_models():
    p = plan(planned(HERO))
    assert p["layout"] == {"fsdp": True, "optim_offload": True, "remat": "full", "offload_carry": True,
                           "expert_masters_on_host": True, "attention_impl": "cudnn",
                           "attention_kernel": derive.attention_kernel(planned(HERO)), "micro_batches": 1}
    assert "remat full" in format_plan(p) and "carries on host" in format_plan(p)
    assert plan(planned(RUNG, "model.remat=false", "model.offload_carry=false"))["remat"] == "none"


def test_plan_names_the_attention_kernel_that_really_runs():
    """cudnn on a GPU in bf16 is cuDNN's packed-row kernel up to attention.cudnn_max_documents
    documents a row (blockwise beyond); on a CPU the blockwise kernel."""
    gpu = planned(RUNG, "hardware=h200_node", "model.compute_dtype=bfloat16", "attention.cudnn_max_documents=32")
    cpu = planned("model=tiny")
    words = "cudnn (packed rows, segment offsets, ≤ 32 documents a row; blockwise beyond)"
    assert derive.attention_kernel(gpu) == words and plan(gpu)["layout"]["attention_kernel"] == words
    assert f"{words} attention" in format_plan(plan(gpu))
    assert derive.attention_kernel(cpu) == "blockwise" and "blockwise attention" in format_plan(plan(cpu))


def test_a_multirun_row_holds_what_differs_between_jobs():
    from marin.launch.plan import plan_row, row_header

    row = plan_row(plan(planned("model=tiny")), "2/4", "optim.lr=0.003")
    head = row_header()
    assert row.split()[:4] == ["2/4", "64", "×", "2"] and row.endswith("GiB  optim.lr=0.003")
    assert len(row.splitlines()) == 1 and head.split()[0] == "job" and head.endswith("overrides")
    over = plan_row(plan(planned("model=tiny", "hardware.memory_per_device_gib=0.001")), "1/1", "")
    assert " OVER  –" in over                                       # the estimate over the device's memory


def test_help_lists_the_modes_and_tools_before_the_groups():
    done = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    modes, tools, groups = out.index("== Modes"), out.index("== Tools"), out.index("== Configuration groups")
    assert modes < tools < groups and "== Config ==" not in out and len(out.splitlines()) < 60  # no config dump
    for mode in ("dry_run=true", "dry_run=json", "dry_run=compile ", "dry_run=compile_json", "dry_run=config",
                 "resume=", "reproduce=", "verify=true", "wait=true", "-m "):
        assert mode in out[modes:tools], mode
    for tool in ("status", "diff", "forecast", "report", "generate"):
        assert f"marin.{tool} " in out[tools:groups], tool
    assert "experiment: " in out[groups:] and "ladder_cpu_d160" in out[groups:]


def test_a_cpu_run_bigger_than_this_machine_is_warned_about_in_the_dry_run(capsys, monkeypatch):
    from marin.launch import memory
    from marin.launch import plan as plan_module

    cfg = planned("model=tiny")
    need = memory.device_peak(cfg) + accounting.memory_per_device(cfg)["host"]
    assert memory.over_machine_memory(cfg, machine_gib=need * 2) is None
    line = memory.over_machine_memory(cfg, machine_gib=need / 2)
    assert line.startswith("memory: the estimate for this CPU run is") and "over this machine's" in line
    assert memory.over_machine_memory(planned(HERO), machine_gib=1e-6) is None   # not this machine's memory
    monkeypatch.setattr(memory, "machine_memory_gib", lambda: need / 2)
    plan_module.print_plan(cfg)                                  # the dry run says it (the launch refuses it:
    assert capsys.readouterr().err.splitlines() == [f"warning: {line}"]  # tests/launch/test_memory_plan.py)
