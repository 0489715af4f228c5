"""The memory plan: the dry run says whether a run fits its devices, and a Slurm submission
that would not fit is refused before anything is written (unless plan.allow_over_memory)."""
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
    tokens = 16 * 4096  # per-device batch of the rung: 1,024 sequences over 64 devices
    rows = s.E * (tokens - accounting.capacity(tokens, s.k, s.E, waves.model.capacity_factor))
    buffer = rows * max(s.latent, s.I) * 4 / 2**30
    assert accounting.eval_memory_per_device(unbounded) - accounting.eval_memory_per_device(capped) >= buffer


def test_train_estimate_follows_the_transport_buffers():
    """The hero's dispatch buffers by `model.ep_transport`: fixed E·C rows; pooled its 3 waves'
    (each: the sender's chunks or one stripe's receive buffer, whichever is larger; all live at the
    compiled backward's peak); ragged the shared 1.15·T·k receive buffer (and T·k send rows)."""
    cfgs = {t: make_config("experiment=mochi_535b_a23b", f"model.ep_transport={t}", "dry_run=true")
            for t in ("fixed", "pooled", "ragged")}
    tokens, k = 16 * 4096, 8
    rows = {t: accounting.dispatch_rows(c, tokens) for t, c in cfgs.items()}
    assert rows["fixed"] == 384 * accounting.capacity(tokens, k, 384, 1.15)
    assert rows["ragged"] == 602936                         # 1.15 · 524,288 rounded up to a multiple of 8
    # pooled: S = 1.15·T·k / (3 waves · 64 peers) → 3,144 rows; R = 1.15·T·k / 6 → 100,496; 2 experts a stripe
    assert rows["pooled"] == 3 * max(64 * 3144, 2 * 100496) == 3 * 201216
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
