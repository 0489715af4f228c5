"""The memory plan: the dry run says whether a run fits its devices, and a Slurm submission
that would not fit, or a CPU run over this machine's memory, is refused before anything is
written (unless plan.allow_over_memory)."""
import pytest

from marin.config import derive
from marin.launch import plan as plan_module
from marin.launch.entry import dispatch
from marin.model import accounting
from tests.helpers import compose_dict, launch_here, make_config

RUNG = "experiment=ladder_d768"
SUBMIT = (RUNG, "data=builtin", "data.allow_vocab_mismatch=true")  # launchable here: the hero's mixture and tokenizer are the site's


def test_plan_has_the_limit_and_whether_the_run_fits():
    cfg = make_config(RUNG, "dry_run=true")
    p = plan_module.plan(cfg)
    assert p["memory_limit_gib"] == pytest.approx(cfg.hardware.memory_per_device_gib * cfg.hardware.memory_usable_fraction)
    # the train or the eval step, on the GPU or as the CPU compile holds it (the larger: verdict_backends)
    peak = max(p["memory_per_device_gib"], p["memory_eval_per_device_gib"], p["memory_cpu_compile_gib"],
               p["memory_eval_cpu_compile_gib"])
    assert p["fits"] is (peak <= p["memory_limit_gib"])
    local = plan_module.plan(make_config("model=tiny"))
    assert local["memory_limit_gib"] is None and local["fits"] is None  # CPU: no figure, no verdict


def half_the_estimate(*overrides: str) -> str:
    """A device memory override half of this config's estimate (so it cannot fit)."""
    estimate = plan_module.device_peak(make_config(*overrides, "dry_run=true"))
    return f"hardware.memory_per_device_gib={estimate / 2:.3f}"


def test_dry_run_warns_when_the_run_does_not_fit(capsys):
    small = half_the_estimate(RUNG)
    plan_module.print_plan(make_config(RUNG, small, "dry_run=true"))
    out = capsys.readouterr()
    assert "DOES NOT FIT" in out.out
    warnings = [line for line in out.err.splitlines() if line.startswith("warning: memory:")]
    assert len(warnings) == 1 and "plan.allow_over_memory=true" in warnings[0]
    plan_module.print_plan(make_config(RUNG, "hardware.memory_per_device_gib=100000", "dry_run=true"))
    assert "warning" not in capsys.readouterr().err


@pytest.fixture
def no_slurm(monkeypatch):
    """Everything past the memory check recorded instead of run (no cluster, no GPU install)."""
    from marin.launch import slurm
    from marin.track import record

    calls = []

    class Stop(Exception):
        pass

    def create(*args, **kwargs):
        calls.append("record")
        raise Stop

    monkeypatch.setattr(slurm, "check_gpu_install", lambda hw: None)
    monkeypatch.setattr(record, "create", create)
    monkeypatch.setattr(slurm, "submit_record", lambda *a, **k: calls.append("submit"))
    return calls, Stop


def test_slurm_submission_over_memory_is_refused_and_writes_nothing(tmp_path, capsys, no_slurm):
    calls, _ = no_slurm
    out_dir, db = tmp_path / "out", tmp_path / "mlflow.db"
    small = half_the_estimate(*SUBMIT)
    assert launch_here(*SUBMIT, small, f"run.out_dir={out_dir}", f"tracking.uri=sqlite:///{db}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: memory: the estimate is")
    resolved = make_config(*SUBMIT, small)
    estimate = plan_module.device_peak(resolved)
    assert f"{estimate:.1f} GiB" in err[0] and f"{derive.memory_limit_gib(resolved.hardware):.1f} GiB" in err[0]
    assert calls == [] and not out_dir.exists() and not db.exists()


def test_allow_over_memory_submits_anyway(tmp_path, no_slurm):
    calls, stop = no_slurm
    cfg = compose_dict(*SUBMIT, half_the_estimate(*SUBMIT), "plan.allow_over_memory=true", f"run.out_dir={tmp_path}")
    with pytest.raises(stop):
        dispatch(cfg)
    assert calls == ["record"]  # past the check: the record would be created, then submitted


