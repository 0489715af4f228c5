"""The hardware group and the Slurm request, without a cluster: what each hardware asks for,
the environment its processes get, mesh checks, and the bad inputs that must stop a launch
before anything is created or submitted."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marin.launch import slurm
from marin.launch.distributed import check_gpu_install, process_environment
from marin.model.mesh import MeshError, check_mesh
from tests.helpers import launch_here, make_config

ROOT = Path(__file__).resolve().parents[2]
HERO = ["experiment=mochi_535b_a23b", "dry_run=true"]   # the published run


def launch(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=env)


@pytest.mark.parametrize("name", ["local_cpu", "local_cpu8", "slurm_cpu", "h200_node", "gb200_nvl72"])
def test_every_hardware_composes(name):
    model = {"h200_node": "model=small", "gb200_nvl72": "model=mochi"}.get(name, "model=tiny")
    batch = {"gb200_nvl72": "train.global_batch=1024"}.get(name, "train.global_batch=16")
    cfg = make_config(f"hardware={name}", model, batch, "data.allow_vocab_mismatch=true", "dry_run=true")
    assert cfg.hardware.name == name


def test_racks_multiply_the_nodes_slurm_gets_and_are_the_replicas():
    cfg = make_config("hardware=gb200_nvl72", "hardware.racks=3", "model=mochi", "train.global_batch=3072",
                      "data.allow_vocab_mismatch=true", "dry_run=true")
    hw, p = cfg.hardware, slurm.slurm_parameters(cfg)
    assert (hw.racks, hw.nodes, p["nodes"], p["ntasks_per_node"]) == (3, 16, 48, 4)  # the TOTAL node count
    assert (hw.mesh.replica_dcn, hw.mesh.data, hw.mesh.expert) == (3, 1, 64)
    assert "48 nodes × 4 tasks = 192 processes (192 GPUs)" in slurm.describe(cfg)


def test_a_config_without_racks_keeps_its_total_nodes():
    """Configs saved before `racks` existed name the job's total nodes; racks defaults to 1."""
    cfg = make_config("hardware=gb200_nvl72", "hardware.nodes=176", "hardware.mesh.replica_dcn=11",
                      "model=mochi", "train.global_batch=11264", "data.allow_vocab_mismatch=true", "dry_run=true")
    assert (cfg.hardware.racks, slurm.slurm_parameters(cfg)["nodes"], cfg.hardware.mesh.replica_dcn) == (1, 176, 11)


def test_slurm_cpu_is_two_one_cpu_tasks_on_the_default_partition():
    cfg = make_config("hardware=slurm_cpu", "model=tiny")
    p = slurm.slurm_parameters(cfg)
    assert (p["nodes"], p["ntasks_per_node"], p["cpus_per_task"]) == (1, 2, 1)
    assert not {"partition", "mem", "gpus_per_node", "account", "qos", "constraint"} & set(p)
    assert cfg.hardware.mesh.expert == 2 and cfg.model.num_experts % 2 == 0


def test_gpu_request_is_one_task_per_gpu_and_every_field_reaches_sbatch():
    cfg = make_config("hardware=h200_node", "model=small", "hardware.partition=gpu", "hardware.account=lm",
                      "hardware.qos=high", "hardware.constraint=h200", "hardware.mem_gb=900", "hardware.time_min=90")
    p = slurm.slurm_parameters(cfg)
    assert p["ntasks_per_node"] == p["gpus_per_node"] == 8
    assert (p["partition"], p["account"], p["qos"], p["constraint"], p["mem"], p["time"]) == \
        ("gpu", "lm", "high", "h200", "900GB", 90)
    script = slurm.executor(cfg, ROOT / "outputs" / "tmp-never-written")._make_submission_file_text("cmd", "uid")
    for flag in ("--gpus-per-node=8", "--ntasks-per-node=8", "--partition=gpu", "--account=lm", "--qos=high",
                 "--constraint=h200", "--mem=900GB", "--time=90", "--signal=USR2@300"):
        assert flag in script, flag
    xla = next(line for line in script.splitlines() if line.startswith("export XLA_FLAGS="))
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in xla
    assert "export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92" in script


