"""Naming a run or a sweep (marin.track.refs): unique prefixes of names and ids, a sweep's job by its
override name. Run and sweep directories made by hand (the files the resolver reads): no store."""
import json

import pytest

from marin.track import record, refs, sweep

RUN_A = "a1b2c3d4" + "0" * 24
RUN_B = "a1b2ffff" + "1" * 24
PARENT = "9f8e7d6c" + "2" * 24


def _run(out, name: str, run_id: str):
    run_dir = out / "runs" / name
    run_dir.mkdir(parents=True)
    info = {"run_id": run_id, "tracking_uri": f"sqlite:///{out}/mlflow.db", "experiment": "default"}
    (run_dir / record.INFO).write_text(json.dumps(info))
    (run_dir / record.COMPOSED).write_text("train: {}\n")
    return run_dir


@pytest.fixture
def out(tmp_path):
    """Two runs, and a sweep `router_ablation` whose jobs are those runs (qb and softmax_aux)."""
    a = _run(tmp_path, "tiny-0a0a0a0a-20261201-100000-abcdef", RUN_A)
    b = _run(tmp_path, "tiny-0a0a0a0a-20261201-110000-123456", RUN_B)
    folder = tmp_path / "sweeps" / "router_ablation-5e5e5e5e"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({"parent_run_id": PARENT, "tracking_uri": "sqlite:///x"}))
    jobs = [{"run_id": RUN_A, "run_dir": str(a), "overrides": ["router=qb", "optim.lr=0.001"]},
            {"run_id": RUN_B, "run_dir": str(b), "overrides": ["router=softmax_aux", "optim.lr=0.001"]}]
    (folder / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return tmp_path


def test_a_unique_prefix_of_a_run_id_or_directory_name(out):
    assert refs.find_run("a1b2c3", out).name.endswith("abcdef")
    assert refs.find_run("tiny-0a0a0a0a-20261201-11", out).name.endswith("123456")
    assert record.open("a1b2ff", out_dir=out).run_id == RUN_B  # every tool opens runs through record.open
    with pytest.raises(refs.RefError, match=r"a1b2: names 2 runs: .*; give more of it"):
        refs.find_run("a1b2", out)
    with pytest.raises(record.RecordError, match="no run directory, directory name, run id or unique prefix"):
        record.open("zzz", out_dir=out)
    assert refs.find_run(RUN_A.replace("a1", "b1"), out) == RUN_A.replace("a1", "b1")  # a full id: the store's
    # an empty name was the working directory (Path("")): `marin.diff "" run` read it as a run
    with pytest.raises(refs.RefError, match="^the run is empty: give its directory, its name or its MLflow run id$"):
        refs.find_run("", out)


def test_a_sweeps_job_by_its_override_name(out):
    assert refs.find_run("router_ablation/router=qb", out).name.endswith("abcdef")  # part of lr=0.001,router=qb
    assert refs.find_run("router_ablation-5e5e/lr=0.001,router=softmax_aux", out).name.endswith("123456")
    assert refs.find_run("9f8e7d/router=softmax_aux", out).name.endswith("123456")  # the parent's id prefix
    assert refs.find_run("router_ablation/lr:0.001+router:qb", out).name.endswith("abcdef")  # as Hydra takes it
    with pytest.raises(refs.RefError, match="names 2 jobs"):
        refs.find_run("router_ablation/lr=0.001", out)
    with pytest.raises(refs.RefError, match=r"no job of sweep router_ablation-5e5e5e5e is named router=x \(its jobs: "):
        refs.find_run("router_ablation/router=x", out)
    gone = out / "runs" / "tiny-0a0a0a0a-20261201-100000-abcdef"
    gone.rename(out / "elsewhere")
    assert refs.find_run("router_ablation/router=qb", out) == RUN_A  # not here: the store knows its directory


def test_a_sweep_by_name_directory_or_prefix(out):
    folder = out / "sweeps" / "router_ablation-5e5e5e5e"
    assert refs.find_sweep("router_ablation", out) == folder
    assert refs.find_sweep("router_abl", out) == folder and refs.find_sweep("9f8e", out) == folder
    assert refs.names_sweep("router_ablation", out) and not refs.names_sweep("a1b2c3", out)
    assert refs.find_sweep("lr_grid", out) == "lr_grid"  # open_parent says there is no such sweep
    with pytest.raises(sweep.SweepNotFound, match="no sweep of that name"):
        refs.open_sweep("lr_grid", out_dir=out)


def test_a_runs_own_name_still_names_it_beside_its_replays_and_forks(tmp_path):
    """A replay (`<name>-verify`, `<name>-reproduce`) or a fork (`<name>-step3`) starts with its
    original's name: that name, given whole, still names the original alone."""
    original = _run(tmp_path, "probe-0a0a0a0a-20261201-100000-abcdef", RUN_A)
    _run(tmp_path, "probe-verify-0a0a0a0a-20261201-110000-123456", RUN_B)
    _run(tmp_path, "probe-reproduce-0a0a0a0a-20261201-120000-654321", "c" * 32)
    assert refs.find_run("probe", tmp_path) == original
    assert refs.find_run("probe-verify", tmp_path).name.endswith("123456")
    with pytest.raises(refs.RefError, match="pro: names 3 runs"):  # a part of a name is still a prefix
        refs.find_run("pro", tmp_path)
    _run(tmp_path, "probe-0b0b0b0b-20261201-130000-fedcba", "d" * 32)
    with pytest.raises(refs.RefError, match="probe: names 2 runs"):  # two runs of that name: which one?
        refs.find_run("probe", tmp_path)


def test_a_sweeps_name_where_a_run_is_wanted_lists_its_jobs_as_status_names_them(tmp_path):
    """`marin.diff grid …`: the sweep's job directories all begin with its name; the error named
    four directories and said "give more of it", where the spelling that works is grid/<job>."""
    folder = tmp_path / "sweeps" / "grid-5e5e5e5e"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({"parent_run_id": PARENT, "tracking_uri": "sqlite:///x"}))
    jobs = []
    for i, lr in enumerate(("0.001", "0.003")):
        run_dir = _run(tmp_path, f"grid-lr={lr}-0a0a0a0a-20261201-10000{i}-abcde{i}", f"{i}" * 32)
        jobs.append({"run_id": f"{i}" * 32, "run_dir": str(run_dir), "overrides": [f"optim.lr={lr}"]})
    (folder / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs))
    with pytest.raises(refs.RefError) as err:
        refs.find_run("grid", tmp_path)
    assert str(err.value) == "grid: a sweep of 2 jobs, not one run: name a job, grid/lr=0.001, grid/lr=0.003"
    assert refs.find_run("grid/lr=0.003", tmp_path).name.startswith("grid-lr=0.003-")