def test_eval_step_estimate_follows_its_dispatch_buffers():
    """Dropless evaluation in waves reuses the training capacity (as evaluation with drops does);
    without a bound every expert gets room for all T tokens: the estimate grows by at least one
    such fp32 buffer beyond the capped one."""
    small_vocab = "model.vocab_size=1024"  # a layer's buffers, not the logits, are the largest
    waves = make_config(RUNG, small_vocab, "dry_run=true")
    assert waves.model.eval_dropless and waves.model.eval_dispatch == "waves"
    capped = make_config(RUNG, small_vocab, "model.eval_dropless=false", "dry_run=true")
    unbounded = make_config(RUNG, small_vocab, "model.eval_dispatch=unbounded", "dry_run=true")
    assert accounting.eval_memory_per_device(waves) == accounting.eval_memory_per_device(capped)
    s = accounting.Shapes.of(waves)
    per_device = waves.train.eval_batch_size // derive.batch_shards(waves.hardware)   # the eval batch's rows
    tokens = per_device * waves.train.seq_len
    rows = s.E * (tokens - accounting.capacity(tokens, s.k, s.E, waves.model.capacity_factor))
    buffer = rows * max(s.latent, s.I) * 4 / 2**30
    assert accounting.eval_memory_per_device(unbounded) - accounting.eval_memory_per_device(capped) >= buffer


def test_eval_estimate_counts_the_with_drops_pass_at_the_training_transport():
    """`eval.with_drops` runs a second pass at the training transport, on pieces of the training
    micro-batch's rows (`derive.drops_microbatches`): with pooled receive buffers larger than the
    dropless pass's E·C rows (a receive factor of 2), the estimate grows by at least their difference."""
    overrides = (RUNG, "model.vocab_size=1024", "train.eval_batch_size=1024",   # 16 rows a device: one piece
                 "model.ep_recv_capacity_factor=2.0", "dry_run=true")
    with_drops = make_config(*overrides, "eval.with_drops=true")
    dropless = make_config(*overrides, "eval.with_drops=false")
    s, tokens = accounting.Shapes.of(with_drops), 16 * 4096
    pooled = accounting.dispatch_rows(with_drops, tokens)
    waves = s.E * accounting.capacity(tokens, s.k, s.E, with_drops.model.capacity_factor)
    assert pooled > waves
    buffer = (pooled - waves) * max(s.latent, s.I) * 4 / 2**30
    grown = accounting.eval_memory_per_device(with_drops, "cpu") - accounting.eval_memory_per_device(dropless, "cpu")
    assert grown >= buffer


# Compiled on CPU (dry_run=compile, 2026-12, the eval batch of train.eval_batch_size: one row a device;
# docs/memory.md): the rung peaks in a loss tile, the hero where it cuts the gathered head into tiles.
COMPILED_EVAL_PEAK_GIB = {("experiment=ladder_d768",): 0.966, ("experiment=mochi_535b_a23b",): 7.708}


@pytest.mark.parametrize("overrides", list(COMPILED_EVAL_PEAK_GIB))
def test_eval_estimate_stays_within_20_percent_of_the_recorded_compiles(overrides):
    """Without compiling (the slow tests compile anew): the eval step's estimate of the CPU compile."""
    p = plan_module.plan(make_config(*overrides, "dry_run=true"))
    assert p["memory_eval_cpu_compile_gib"] == pytest.approx(COMPILED_EVAL_PEAK_GIB[overrides], rel=0.2)


