"""`resume=`: a stopped run continues in its own directory and MLflow run; a shortened horizon
is applied as the failure plan and recorded as a tag and a new config artifact (MLflow params
are immutable). The Slurm branch is exercised with the probe entry on the local cluster."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import launch_here, new_store, signals_kept

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=micro", "train.steps=16", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint.every_steps=3"]


def launch(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


def run_dir_of(done) -> Path:
    match = re.search(r"run directory: (\S+)", done.stdout + done.stderr)
    assert match, done.stdout + done.stderr
    return Path(match.group(1))


@pytest.mark.slow
def test_stopped_local_run_resumes_with_a_shortened_horizon(tmp_path, capsys):
    from mlflow import MlflowClient

    uri = new_store(tmp_path)
    assert launch_here(*TINY, "train.stop_after=6", f"run.out_dir={tmp_path}", f"tracking.uri={uri}") == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    run_id = json.loads((run_dir / "record.json").read_text())["run_id"]

    capsys.readouterr()
    assert launch_here(f"resume={run_dir}", "schedule.horizon_steps=12", "dry_run=true") == 0
    dry = capsys.readouterr().out
    assert "newest checkpoint: step 6" in dry and "schedule.horizon_steps: None → 12" in dry
    assert "resumes" not in json.loads((run_dir / "record.json").read_text())  # a dry run changes nothing

    # the resume as a user runs it, in a process of its own

    second = launch(f"resume={run_dir}", "train.stop_after=null", "schedule.horizon_steps=12")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming run {run_id} in {run_dir}" in second.stdout
    for noise in ("libtpu", "backend started before", "reproducing", "uncommitted changes"):  # as quiet as a fresh run
        assert noise not in second.stdout + second.stderr, second.stderr[-3000:]
    assert "schedule.horizon_from_step: None → 6" in second.stdout      # the failure plan, from the checkpoint

    info = json.loads((run_dir / "record.json").read_text())
    assert info["resumes"][0]["changes"]["schedule.horizon_steps"] == [None, 12]
    assert (run_dir / "resolved.resume-1.yaml").is_file()
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert "schedule.horizon_steps: None → 12" in run.data.tags["resume_1"] and run.data.tags["horizon_steps"] == "12"
    assert run.data.params["schedule.horizon_steps"] == "None"            # params stay as first logged
    assert "record/resolved.resume-1.yaml" in [a.path for a in client.list_artifacts(run_id, "record")]
    steps = sorted({m.step for m in client.get_metric_history(run_id, "train/loss")})
    assert steps == list(range(1, 13))                                     # 1..6, then 7..12: one run, no gap
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_run_resumes_in_the_same_directory(tmp_path, tracking_uri):
    import os

    env = {**os.environ, "MARIN_SLURM_ENTRY": "tests.launch.slurm_entries:probe"}
    one_task = ("hardware.tasks_per_node=1", "hardware.mesh.expert=1")  # a job's tasks: tests/launch/test_slurm.py
    first = launch("hardware=slurm_cpu", *one_task, "model=micro", "wait=true", f"run.out_dir={tmp_path}",
                   f"tracking.uri={tracking_uri}", env=env)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    run_dir = run_dir_of(first)
    (run_dir / "probe-0.json").unlink()
    again = launch(f"resume={run_dir}", "wait=true", env=env)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert run_dir_of(again) == run_dir and (run_dir / "probe-0.json").is_file()
    assert len(json.loads((run_dir / "record.json").read_text())["slurm_jobs"]) == 2


# ---------------------------------------------------------------- nothing is ever lost

@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A tiny run trained in-process to step 6 of 16 (checkpoints 3 and 6), shared read-only."""
    from marin.launch.checks import load
    from marin.track import record
    from marin.train.loop import train
    from tests.helpers import compose_dict

    tmp = tmp_path_factory.mktemp("stopped")
    overrides = [*TINY, "train.stop_after=6", f"run.out_dir={tmp}", f"tracking.uri={new_store(tmp)}"]
    composed, resolved = load(compose_dict(*overrides))
    rec = record.create(composed, resolved, overrides)
    with signals_kept():
        train(resolved, rec)
    return rec