def test_hero_dry_run_describes_176_nodes_of_4_gpus():
    text = slurm.describe(make_config(*HERO))
    assert "176 nodes × 4 tasks = 704 processes (704 GPUs)" in text and "11 racks of 16 nodes" in text
    assert "per node: 4 GPUs" in text and "time limit 1440 min" in text


def test_hero_dry_run_from_the_command_line():
    done = launch(*HERO)
    assert done.returncode == 0, done.stderr
    assert "176 nodes × 4 tasks" in done.stdout


def test_forced_host_devices_reach_the_process_environment():
    env = process_environment(make_config("hardware=local_cpu8", "model=tiny").hardware)
    assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
    assert int(env["PJRT_NPROC"]) >= 16  # else 8-device collectives abort on a 2-core machine


def test_the_environments_xla_flags_are_kept_unless_the_hardware_sets_them(monkeypatch):
    from marin.launch.distributed import INHERITED_FLAGS, apply_environment, xla_flags

    hw = make_config("hardware=local_cpu8", "model=tiny", "hardware.xla_flags='--xla_cpu_enable_fast_math=false'").hardware
    monkeypatch.setattr(os, "environ", {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_cpu_enable_fast_math=true "
                                                     "--xla_force_host_platform_device_count=2"})
    want = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"
    assert xla_flags(hw) == want
    apply_environment(hw)
    assert os.environ["XLA_FLAGS"] == want and INHERITED_FLAGS in os.environ
    # a process this one starts reads the flags it started with, not those the hardware added
    hw.xla_flags, hw.host_devices = "", 1
    assert xla_flags(hw) == "--xla_dump_to=/tmp/d --xla_cpu_enable_fast_math=true"


def test_mesh_must_cover_the_devices_and_split_the_experts():
    cfg = make_config("hardware=local_cpu8", "model=tiny")
    check_mesh(cfg, 8)
    with pytest.raises(MeshError, match="8 devices|but this job has 4 devices"):
        check_mesh(cfg, 4)
    cfg.hardware.mesh.expert, cfg.hardware.mesh.data = 8, 1
    with pytest.raises(MeshError, match="does not divide model.num_experts = 4"):
        check_mesh(cfg, 8)


def test_config_rejects_a_mesh_that_is_not_the_device_count():
    from marin.config.validate import ConfigError

    with pytest.raises(ConfigError, match="hardware.mesh"):
        make_config("hardware=slurm_cpu", "model=tiny", "hardware.mesh.data=2")
    with pytest.raises(ConfigError, match="hardware.mesh.expert"):
        make_config("hardware=slurm_cpu", "model=tiny", "model.num_experts=3", "router.top_k=1")