def test_train_estimate_follows_the_transport_buffers():
    """The hero's dispatch buffers by `model.ep_transport`: fixed E·C rows; pooled its 3 waves'
    (each: the sender's pool or the receive buffers of the 6 local experts, whichever is larger;
    all live at the compiled backward's peak); ragged the T·k send rows (larger than one of its 2
    chunks' receive buffers of 1.15·T·k / 2 rows)."""
    cfgs = {t: make_config("experiment=mochi_535b_a23b", f"model.ep_transport={t}", "dry_run=true")
            for t in ("fixed", "pooled", "ragged")}
    tokens, k = 16 * 4096, 8
    rows = {t: accounting.dispatch_rows(c, tokens) for t, c in cfgs.items()}
    assert rows["fixed"] == 384 * accounting.capacity(tokens, k, 384, 1.15)
    assert rows["ragged"] == tokens * k                     # > ⌈1.15 · 524,288⌉ / 2 → 301,472 (a multiple of 8)
    one_chunk = make_config("experiment=mochi_535b_a23b", "model.ep_transport=ragged", "model.ep_expert_chunks=1",
                            "dry_run=true")
    assert accounting.dispatch_rows(one_chunk, tokens) == 602936   # 1.15 · 524,288 rounded up to a multiple of 8
    # pooled: S = ⌈1.15·T·k / (64 peers · 3 waves)⌉ = 3,141 rows; R = ⌈1.15·T·k / (6 local · 3 waves)⌉ = 33,497
    assert rows["pooled"] == 3 * max(64 * 3141, 6 * 33497) == 3 * 201024
    small = make_config("experiment=mochi_535b_a23b", "model.ep_transport=pooled", "model.ep_send_capacity_factor=0.5",
                        "model.ep_recv_capacity_factor=0.5", "dry_run=true")
    assert accounting.dispatch_rows(small, tokens) < rows["pooled"]     # the factors size the buffers
    total = {t: accounting.memory_per_device(c)["total"] for t, c in cfgs.items()}
    assert total["ragged"] < total["pooled"] < total["fixed"], total


def check_estimate_against_the_compiled_peak(done: dict) -> None:
    """`dry_run=compile` compiles one replica's real steps (XLA memory analysis); the dry run's
    estimates of the CPU compile's train and eval steps are within 20% of their peaks, and its
    host figure (offloaded optimizer state and carries) is the compiled one."""
    import json

    assert done["returncode"] == 0, done["stderr"][-2000:]
    p = json.loads(done["stdout"])
    compiled = p["compiled"]
    assert p["memory_cpu_compile_gib"] == pytest.approx(compiled["train_step"]["peak_gib"], rel=0.2)
    assert p["memory_eval_cpu_compile_gib"] == pytest.approx(compiled["eval_step"]["peak_gib"], rel=0.2)
    assert p["memory_host_gib"] == pytest.approx(compiled["train_step"]["host_gib"], rel=0.05)


@pytest.mark.slow
def test_rung_estimate_is_within_20_percent_of_the_compiled_peak():
    """A ladder rung (about 1 min on 2 cores)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "launch.py", RUNG, "dry_run=compile_json"], cwd=root,
                          capture_output=True, text=True, timeout=900)
    check_estimate_against_the_compiled_peak(vars(done))


@pytest.mark.slow
def test_hero_estimate_is_within_20_percent_of_the_compiled_peak(hero_compiled):
    """The hero in its own layout (FSDP, offload, remat full, offload_carry): its compile (about 2
    min on 2 cores) is shared with test_compile_plan's (`hero_compiled`, tests/conftest.py)."""
    check_estimate_against_the_compiled_peak(hero_compiled)


# Measured on one H200 by benchmarks/gpu.py (2026-12-04, jax 0.11.2, cuDNN 9.19, Python 3.12;
# docs/performance.md): `experiment=ladder_d768 hardware=h200 data=builtin data.allow_vocab_mismatch=true
# train.global_batch=32` (1.59B total / 61M active, E384 top-8, 131,072 tokens a step) and the
# hero-shaped one-GPU preset (benchmarks/presets.py "d2048"), peak device memory of the train step.
H200_MEASURED = ("experiment=ladder_d768", "hardware=h200", "data=builtin", "data.allow_vocab_mismatch=true",
                 "train.global_batch=32")
