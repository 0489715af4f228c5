"""A sweep's jobs and an A/B's arms are runs like any other: every tool takes them by the name
`marin.status` prints (`grid/lr=0.001`, `ab/ab=control`), although those names and their
directories hold `=`, which Hydra's override grammar refuses unquoted. One real 2-job multirun,
shared by the tests of this module."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marin.config.paths import PROJECT_ROOT
from tests.helpers import launch_here, new_store

GRID = ["model=micro", "train.seq_len=32", "train.global_batch=4", "train.steps=6", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint.every_steps=2", "train.checkpoint.keep_last=3",
        "run.sweep=grid"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["value"] for r in rows if r["key"] == "train/loss"}


def _status_names(sweep: str, where: list[str], capsys) -> dict[str, str]:
    """{job name as `marin.status <sweep>` prints it: its run id}."""
    from marin import status

    capsys.readouterr()
    assert status.main([sweep, *where]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    return {line.split()[0]: line.split()[-1] for line in rows if line.strip()}


def _new_run(out: Path, before: set) -> Path:
    (made,) = set((out / "runs").iterdir()) - before
    return made


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """(out dir, store uri, the `lr=0.001` job's directory) of a finished 2-job multirun, 6 steps
    with checkpoints at 2, 4 and 6."""
    root = tmp_path_factory.mktemp("sweep_jobs")
    out, uri = root / "out", new_store(root)
    done = subprocess.run([sys.executable, "launch.py", "-m", *GRID, "optim.lr=1e-3,3e-3", f"run.out_dir={out}",
                           f"tracking.uri={uri}", f"data.cache_dir={PROJECT_ROOT}/outputs/cache/tokens-tests"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (job,) = (out / "runs").glob("grid-lr=0.001-*")
    return out, uri, job


def test_quote_run_references_quotes_only_what_hydra_would_refuse():
    from marin.launch.entry import quote_run_references

    assert quote_run_references(["launch.py", "reproduce=grid/lr=0.001", "fork=/o/runs/a-lr=1-x@3", "+resume=a=b",
                                 "resume=tiny", "fork=a@3,b@3", "train.init_from='a=b@2'", "run.name=x"]) == [
        "launch.py", "reproduce='grid/lr=0.001'", "fork='/o/runs/a-lr=1-x@3'", "+resume='a=b'",
        "resume=tiny", "fork=a@3,b@3", "train.init_from='a=b@2'", "run.name=x"]


@pytest.mark.parametrize("key, at", [("resume", ""), ("fork", "@3"), ("train.init_from", "@3"), ("reproduce", "")])
def test_a_pasted_run_directory_with_brackets_commas_or_quotes_reads_back(tmp_path, key, at):
    """issue 42's probe: `resume=<run dir>` pasted for a directory holding `(`, `,` or `'` failed in
    Hydra's grammar (mismatched input '('); a value that names an existing path is quoted for it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from marin.launch.entry import quote_run_references

    run_dir = tmp_path / "we(ird),x'y" / "runs" / "probe-1"
    run_dir.mkdir(parents=True)
    [arg] = quote_run_references([f"{key}={run_dir}{at}"])
    assert OverridesParser.create().parse_override(arg).value() == f"{run_dir}{at}"
    assert quote_run_references([f"{key}=a{at},b{at}"]) == [f"{key}=a{at},b{at}"]   # no such path: a sweep


@pytest.mark.parametrize("value", ["grid-lr=0.001-reproduce", "/o/runs/g-lr=0.001,router=qb-ab=control-1a2b@4",
                                   "it's", "a\\'b", "back\\", "99e73426", "a b[c]{d}(e):f", "mochi-launch@81716"])
def test_an_override_reads_back_as_the_value_it_was_made_from(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from marin.config.store import override

    assert OverridesParser.create().parse_override(override("k", value)).value() == value
    if value == "mochi-launch@81716":
        assert override("k", value) == "k=mochi-launch@81716"  # quoted only where Hydra needs it


@pytest.mark.slow
def test_a_sweep_job_is_reproduced_bit_for_bit_by_its_status_name(grid, capsys, caplog):
    out, uri, job = grid
    where = [f"run.out_dir={out}", f"tracking.uri={uri}"]
    names = _status_names("grid", ["--out-dir", str(out)], capsys)
    assert set(names) == {"lr=0.001", "lr=0.003"}
    ref = "grid/lr=0.001"                                                  # as marin.status prints it
    # pasted into launch.py as it is (Hydra's parser would refuse the second `=`)
    done = subprocess.run([sys.executable, "launch.py", f"reproduce={ref}", "dry_run=true", *where],
                          cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    before = set((out / "runs").iterdir())
    assert launch_here(f"reproduce={ref}", *where) == 0
    # its name was made by the sweep, not by conf/: no "changed since the run" about it
    assert "keeping the saved values of run.name" not in caplog.text
    copy = _new_run(out, before)
    assert copy.name.startswith("grid-lr=0.001-reproduce-")
    assert _losses(copy) == _losses(job) and len(_losses(job)) == 6       # bit for bit
    assert launch_here(f"reproduce={ref}", "verify=true", "verify_steps=3:4", *where) == 0   # exit 0: all equal
    # verified again, from the reproduction's own saved overrides (its quoted run.name) and directory
    assert launch_here(f"reproduce={copy}", "verify=true", "verify_steps=5:6", *where) == 0


@pytest.mark.slow
def test_a_multirun_of_reproductions_is_checked_before_its_first_job(grid):
    """Each job of `-m reproduce=<job> optim.lr=…` is recomposed from the saved run before any
    runs: a bad value stops the multirun (it failed in its own job after the others had run)."""
    out, uri, _ = grid
    before = set((out / "runs").iterdir())
    done = subprocess.run([sys.executable, "launch.py", "-m", "reproduce=grid/lr=0.001", "optim.lr=0.1,-0.2",
                           f"run.out_dir={out}", f"tracking.uri={uri}"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (
        2, "error: job 2/2 (optim.lr=-0.2): optim.lr: must be 'auto' or a finite number > 0; got -0.2\n")
    assert set((out / "runs").iterdir()) == before


@pytest.mark.slow
def test_a_sweep_job_is_forked_resumed_followed_started_from_and_sampled_by_its_status_name(grid, capsys):
    from marin import generate, lineage

    out, uri, job = grid
    where = [f"run.out_dir={out}", f"tracking.uri={uri}"]
    before = set((out / "runs").iterdir())
    assert launch_here("fork=grid/lr=0.001@2", "train.stop_after=4", *where) == 0
    fork = _new_run(out, before)
    assert fork.name.startswith("grid-lr=0.001-step2-")
    assert _losses(fork) == {s: v for s, v in _losses(job).items() if s in (3, 4)}   # its parent's steps, bit for bit
    assert launch_here(f"resume={fork}", *where) == 0                      # on to step 6: its own run
    assert _losses(fork) == {s: v for s, v in _losses(job).items() if s > 2}
    capsys.readouterr()
    lineage.main([str(fork), "--out-dir", str(out), "--tracking-uri", uri])
    parent_id = json.loads((job / "record.json").read_text())["run_id"]
    assert parent_id in capsys.readouterr().out                            # the chain goes back to the job
    before = set((out / "runs").iterdir())                                 # a new run from its weights
    assert launch_here(*GRID[:-1], "train.steps=2", "train.init_from=grid/lr=0.001@5", *where) == 0
    info = json.loads((_new_run(out, before) / "record.json").read_text())["init_from"]
    assert info["step"] == 4 and Path(info["run_dir"]) == job, info
    assert generate.main(["grid/lr=0.001", "--prompt-ids", "72,105", "--max-new-tokens", "2", "--json",
                          "--out-dir", str(out), "--tracking-uri", uri]) == 0
    assert f"checkpoint: step 6 of run {job.name} ({parent_id})" in capsys.readouterr().err


@pytest.mark.slow
def test_an_ab_from_a_sweep_job_and_a_fork_of_its_arm_by_their_status_names(grid, capfd):
    from marin import ab

    out, uri, job = grid
    where = [f"run.out_dir={out}", f"tracking.uri={uri}"]
    ab.main(["grid/lr=0.001@2", "optim.lr=0.005", "--steps", "2", "--out-dir", str(out), "--tracking-uri", uri])
    said = capfd.readouterr().out
    assert "control vs parent: train/loss bit-for-bit equal at steps 3…4 (2 steps)" in said, said
    assert said.strip().splitlines()[-1].startswith("verdict: candidate ")
    # the candidate's value beats the job's own saved `optim.lr=1e-3` (a value override, which
    # Hydra applies after any group option's: the arm was the control again, silently)
    assert re.search(r"changes: .*optim.lr: 0.001 → 0.005", said), said
    (candidate,) = (out / "runs").glob("grid-lr=0.001-step2-ab=candidate-*")
    assert yaml.safe_load((candidate / "resolved.yaml").read_text())["optim"]["lr"] == 0.005
    assert _losses(candidate)[4] != _losses(job)[4]
    names = _status_names("ab", ["--out-dir", str(out)], capfd)
    assert set(names) == {"ab=candidate", "ab=control"}
    # the control arm (`…-ab=control-…`) forked at its last checkpoint: the sweep job's step 5 again
    before = set((out / "runs").iterdir())
    assert launch_here("fork=ab/ab=control@4", "train.stop_after=5", *where) == 0
    fork = _new_run(out, before)
    assert re.match(r"grid-lr=0\.001-step2-ab=control-step4-", fork.name), fork.name
    assert _losses(fork) == {5: _losses(job)[5]}


def test_where_to_look_is_read_from_quoted_overrides_as_hydra_reads_them(tmp_path):
    """`run.out_dir` and `tracking.uri` given quoted (as marin quotes a value holding `=`) name
    the folder and store, not a path with quotes in it."""
    from marin.launch.reproduce import lookup_uri, out_dir

    folder = tmp_path / "a=b"
    assert out_dir([f"run.out_dir='{folder}'"]) == folder
    assert lookup_uri([f"tracking.uri='sqlite:///{folder}/m.db'"]) == f"sqlite:///{folder}/m.db"


def test_the_sweep_directory_is_printed_absolute(tmp_path, monkeypatch):
    """`directory:` and the `watch it` command name the sweep absolutely, also when it lies under
    the working directory (it was shown relative to it: wrong once pasted from another folder)."""
    from hydra_plugins.marin_launcher.marin_launcher import announce
    from marin.track import sweep

    folder = tmp_path / "outputs" / "sweeps" / "lr_grid-0a1b2c3d"
    monkeypatch.chdir(tmp_path)
    text = announce(sweep.Launch("lr_grid", "0a1b2c3d", "f" * 32, folder, "sqlite:///x.db", "default"), 3)
    assert f"  directory: {folder}\n" in text and text.endswith(f"python -m marin.status {folder}")