def test_gpu_hardware_with_a_cpu_only_install_stops_before_anything_is_made(tmp_path, capsys):
    cfg = make_config("hardware=h200_node", "model=small")
    if check_gpu_install(cfg.hardware) is None:
        pytest.skip("this Python has CUDA JAX")
    code = launch_here("hardware=h200_node", "model=small", f"run.out_dir={tmp_path}",
                       f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    err = capsys.readouterr().err
    assert code == 2
    assert "CPU-only JAX" in err and "pip install" in err
    assert not (tmp_path / "runs").exists()


def test_unreachable_tracking_server_stops_before_submitting(tmp_path, capsys):
    code = launch_here("hardware=slurm_cpu", "model=tiny", f"run.out_dir={tmp_path}", "tracking.uri=http://127.0.0.1:9")
    out, err = capsys.readouterr()
    assert code == 2
    assert "not reachable" in err and "nothing was submitted" in err
    assert "slurm job:" not in out
    assert not list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else True


def test_resume_of_a_run_that_does_not_exist(tmp_path, capsys):
    assert launch_here(f"resume={tmp_path}/runs/nope", f"run.out_dir={tmp_path}") == 2
    err = capsys.readouterr().err
    assert "resume:" in err and "no such run directory" in err
    assert launch_here("resume=0123456789abcdef0123456789abcdef", f"run.out_dir={tmp_path}",
                       f"tracking.uri=sqlite:///{tmp_path}/mlflow.db") == 2
    err = capsys.readouterr().err
    assert "resume: 0123456789abcdef0123456789abcdef" in err and "Traceback" not in err


def test_submitted_job_gets_a_clean_environment(monkeypatch):
    """While sbatch runs, the submitting shell's Slurm variables and GPU binding are hidden."""
    import os

    monkeypatch.setenv("SLURM_JOB_ID", "999")
    monkeypatch.setenv("SLURM_NTASKS", "7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with slurm.clean_environment():
        assert not [k for k in os.environ if k.startswith("SLURM_")] and "CUDA_VISIBLE_DEVICES" not in os.environ
    assert os.environ["SLURM_JOB_ID"] == "999" and os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def hero_script(monkeypatch, version) -> str:
    """The hero's batch script as submitit writes it (nothing submitted), on a Slurm of `version`."""
    monkeypatch.setattr(slurm, "slurm_version", lambda: version)
    cfg = make_config(*HERO)
    return slurm.executor(cfg, ROOT / "outputs" / "tmp-never-written")._make_submission_file_text("CMD", "uid")


def test_hero_batch_script_places_each_replica_in_one_rack_on_whole_nodes(monkeypatch):
    script = hero_script(monkeypatch, (24, 11))
    for flag in ("--nodes=176", "--segment=16", "--exclusive", "--mem=0", "--ntasks-per-node=4", "--gpus-per-node=4",
                 "--signal=USR2@600"):
        assert f"#SBATCH {flag}\n" in script, flag
    assert "gpus-per-task" not in script and "--switches" not in script   # every task sees its node's 4 GPUs
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and srun.endswith(" CMD")        # one dead task ends the step
    after = script.split(srun, 1)[1]
    assert 'marin_exit=$?' in after and "-m marin.launch.restarts" in after and 'exit "$marin_exit"' in after
    text = slurm.describe(make_config(*HERO))   # the dry run says so
    assert "placement: --segment=16 --exclusive --mem=0" in text and "1000 restarts after a task dies" in text


def test_an_older_slurm_keeps_a_one_rack_job_under_one_switch_and_refuses_more(monkeypatch):
    monkeypatch.setattr(slurm, "slurm_version", lambda: (23, 11))
    one_rack = make_config("hardware=gb200_nvl72", "model=mochi", "train.global_batch=1024",
                           "data.allow_vocab_mismatch=true", "dry_run=true")
    assert slurm.placement_problem(one_rack) is None
    assert slurm.slurm_parameters(one_rack)["additional_parameters"] == {"switches": "1@24:00:00"}
    problem = slurm.placement_problem(make_config(*HERO))
    assert problem.startswith("hardware.segment_nodes=16: Slurm 23.11 has no --segment") and "\n" not in problem
    assert "hardware.racks=1" in problem


def test_segment_nodes_must_divide_the_jobs_nodes():
    cfg = make_config("hardware=gb200_nvl72", "hardware.segment_nodes=12", "model=mochi", "train.global_batch=1024",
                      "data.allow_vocab_mismatch=true", "dry_run=true")
    assert slurm.placement_problem(cfg, (24, 5)) == (
        "hardware.segment_nodes=12 must divide the job's 16 nodes (hardware.racks × hardware.nodes)")


def test_this_clusters_older_slurm_refuses_two_segments_before_anything_is_made(tmp_path, capsys):
    version = slurm.slurm_version()
    if version is None or version >= slurm.SEGMENT_SINCE:
        pytest.skip(f"needs an sbatch older than 24.05 here (found {version})")
    two_racks = ["hardware=slurm_cpu", "model=tiny", "hardware.racks=2", "hardware.mesh.replica_dcn=2",
                 "hardware.segment_nodes=1"]
    code = launch_here(*two_racks, f"run.out_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/m.db")
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.strip() == f"error: {slurm.placement_problem(make_config(*two_racks), version)}"
    assert f"hardware.segment_nodes=1: Slurm {version[0]}.{version[1]:02d} has no --segment" in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "m.db").exists()