def _listing(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _copy_into_new_run(rec, tmp_path, up_to: int | None = None):
    """A fresh run record with the same config and a copy of `rec`'s checkpoints (to damage), those
    at or below step `up_to` when given (an earlier test resumes `rec` to its end)."""
    import shutil

    from marin.launch.checks import load
    from marin.track import record
    from tests.helpers import compose_dict

    overrides = record.RunRecord(rec.run_dir, rec.run_id, rec.tracking_uri, rec.experiment_name).overrides()
    composed, resolved = load(compose_dict(*overrides))
    copy = record.create(composed, resolved, overrides)
    source = rec.run_dir / "checkpoints"

    def later(folder, names):  # step folders past up_to, not files within a step that have numbers for names
        return [n for n in names if up_to is not None and Path(folder) == source and n.isdigit() and int(n) > up_to]

    shutil.copytree(source, copy.run_dir / "checkpoints", ignore=later)
    return copy


@pytest.mark.parametrize("override", ["model.num_experts=8", "optim.grad_clip=1.0"])
def test_resume_refuses_a_structure_change_and_touches_nothing(stopped_run, override, capsys):
    from mlflow import MlflowClient

    from marin.launch.resume import resume

    run_dir = stopped_run.run_dir
    before = (_listing(run_dir), (run_dir / "record.json").read_text())
    status = MlflowClient(stopped_run.tracking_uri).get_run(stopped_run.run_id).info.status
    with pytest.raises(SystemExit) as exit_:
        resume([f"resume={run_dir}", override])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: resume: ") and override.split("=")[0] in line and ("opt_state." in line or "params." in line)
    assert f"reproduce={run_dir} {override}" in line
    assert (_listing(run_dir), (run_dir / "record.json").read_text()) == before   # no .corrupt, no record change
    assert MlflowClient(stopped_run.tracking_uri).get_run(stopped_run.run_id).info.status == status


def test_resume_with_only_damaged_checkpoints_fails_and_sets_them_aside(stopped_run, tmp_path, capsys):
    from mlflow import MlflowClient

    from marin.launch.resume import resume

    copy = _copy_into_new_run(stopped_run, tmp_path)
    for step_dir in (copy.run_dir / "checkpoints").iterdir():
        victim = next(f for f in (step_dir / "meta").rglob("*") if f.is_file() and f.name != "commit_success.txt")
        victim.write_bytes(victim.read_bytes().replace(b"6", b"7").replace(b"3", b"4"))
    with pytest.raises(SystemExit) as exit_:
        resume([f"resume={copy.run_dir}"])
    assert exit_.value.code == 1
    assert "no intact checkpoint" in capsys.readouterr().err.strip().splitlines()[-1]
    assert _listing(copy.run_dir) == ["3.corrupt", "6.corrupt"]                 # kept, never deleted
    assert "resumes" not in json.loads((copy.run_dir / "record.json").read_text())
    assert MlflowClient(copy.tracking_uri).get_run(copy.run_id).info.status == "FAILED"
    with pytest.raises(SystemExit):   # and a plain resume= never starts again from step 0
        resume([f"resume={copy.run_dir}"])


def test_nan_right_after_a_restore_names_the_checkpoint(stopped_run, tmp_path, capsys):
    import jax
    import jax.numpy as jnp
    from omegaconf import OmegaConf

    from marin.config.schema import Config
    from marin.launch.checks import load
    from marin.launch.resume import resume
    from marin.train.checkpoint import Checkpointer, abstract_state

    copy = _copy_into_new_run(stopped_run, tmp_path)
    _, cfg = load(OmegaConf.merge(OmegaConf.structured(Config), copy.composed()))
    ckpt = Checkpointer(copy.run_dir, cfg)
    state, _ = ckpt.restore(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_state(cfg)))
    poisoned = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params), step=state.step + 1)
    ckpt.save(7, poisoned, {}, force=True)   # a checkpoint with a valid manifest, bad values
    ckpt.close()
    with pytest.raises(SystemExit) as exit_:
        resume([f"resume={copy.run_dir}"])
    assert exit_.value.code == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "non-finite loss" in line and str(copy.run_dir / "checkpoints" / "7") in line and "lr" not in line