H200_D2048 = ("experiment=mochi_535b_a23b", "hardware=h200", "data=builtin", "data.allow_vocab_mismatch=true",
              "model.d_model=2048", "model.num_layers=8", "model.num_experts=64", "model.expert_width=1024",
              "model.latent_dim=1024", "model.shared_width=1024", "model.ep_transport=fixed", "hardware.racks=1",
              "hardware.mesh.fsdp=false", "train.global_batch=8")
OFFLOAD = ("optim.offload=true", "model.offload_carry=true")
NO_OFFLOAD = ("optim.offload=false", "model.offload_carry=false")
H200_PEAKS_GIB = [   # (overrides, measured peak GiB)
    ((*H200_MEASURED, *NO_OFFLOAD, "attention.cudnn_max_documents=64"), 75.8),   # 172,230 tokens/s
    ((*H200_MEASURED, *OFFLOAD, "attention.cudnn_max_documents=64"), 57.1),      # 73,677 tokens/s
    ((*H200_MEASURED, *NO_OFFLOAD, "attention.cudnn_max_documents=8"), 36.4),
    ((*H200_MEASURED, *NO_OFFLOAD, "attention.impl=blockwise"), 32.4),           # 129,496 tokens/s
    ((*H200_D2048, "attention.cudnn_max_documents=64"), 66.5),
]
H200_HOST_TO_DEVICE_GB = 47        # with offload, host→device per step (PCIe), the first H200 run
H200_TOKENS_PER_S = {"offload": 73_677, "none": 172_230}   # cudnn with 64 document slots, as above


@pytest.mark.parametrize("overrides,measured", H200_PEAKS_GIB)
def test_gpu_estimate_is_within_20_percent_of_one_h200s_measured_peaks(overrides, measured):
    """The plan of each measured run (a GPU platform: bf16 buffers, cuDNN's packed-row workspace by
    its document slots) against the H200's peak; before the GPU model (every buffer fp32, as
    XLA:CPU holds them) it said 36.4 and 49.3 GiB for the blockwise runs that peaked at 20.6 and 33.5."""
    p = plan_module.plan(make_config(*overrides, "dry_run=true"))
    assert p["memory_backend"] == "gpu"
    assert p["memory_per_device_gib"] == pytest.approx(measured, rel=0.2)
    assert p["memory_cpu_compile_gib"] > 0


def test_cudnn_workspace_grows_with_its_document_slots():
    """64 slots against 8 on the rung: the H200 compiled 39.4 GiB more temporaries; the plan says the same."""
    few, many = (plan_module.plan(make_config(*H200_MEASURED, *NO_OFFLOAD, f"attention.cudnn_max_documents={m}",
                                              "dry_run=true"))["memory_per_device_gib"] for m in (8, 64))
    assert many - few == pytest.approx(63.2 - 23.8, rel=0.1)


def test_offload_traffic_and_its_time_match_the_h200_run():
    """≈47 GB came from the host each step; at PCIe Gen5's 50 GB/s that is about the time the
    offloaded step lost (131,072 tokens at 60,000 tokens/s against 114,000: 1.03 s)."""
    cfg = make_config(*H200_MEASURED, *OFFLOAD, "hardware.host_link_gbps=50", "dry_run=true")
    traffic = accounting.host_traffic(cfg)
    assert traffic["in"] / 1e9 == pytest.approx(H200_HOST_TO_DEVICE_GB, rel=0.15)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    lost = tokens / H200_TOKENS_PER_S["offload"] - tokens / H200_TOKENS_PER_S["none"]
    assert accounting.host_link_seconds(cfg) == pytest.approx(lost, rel=0.2)
    assert accounting.host_traffic(make_config(*H200_MEASURED, *NO_OFFLOAD, "dry_run=true"))["in"] == 0
    p = plan_module.plan(cfg)
    assert p["offload"]["host_link_seconds_per_step"] == accounting.host_link_seconds(cfg)
    line = next(l for l in plan_module.format_plan(p).splitlines() if "host link / step" in l)
    assert f"{traffic['in'] / 1e9:.3g} GB in" in line and "at 50 GB/s per direction" in line


