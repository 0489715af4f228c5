"""Sweeps in MLflow: one parent per launch, a child per job, the parent closed by the last job.
(`multirun_job` runs a job's record creation as Hydra's basic launcher would: see conftest.)"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from marin.config.paths import PROJECT_ROOT
from marin.track import record, sweep, tracker
from tests.helpers import new_store


def _launch(multirun_job, monkeypatch, lrs):
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=lr_grid", "model=tiny"])
    return [record.create(*multirun_job(i, "sweep=lr_grid", f"optim.lr={lr}")) for i, lr in enumerate(lrs)]


def test_one_parent_per_launch_and_a_child_per_job(store, multirun_job, monkeypatch):
    lrs = [0.001, 0.003, 0.01, 0.03]
    first = _launch(multirun_job, monkeypatch, lrs)
    second = _launch(multirun_job, monkeypatch, lrs[:1])
    client = MlflowClient(store["uri"])
    runs = [client.get_run(r.run_id) for r in first]
    parent_ids = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parent_ids) == 1
    parent = client.get_run(parent_ids.pop())
    assert parent.data.tags["sweep_role"] == "parent" and parent.data.tags["sweep"] == "lr_grid"
    assert parent.data.tags["expected_jobs"] == "4"
    assert [json.loads(r.data.tags["sweep_overrides"]) for r in runs] == [[f"optim.lr={lr}"] for lr in lrs]
    assert client.get_run(second[0].run_id).data.tags["mlflow.parentRunId"] != parent.info.run_id  # new launch

    sweep_dir = runs[0].data.tags["sweep_dir"]
    info = json.loads((Path(sweep_dir) / "sweep.json").read_text())
    assert info["parent_run_id"] == parent.info.run_id
    assert len((Path(sweep_dir) / "jobs.jsonl").read_text().splitlines()) == 4

    for i, rec in enumerate(first):   # the parent ends with its last job
        assert client.get_run(parent.info.run_id).info.status == "RUNNING"
        tracker.Tracker(rec).finish("FINISHED" if i < 3 else "FAILED")
    assert client.get_run(parent.info.run_id).info.status == "FAILED"


def test_a_sweeps_jobs_are_named_after_it_and_their_own_overrides(store, multirun_job, monkeypatch):
    """Run directories (and run.name) of a sweep's jobs say which job each is, not `default-…`."""
    made = _launch(multirun_job, monkeypatch, [0.001, 0.03])
    assert [r.run_dir.name.rsplit("-", 4)[0] for r in made] == ["lr_grid-lr=0.001", "lr_grid-lr=0.03"]
    assert made[0].resolved().run.name == "lr_grid-lr=0.001"
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "optim.lr=0.001,0.003", "run.name=probe"])
    named = record.create(*multirun_job(0, "run.name=probe", "optim.lr=0.001"))  # a plain -m: its run.name
    assert named.run_dir.name.startswith("probe-lr=0.001-")


def test_job_names_keep_to_the_run_name_rules():
    from marin.config.validate import RUN_NAME

    def member(*own, number=None):
        return sweep.Membership("ladder", "abc", Path("x"), {}, list(own), None, "default", number)

    assert sweep.job_name("default", member("model={name:d64,d_model:64}", "data.root=/a b")) == "ladder-model=d64+root=_a_b"
    assert sweep.job_name("mine", member(number=3)) == "mine-job3"        # nothing swept of its own: its number
    assert sweep.job_name("mine-job3", member(number=3)) == "mine-job3"   # a job's name is made once
    assert sweep.job_name("default", None) == "default"                   # not a sweep's job
    odd = sweep.Membership(".my sweep", "abc", Path("x"), {}, ["optim.lr=0.1"], None, "default")
    assert sweep.job_name("default", odd) == "my_sweep-lr=0.1"            # a run.sweep is not checked: this is
    assert RUN_NAME.fullmatch(sweep.job_name("default", member(f"optim.lr={'1' * 300}")))