def test_resume_runs_to_the_end_without_the_first_stop_after(stopped_run, capsys, caplog):
    """Last in the module: it continues the shared run (steps 6..15). Its changes are shown once."""
    import logging

    from mlflow import MlflowClient

    from marin.launch.resume import resume

    with caplog.at_level(logging.INFO):
        resume([f"resume={stopped_run.run_dir}", "schedule.horizon_steps=16"])
    shown = capsys.readouterr()
    assert (shown.out + shown.err + caplog.text).count("schedule.horizon_steps: None → 16") == 1
    assert "run.out_dir" not in shown.out  # the run keeps its own folder: not a change
    client = MlflowClient(stopped_run.tracking_uri)
    assert sorted({m.step for m in client.get_metric_history(stopped_run.run_id, "train/loss")}) == list(range(1, 17))
    assert client.get_run(stopped_run.run_id).info.status == "FINISHED"
    info = json.loads((stopped_run.run_dir / "record.json").read_text())
    assert len(info["resumes"]) == 1 and "train.stop_after" not in info["resumes"][0]["changes"]


def test_a_run_reference_reads_as_typed_even_when_it_looks_like_a_number():
    """An id prefix is hex: `resume=12e4` or `reproduce=1e10` is a run, not a float (Hydra's
    parser made them 120000.0 and 10000000000.0, so the run was never found)."""
    from omegaconf import OmegaConf

    from marin.launch.entry import keep_run_references
    from tests.helpers import compose_dict

    typed = ["resume=12e4", "reproduce=1e10", "fork=1e5@3", "train.init_from=12e4"]
    cfg = OmegaConf.create(compose_dict("model=micro", *typed))
    keep_run_references(cfg, typed)
    assert (cfg.resume, cfg.reproduce, cfg.fork, cfg.train.init_from) == ("12e4", "1e10", "1e5@3", "12e4")