# Compiled on CPU (dry_run=compile, docs/memory.md): the layouts these peaks were measured for.
COMPILED_TRAIN_PEAK_GIB = {("experiment=mochi_535b_a23b",): 142.0,
                           ("experiment=ladder_d768", *OFFLOAD): 15.05}


@pytest.mark.parametrize("overrides", list(COMPILED_TRAIN_PEAK_GIB))
def test_cpu_compile_estimate_stays_within_20_percent_of_the_recorded_compiles(overrides):
    """The GPU model leaves the CPU compile's estimate as it was (the slow tests compile anew)."""
    p = plan_module.plan(make_config(*overrides, "dry_run=true"))
    assert p["memory_cpu_compile_gib"] == pytest.approx(COMPILED_TRAIN_PEAK_GIB[overrides], rel=0.2)


def test_the_dry_run_says_why_offload_is_on_or_off():
    hero = plan_module.plan(make_config("experiment=mochi_535b_a23b", "dry_run=true"))
    assert (hero["offload"]["optim"], hero["offload"]["carry"]) == (True, True)
    assert hero["offload"]["reason"].count("does not fit") == 2  # without either one
    rung = plan_module.plan(make_config("experiment=ladder_d768", "hardware=h200", "train.global_batch=32", "dry_run=true"))
    assert (rung["offload"]["optim"], rung["offload"]["carry"]) == (False, False)
    assert rung["offload"]["reason"].startswith("the plan fits without offload")
    text = plan_module.format_plan(rung)
    assert "optimizer off, carries off" in text and "host link / step" not in text


@pytest.mark.parametrize("how", [("model=tiny",), ("model=tiny", "-m", "optim.lr=0.001,0.002")])
def test_a_cpu_run_over_this_machines_memory_is_refused_and_writes_nothing(how, tmp_path, capsys, monkeypatch):
    """As a Slurm run over its devices' memory: exit 2, one line naming plan.allow_over_memory, no
    run directory (the machine's memory stood in for by a figure half the run's estimate)."""
    import sys

    from marin.launch import memory

    cfg = make_config("model=tiny")
    need = memory.device_peak(cfg) + accounting.memory_per_device(cfg)["host"]
    monkeypatch.setattr(memory, "machine_memory_gib", lambda: need / 2)
    out_dir = tmp_path / "out"
    site = (f"run.out_dir={out_dir}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    if "-m" in how:  # a sweep of local jobs: every job checked before the first runs (launch.py -m)
        import subprocess

        probe = ("import sys; from marin.launch import memory; memory.machine_memory_gib = lambda: %r\n"
                 "import runpy; sys.argv = ['launch.py', *sys.argv[1:]]; runpy.run_path('launch.py', run_name='__main__')"
                 % (need / 2))
        from tests.helpers import ROOT
        done = subprocess.run([sys.executable, "-c", probe, "-m", "model=tiny", "optim.lr=0.001,0.002", *site],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        code, err = done.returncode, done.stderr.strip().splitlines()
        assert code == 2 and "plan.allow_over_memory=true" in done.stderr, done.stderr[-2000:]
        assert sum("memory: the estimate for this CPU run" in line for line in err) == 2  # job 1/2 and 2/2
    else:
        assert launch_here(*how, *site) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: memory: the estimate for this CPU run is")
        assert "plan.allow_over_memory=true" in err[0] and f"{need / 2:.1f} GiB" in err[0]
    assert not out_dir.exists() and not (tmp_path / "mlflow.db").exists()


def test_allow_over_memory_runs_a_cpu_run_anyway(tmp_path, monkeypatch):
    import marin.launch.local as local
    from marin.launch import memory

    monkeypatch.setattr(memory, "machine_memory_gib", lambda: 1e-6)
    started = []
    monkeypatch.setattr(local, "run_local", lambda *args: started.append(args))
    monkeypatch.setattr("marin.launch.entry.apply_environment", lambda hw: None)
    assert launch_here("model=tiny", "plan.allow_over_memory=true", f"run.out_dir={tmp_path}") == 0
    assert len(started) == 1  # past the check: the run would train