def test_explicit_sweep_id_joins_an_existing_parent(store, multirun_job, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch.py"])
    a = record.create(*multirun_job(0, "sweep=capacity_factor", "run.sweep_id=joined"))
    b = record.create(*multirun_job(0, "sweep=capacity_factor", "run.sweep_id=joined"))
    client = MlflowClient(store["uri"])
    parents = {client.get_run(r.run_id).data.tags["mlflow.parentRunId"] for r in (a, b)}
    assert len(parents) == 1


def test_sqlite_store_refused_for_a_slurm_sweep(store, multirun_job, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=lr_grid"])
    job = multirun_job(0, "sweep=lr_grid", "hardware=slurm_cpu", "run.name=sqlite-slurm")
    with pytest.raises(sweep.SweepError, match="one writer at a time.*tracking.uri=http"):
        record.create(*job)
    assert not list(store["out"].glob("runs/sqlite-slurm-*"))


def _launch_py(*args):
    return subprocess.run([sys.executable, "launch.py", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300)


def test_every_sweep_composes_as_a_dry_run():
    done = _launch_py("-m", "sweep=lr_grid", "train.steps=2", "model=tiny", "dry_run=json")
    assert done.returncode == 0, done.stderr[-2000:]
    plans = [json.loads(line) for line in done.stdout.splitlines()]  # one JSON line per job
    assert [next(o for o in p["overrides"] if o.startswith("optim.lr=")) for p in plans] == [f"optim.lr={lr}" for lr in ("0.001", "0.003", "0.01", "0.03")]
    assert [p["lr"]["adamw"] for p in plans] == [0.001, 0.003, 0.01, 0.03]
    done = _launch_py("-m", "sweep=ladder_cpu", "dry_run=true")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()  # one row per job under one header, not a table per job
    assert len(lines) == 4 and lines[0].split()[:4] == ["job", "d", "×", "L"], done.stdout
    assert [" ".join(line.split()[1:4]) for line in lines[1:]] == ["64 × 2", "96 × 3", "128 × 4"]
    assert [line.split()[0] for line in lines[1:]] == ["1/3", "2/3", "3/3"]


def test_a_bad_job_stops_the_multirun_before_anything(tmp_path):
    """Job 2 is invalid: one line names its overrides and field, exit 2, nothing trained or written."""
    done = _launch_py("-m", "model=micro", "train.steps=2", "optim.lr=1e-3,-1", f"run.out_dir={tmp_path}/out",
                      f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: job 2/2 (optim.lr=-1): optim.lr: must be 'auto' or a finite number > 0; got -1"]
    assert not list(tmp_path.iterdir())


def test_check_jobs_names_each_bad_job():
    """The checks the local and the Slurm paths share (a Slurm array is validated as a whole)."""
    from marin.launch.multirun import Job, check_jobs, labels
    from tests.helpers import compose_dict

    grid = [["hardware=slurm_cpu", "optim.lr=1e-3"], ["hardware=slurm_cpu", "optim.lr=-2"],
            ["hardware=slurm_cpu", "train.seq_len=0"]]
    jobs = [Job(i, o, task=compose_dict("model=tiny", *o), label=label) for i, (o, label) in enumerate(zip(grid, labels(grid)))]
    assert [j.slurm for j in jobs] == [True, True, True]
    lines = check_jobs(jobs)
    assert lines == ["job 2/3 (optim.lr=-2): optim.lr: must be 'auto' or a finite number > 0; got -2",
                     "job 3/3 (train.seq_len=0): train.seq_len: must be an integer in [2, 2147483647]; got 0"]
    assert jobs[0].resolved.optim.lr == 1e-3 and jobs[1].resolved is None


def test_children_are_named_by_their_overrides():
    assert sweep.child_name(["optim.lr=0.001", "router=qb"]) == "lr=0.001,router=qb"
    assert sweep.child_name(["model={name:ladder_cpu_d64,d_model:64,num_layers:2}"]) == "model=ladder_cpu_d64"
    assert sweep.child_name(["optim.lr=1", "schedule.lr=2"]) == "optim.lr=1,schedule.lr=2"  # clashing keys stay whole
    assert sweep.child_name([]) is None


def test_end_closes_the_parent_with_its_jobs(store, multirun_job, monkeypatch):
    """The launcher's last step: a job that died in this process fails, and the parent with it;
    an interrupted launch ends KILLED."""
    from hydra.core.hydra_config import HydraConfig

    client = MlflowClient(store["uri"])
    for interrupted, expected in ((False, "FAILED"), (True, "KILLED")):
        monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=lr_grid"])
        composed, resolved, overrides = multirun_job(0, "sweep=lr_grid", "optim.lr=0.001")
        launch = sweep.begin(resolved, expected=2)
        assert client.get_run(launch.parent_id).data.tags["expected_jobs"] == "2"
        done = record.create(composed, resolved, overrides)
        died = record.create(*multirun_job(1, "sweep=lr_grid", "optim.lr=0.003"))
        assert {client.get_run(r.run_id).data.tags["mlflow.parentRunId"] for r in (done, died)} == {launch.parent_id}
        tracker.Tracker(done).finish("FINISHED")
        assert sweep.end(launch, interrupted) == expected
        assert client.get_run(died.run_id).info.status == ("KILLED" if interrupted else "FAILED")
        assert client.get_run(launch.parent_id).info.status == expected
        HydraConfig.instance().cfg = None
    from mlflow.entities import ViewType
    names = {e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
    assert "Default" not in names and "default" in names


@pytest.mark.slow
def test_local_sweep_life_cycle(tmp_path, capsys):
    """Start (the parent is shown first), a job that fails does not stop the others, the parent
    ends FAILED with them, and `marin.status` finds the sweep by name."""
    out, uri = tmp_path / "out", new_store(tmp_path)
    # 5 steps: the warmup starts at lr 0, so 1e30 reaches the weights at step 1 and the loss of a
    # later step is not finite
    done = _launch_py("-m", "model=micro", "train.steps=5", "train.seq_len=32", "train.global_batch=4",
                      "optim.lr=1e30,1e-3", f"run.out_dir={out}",
                      f"tracking.uri={uri}", "run.sweep=life",
                      f"data.cache_dir={PROJECT_ROOT}/outputs/cache/tokens-tests")
    assert done.returncode == 3, done.stderr[-3000:]   # the worst job's status: a non-finite loss
    err = done.stderr
    assert err.index("sweep life: 2 jobs, MLflow parent run") < err.index("job 1/2: optim.lr=1e+30")
    assert "job 2/2: optim.lr=0.001" in err and "error: job 1/2 (optim.lr=1e+30) failed (exit status 3)" in err
    parent_id = err.split("MLflow parent run ")[1].split()[0]
    client = MlflowClient(uri)
    assert client.get_run(parent_id).info.status == "FAILED"
    from marin import status

    capsys.readouterr()
    assert status.main(["life", "--out-dir", str(out)]) == 0
    rows = {line.split()[0]: line.split()[1:4] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["lr=0.001"][:2] == ["FINISHED", "5/5"] and rows["lr=1e+30"][0] == "FAILED"


def test_sweep_typos_fail_before_any_job():
    done = _launch_py("-m", "sweep=lr_gird", "dry_run=true")
    assert done.returncode != 0 and "sweep=lr_gird: no such option of sweep; did you mean lr_grid?" in done.stderr
    done = _launch_py("-m", "sweep=lr_grid", "optim.lrr=1,2", "dry_run=true")
    assert done.returncode != 0 and "lrr" in done.stderr and "job 1/" not in done.stderr
    # a value listed twice ran the same run twice, both jobs under one name
    done = _launch_py("-m", "optim.lr=0.001,0.002,0.001", "dry_run=true")
    assert (done.returncode, done.stderr) == (
        2, "error: job 3/3 (optim.lr=0.001): the same overrides as job 1: a value is listed twice\n")


def test_every_job_of_every_sweep_validates():
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from marin.config.paths import SWEEPS_DIR
    from marin.config.store import options
    from tests.helpers import make_config

    parser = OverridesParser.create()
    for name in options("sweep"):
        params = OmegaConf.load(SWEEPS_DIR / f"{name}.yaml").hydra.sweeper.params
        swept = [parser.parse_override(f"{k}={v}") for k, v in params.items()]
        grid = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in swept]
        for job in itertools.product(*grid):
            cfg = make_config(f"sweep={name}", "model=tiny", *job)
            assert cfg.run.sweep == name