def test_a_second_resume_of_a_run_being_trained_is_refused_and_writes_nothing(stopped_run, tmp_path, capsys):
    """Two `resume=` of one run at once: the first trains (here it hangs after its restore, holding
    the run), the second is one line, exit 2, and leaves the run's files as they were."""
    import time

    from marin.launch.resume import resume
    from marin.train.watchdog import HANG_MARKER

    first_step = min(int(p.name) for p in (stopped_run.run_dir / "checkpoints").iterdir() if p.name.isdigit())
    copy = _copy_into_new_run(stopped_run, tmp_path, up_to=first_step)
    first = subprocess.Popen([sys.executable, "launch.py", f"resume={copy.run_dir}", f"debug.hang_at_step={first_step + 1}"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (copy.run_dir / HANG_MARKER).exists():   # it restored its checkpoint and hangs
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.poll() is not None else "no hang"
            time.sleep(0.5)
        files = {p: p.read_bytes() for p in copy.run_dir.rglob("*") if p.is_file()}
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            resume([f"resume={copy.run_dir}"])
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and out == "" and err.count("\n") == 1, out + err
        assert f"is being trained by pid {first.pid} " in err and err.startswith("error: resume: "), err
        assert {p: p.read_bytes() for p in copy.run_dir.rglob("*") if p.is_file()} == files   # nothing written
    finally:
        first.kill()
        first.wait()


def test_a_fork_from_a_damaged_checkpoint_is_refused_naming_the_sound_ones(stopped_run, tmp_path, capsys):
    """fork=<run>@B with checkpoint B damaged: not a fork from A (the one before) under the name of
    B, but one line naming the damaged step and the sound ones, exit 2; no new run, the parent's
    files as they were. (A and B: the run's first two checkpoints, 3 and 6 until an earlier test
    resumes it to its end.)"""
    from omegaconf import OmegaConf

    from marin.launch.fork import fork

    a, b = sorted(int(p.name) for p in (stopped_run.run_dir / "checkpoints").iterdir() if p.name.isdigit())[:2]
    copy = _copy_into_new_run(stopped_run, tmp_path, up_to=b)
    victim = next(f for f in (copy.run_dir / "checkpoints" / str(b) / "meta").rglob("*")
                  if f.is_file() and f.name != "commit_success.txt")
    victim.write_bytes(victim.read_bytes().replace(str(b).encode(), str(b + 1).encode()))
    runs = copy.run_dir.parent
    before = (sorted(p.name for p in runs.iterdir()), {p: p.read_bytes() for p in copy.run_dir.rglob("*") if p.is_file()})
    capsys.readouterr()
    spec = f"{copy.run_dir}@{b}"
    with signals_kept(), pytest.raises(SystemExit) as exit_:   # steps past b to train, whatever b is
        fork(OmegaConf.create({"fork": spec, "dry_run": False}), [f"fork={spec}", "train.steps=40"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and err.count("\n") == 1 and out == "", out + err
    assert err.startswith("error: fork: ") and f"checkpoint {b} " in err and "damaged" in err and f"(sound: {a})" in err, err
    assert (sorted(p.name for p in runs.iterdir()),
            {p: p.read_bytes() for p in copy.run_dir.rglob("*") if p.is_file()}) == before   # nothing written


def test_an_init_from_a_damaged_named_step_is_refused_and_a_resume_does_not_read_its_source(stopped_run, tmp_path):
    """train.init_from=<run>@B with checkpoint B damaged restored A and logged "step B (asked B)":
    now one problem naming the sound ones, before anything is written. A resume of a run that
    started that way restores its own checkpoints: its source is not read again."""
    from marin.config.validate import ConfigError
    from marin.launch.checks import load
    from tests.helpers import compose_dict

    a, b = sorted(int(p.name) for p in (stopped_run.run_dir / "checkpoints").iterdir() if p.name.isdigit())[:2]
    copy = _copy_into_new_run(stopped_run, tmp_path, up_to=b)
    victim = next(f for f in (copy.run_dir / "checkpoints" / str(b) / "meta").rglob("*")
                  if f.is_file() and f.name != "commit_success.txt")
    victim.write_bytes(victim.read_bytes().replace(str(b).encode(), str(b + 1).encode()))
    cfg = compose_dict(*TINY, f"train.init_from={copy.run_dir}@{b}", "train.init_from_mode=weights",
                       f"run.out_dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError) as err:
        load(cfg)
    (field, message), = err.value.problems
    assert field == "train.init_from" and message.startswith(f"checkpoint {b} of {copy.run_dir} is damaged (")
    assert message.endswith(f"name a sound one (sound: {a})")
    assert load(cfg, resuming=True)[1].train.init_from == f"{copy.run_dir}@{b}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override", ["train.stop_after", "train.steps"])
def test_a_resume_that_would_stop_before_the_newest_checkpoint_trains_nothing(stopped_run, tmp_path, capsys, override):
    """A run killed at step B, resumed with train.stop_after=A < B: it trained nothing and logged its
    final eval as step A's (a second value at A in MLflow), then ended FINISHED. Only a run that had
    ended well was checked. Now one line, nothing written, for any run."""
    from marin.launch.resume import resume

    a, b = sorted(int(p.name) for p in (stopped_run.run_dir / "checkpoints").iterdir() if p.name.isdigit())[:2]
    copy = _copy_into_new_run(stopped_run, tmp_path, up_to=b)   # a run whose trainer died: not FINISHED
    files = lambda: {p: p.read_bytes() for p in copy.run_dir.rglob("*") if p.is_file() and p.name != "train.lock"}
    before = files()   # train.lock: the lock a resume takes first, against a second one at once
    capsys.readouterr()
    resume([f"resume={copy.run_dir}", f"{override}={a}"])
    out = capsys.readouterr().out
    said = (f"(train.stop_after={a}): nothing to run" if override == "train.stop_after"
            else f"past its last step {a}: nothing to run; give train.steps above {b}")
    assert out.startswith(f"run {copy.run_id} is already at step {b}") and said in out, out
    assert files() == before
