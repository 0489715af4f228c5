"""`fork=<run>@<step>`: a new run (directory, MLflow run, name) from another run's checkpoint,
with the parent's full train state, its lineage recorded and the parent untouched; a structure
change is refused before anything is written, as resume= refuses it."""
import hashlib
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.trained import AB_TABLE, ab_sweeps, arms, fork_of, forkable_run


def _tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["value"] for r in rows if r["key"] == "train/loss"}


@pytest.mark.slow
def test_fork_with_an_override_is_a_new_run_and_leaves_the_parent_untouched(tmp_path_factory):
    from mlflow import MlflowClient

    parent = forkable_run(tmp_path_factory)
    client = MlflowClient(parent.tracking_uri)
    before = (_tree_hash(parent.run_dir), client.get_run(parent.run_id).info.status,
              client.get_run(parent.run_id).data.tags)
    child = fork_of(tmp_path_factory, "optim.lr=0.005")
    assert child.run_dir != parent.run_dir and child.run_id != parent.run_id
    assert child.run_dir.name.startswith("default-step3-")                # its own name
    tags = client.get_run(child.run_id).data.tags
    assert tags["forked_from"] == f"{parent.run_id}@3"
    assert tags["fork_changes"] == "optim.lr: 0.003 → 0.005"
    info = json.loads((child.run_dir / "record.json").read_text())
    assert info["init_from"]["step"] == 3 and info["init_from"]["mode"] == "continue"
    assert info["init_from"]["changes"]["optim.lr"][1] == 0.005
    assert OmegaConf.load(child.run_dir / "resolved.yaml").fork == f"{parent.run_id}@3"
    assert sorted(_losses(child.run_dir)) == [4, 5, 6]                   # the step counter continues
    assert (_tree_hash(parent.run_dir), client.get_run(parent.run_id).info.status,
            client.get_run(parent.run_id).data.tags) == before         # the parent: not one byte, not one tag


@pytest.mark.slow
def test_fork_without_overrides_repeats_the_parents_steps_bit_for_bit(tmp_path_factory):
    parent = forkable_run(tmp_path_factory)
    child = fork_of(tmp_path_factory)
    want = {s: v for s, v in _losses(parent.run_dir).items() if s > 3}
    assert _losses(child.run_dir) == want and len(want) == 3               # optimizer, router, data positions all restored


@pytest.mark.parametrize("override", ["model.num_experts=8", "optim.grad_clip=1.0"])
def test_fork_refuses_a_structure_change_and_writes_nothing(tmp_path_factory, override, capsys):
    from marin.launch.fork import fork

    parent = forkable_run(tmp_path_factory)
    runs = parent.run_dir.parent
    before = (sorted(p.name for p in runs.iterdir()), _tree_hash(parent.run_dir))
    spec = f"{parent.run_dir}@3"
    with pytest.raises(SystemExit) as exit_:
        fork(OmegaConf.create({"fork": spec}), [f"fork={spec}", override])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: fork: ") and override.split("=")[0] in line and "nothing was written" in line
    assert (sorted(p.name for p in runs.iterdir()), _tree_hash(parent.run_dir)) == before


@pytest.mark.parametrize("spec, says", [("{run}", "give the checkpoint step"),
                                        ("{run}@4", "no checkpoint at step 4 (its checkpoints: 3, 6)"),
                                        ("{run}@x", "must be a whole number")])
def test_fork_names_the_checkpoint_it_needs(tmp_path_factory, spec, says, capsys):
    from marin.launch.fork import fork

    spec = spec.format(run=forkable_run(tmp_path_factory).run_dir)
    with pytest.raises(SystemExit) as exit_:
        fork(OmegaConf.create({"fork": spec}), [f"fork={spec}"])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.slurm
@pytest.mark.slow
def test_ab_on_slurm_runs_its_two_forks_as_one_job_array(tmp_path_factory, tracking_uri, capfd):
    """marin.ab (tests/track/test_ab.py) with a Slurm hardware: both arms in one array, one process
    each (the parent's single-device layout, so the control repeats it bit for bit), one sweep,
    and the arms' table and verdict."""
    from marin import ab

    parent = forkable_run(tmp_path_factory)
    before = ab_sweeps(parent)
    ab.main([f"{parent.run_dir}@3", "optim.lr=0.005", "--steps", "1", "--both", "hardware=slurm_cpu",
             "--both", "hardware.tasks_per_node=1", "--both", "hardware.mesh.expert=1",
             "--both", f"tracking.uri={tracking_uri}"])
    captured = capfd.readouterr()
    assert re.search(r"slurm array \d+: 2 jobs", captured.out + captured.err), captured.err[-3000:]
    assert "control vs parent: train/loss bit-for-bit equal at steps 4…4 (1 step)" in captured.out
    assert captured.out.strip().splitlines()[-1].startswith("verdict: candidate ")
    assert all(label in captured.out for label in AB_TABLE)                 # the arms side by side
    assert arms(ab_sweeps(parent) - before) == ["+ab=candidate", "+ab=control"]  # one sweep, two arms


def test_fork_of_a_resumed_run_keeps_what_its_resumes_changed(tmp_path_factory, tmp_path):
    """The parent as it last ran: a resume= override (a transport switch, say) carries into the fork."""
    import shutil

    from marin.launch.fork import compose

    parent = forkable_run(tmp_path_factory)
    copy = tmp_path / parent.run_dir.name
    shutil.copytree(parent.run_dir, copy)
    info = json.loads((copy / "record.json").read_text())
    info["resumes"] = [{"n": 1, "overrides": ["optim.lr=0.007", "train.stop_after=9"], "changes": {}}]
    (copy / "record.json").write_text(json.dumps(info))
    made = compose(f"{copy}@3", ["fork=x", "optim.b1=0.8"])
    assert made.resolved.optim.lr == 0.007 and made.resolved.optim.b1 == 0.8
    assert made.resolved.train.stop_after is None                             # that resume's own stop, not the fork's


def test_a_fork_at_a_step_without_a_checkpoint_says_how_to_make_one_and_writes_nothing(tmp_path_factory, capsys):
    """Issue 40 item 7: one line naming the checkpoints and the command that makes step 4 (the
    parent is past it: a fork of 3 run to exactly 4 with train.stop_at), exit 2; no run directory,
    no MLflow run."""
    from mlflow import MlflowClient

    from marin.launch.fork import fork

    parent = forkable_run(tmp_path_factory)
    runs = parent.run_dir.parent
    client = MlflowClient(parent.tracking_uri)
    before = (sorted(p.name for p in runs.iterdir()),
              len(client.search_runs([client.get_run(parent.run_id).info.experiment_id])))
    spec = f"{parent.run_id}@4"
    with pytest.raises(SystemExit) as exit_:
        fork(OmegaConf.create({"fork": spec}), [f"fork={spec}", f"tracking.uri={parent.tracking_uri}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert exit_.value.code == 2 and len(lines) == 1
    assert lines[0] == (f"error: fork: run {parent.run_id} has no checkpoint at step 4 (its checkpoints: 3, 6); make "
                        f"one: python launch.py fork={parent.run_id}@3 train.stop_at=4 "
                        f"run.name=default-to4, then python launch.py fork=default-to4@4")
    assert (sorted(p.name for p in runs.iterdir()),
            len(client.search_runs([client.get_run(parent.run_id).info.experiment_id]))) == before


@pytest.mark.parametrize("step, make", [(7, "(the run ends at step 6) python launch.py fork={id}@6 train.steps=7 "
                                            "run.name=default-to7, then python launch.py fork=default-to7@7"),  # past its end
                                        (2, "python launch.py reproduce={id} train.stop_at=2")])  # nothing below it
def test_the_missing_step_line_names_the_command_that_fits(tmp_path_factory, step, make, capsys):
    from marin.launch.fork import fork

    parent = forkable_run(tmp_path_factory)
    spec = f"{parent.run_dir}@{step}"
    with pytest.raises(SystemExit) as exit_:
        fork(OmegaConf.create({"fork": spec}), [f"fork={spec}"])
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")][-1]
    assert exit_.value.code == 2
    assert line.endswith("make one: " + make.format(dir=parent.run_dir, id=parent.run_id))


def test_a_missing_step_lists_the_checkpoints_nearest_it():
    """The default run keeps 20, 40, …, 200: a fork at 25 names 20 and 40, not only the last eight."""
    from marin.launch.fork import nearest_steps

    steps = list(range(20, 201, 20))
    assert nearest_steps(steps, 25) == "20, 40, 60, 80, 100, 120, 140, 160 (10 in all)"
    assert nearest_steps(steps, 190) == "60, 80, 100, 120, 140, 160, 180, 200 (10 in all)"
    assert nearest_steps([3, 6], 4) == "3, 6" and nearest_steps([], 4) == "none"


def test_the_command_that_makes_a_step_pastes_for_a_sweep_jobs_name():
    """A sweep job's name holds '=': both commands of the line are quoted for the shell and Hydra."""
    import shlex
    from types import SimpleNamespace

    from marin.launch.fork import how_to_make

    parent = SimpleNamespace(run_id="abc", run_dir="/o/runs/grid-lr=0.001-x",
                             resolved=lambda: SimpleNamespace(run=SimpleNamespace(name="grid/lr=0.001"),
                                                              train=SimpleNamespace(steps=6)))
    first, second = how_to_make(parent, [3, 6], 4).split(", then ")
    assert shlex.split(second) == ["python", "launch.py", "fork='grid/lr=0.001-to4@4'"]
    assert "run.name='grid/lr=0.001-to4'" in shlex.split(first)
    # past the run's end (it finished at 6): a fork of its last checkpoint trained to 9, not a
    # train.stop_at past train.steps (which validation refuses)
    first, second = how_to_make(parent, [3, 6], 9).split(", then ")
    assert first.startswith("(the run ends at step 6) ")
    assert shlex.split(first.split(") ", 1)[1]) == ["python", "launch.py", "fork=abc@6", "train.steps=9",
                                                   "run.name='grid/lr=0.001-to9'"]
    assert shlex.split(second) == ["python", "launch.py", "fork='grid/lr=0.001-to9@9'"]
    # a run stopped before its end (train.steps 10): resumed to the step
    stopped = SimpleNamespace(**{**vars(parent), "resolved": lambda: SimpleNamespace(
        run=SimpleNamespace(name="grid/lr=0.001"), train=SimpleNamespace(steps=10))})
    assert shlex.split(how_to_make(stopped, [3, 6], 8)) == ["python", "launch.py", "resume='/o/runs/grid-lr=0.001-x'",
                                                          "train.stop_at=8"]
