"""`python -m marin.ab <run>@<step> <candidate overrides>`: a paired A/B from one checkpoint as a
two-job sweep (here; one Slurm array on the cluster), its side-by-side table and verdict, and the
control checked bit for bit against the parent's own steps (from a step inside the parent: the
Slurm A/B, tests/launch/test_fork.py, which checks the same table)."""

import pytest

from marin import ab
from tests.trained import AB_TABLE, ab_sweeps, arms, forkable_run


def _check_report(out: str, err: str, parent, steps: str | None) -> None:
    for label in AB_TABLE:
        assert label in out
    if steps is not None:
        assert f"control vs parent: train/loss bit-for-bit equal at steps {steps}" in out
    lines = out.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("paired A/B from ")):]  # not the parent's
    assert lines[-1].startswith("verdict: candidate ")
    # each arm's summary line comes before the table, on stdout: the verdict is the last thing printed
    table = next(i for i, line in enumerate(lines) if line.startswith("metric "))
    ends = [i for i, line in enumerate(lines) if line.startswith(("stopped at step", "finished at step"))]
    assert len(ends) == 2 and max(ends) < table, out
    assert not any(line.startswith(("stopped at step", "finished at step")) for line in err.splitlines())
    assert "backend started before" not in err  # each arm is a `launch.py fork=` process: as quiet as a fresh run


@pytest.mark.slow
def test_an_ab_from_the_parents_last_step_runs_past_it(tmp_path_factory, capfd):
    """From a finished parent's last step the arms train on past it: no parent steps to compare the
    control with, which one line says in place of that check."""
    parent = forkable_run(tmp_path_factory)                                  # 6 steps, checkpoints 3 and 6
    before = ab_sweeps(parent)
    ab.main([f"{parent.run_dir}@6", "optim.lr=0.005", "--steps", "2"])
    out, err = capfd.readouterr()
    _check_report(out, err, parent, None)
    assert f"control vs parent: run {parent.run_id} ends at step 6: no parent steps to compare the control with" in out
    assert arms(ab_sweeps(parent) - before) == ["+ab=candidate", "+ab=control"]  # one sweep, two arms


def test_a_parent_under_another_output_folder_by_its_name(tmp_path, capfd):
    """--out-dir and --tracking-uri, as marin.status and marin.diff take them: the parent is found
    by its name there (here it has no checkpoint at that step, the next thing checked)."""
    from tests.helpers import fake_run_dir

    run_id = fake_run_dir(tmp_path, "run: {name: probe}\nschedule: {horizon_steps: null}\ntrain: {steps: 6}\n")
    with pytest.raises(SystemExit) as exit_:
        ab.main(["probe@3", "optim.lr=0.005", "--out-dir", str(tmp_path), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"])
    assert exit_.value.code == 2 and f"ab: run {run_id} has no checkpoint at step 3" in capfd.readouterr().err


def test_bad_candidate_is_refused_before_anything_is_written(tmp_path_factory, capfd):
    parent = forkable_run(tmp_path_factory)
    out_dir = parent.run_dir.parent.parent
    before = sorted(p.name for p in out_dir.iterdir())
    for argv, says in [([f"{parent.run_dir}@3", "model.num_experts=8", "--steps", "2"], "ab: model.num_experts 4 → 8 changes the train state"),
                       ([f"{parent.run_dir}@3", "optim.lr=0.003", "--steps", "2"], "change nothing"),
                       ([f"{parent.run_dir}@3", "optim.lr=0.005", "--steps", "0"], "--steps: must be a whole number ≥ 1"),
                       # options between the overrides (argparse took the override after them as unknown)
                       ([f"{parent.run_dir}@3", "--steps", "0", "optim.lr=0.005"], "--steps: must be a whole number ≥ 1"),
                       # launch.py's answers: a typo's nearest name, Hydra's errors in one line, no sweep
                       ([f"{parent.run_dir}@3", "optim.lrr=0.005"], "error: optim.lrr: no such key; did you mean optim.lr?"),
                       ([f"{parent.run_dir}@3", "model=tinyy"], "model=tinyy: no such option of model; did you mean tiny?"),
                       ([f"{parent.run_dir}@3", "optim.lr=1e-3,2e-3"], "is a sweep of 2 values: an A/B compares one")]:
        with pytest.raises(SystemExit) as exit_:
            ab.main(argv)
        assert exit_.value.code == 2 and says in capfd.readouterr().err
    assert sorted(p.name for p in out_dir.iterdir()) == before                # no ab/ folder, no sweep, no run


def test_divergence_names_the_first_step_that_differs():
    parent = {4: 1.5, 5: 1.25, 6: 1.0}
    assert ab.divergence(parent, {4: 1.5, 5: 1.25}, 4, 5) == (
        "control vs parent: train/loss bit-for-bit equal at steps 4…5 (2 steps)", True)
    line, equal = ab.divergence(parent, {4: 1.5, 5: 1.2500001, 6: 1.0}, 4, 6)
    assert not equal and line.startswith("control vs parent: DIVERGE at step 5 (parent 1.25, control 1.2500001)")


def test_a_parent_that_stopped_before_the_window_has_nothing_to_compare_and_the_arms_get_a_verdict():
    """A parent stopped at step 3 (train.stop_after, Ctrl-C) logged no loss at the arms' steps: one
    line says there is nothing to compare, and the verdict is on the arms (exit 0), not
    "inconclusive", which is kept for a control that really diverges."""
    line, compare = ab.divergence({1: 2.0, 2: 1.75, 3: 1.5}, {4: 1.25, 5: 1.0}, 4, 5)
    assert compare is True
    assert line == ("control vs parent: the parent logged no loss at steps 4…5 (it stopped at step 3): nothing to "
                    "compare the control with")
    got = {"loss": (1.0, 1.0005), "tokens/s": (100.0, 110.0)}
    assert ab.verdict(got, compare, 0.001).startswith("verdict: candidate holds — loss +0.050%")
    assert ab.verdict(got, compare, 0.0001).startswith("verdict: candidate worse")
    diverged = ab.divergence({3: 1.5, 4: 1.25}, {4: 1.2, 5: 1.0}, 4, 5)
    assert diverged[1] is False and ab.verdict(got, diverged[1], 0.001).startswith("verdict: inconclusive")


def test_the_arms_sweep_id_stays_a_string_whatever_its_hex_digits():
    """An id such as 99e73426 reads as a number on a Hydra command line (99 × 10^73426 = inf): the
    arms then joined sweep `ab-inf` and marin.ab found none of them in `ab-99e73426`."""
    from tests.helpers import compose_dict

    for sid in ("99e73426", "12345678", "0e000001", "a1b2c3d4"):
        assert compose_dict("model=tiny", ab.sweep_id_override(sid))["run"]["sweep_id"] == sid


@pytest.mark.slow
def test_an_ab_from_a_stopped_parent_gives_the_verdict_on_the_arms(tmp_path_factory, capfd):
    """A parent stopped at step 3 of 6 (train.stop_after=3): its arms run 4…5, where the parent
    logged nothing. Exit 0 with a verdict on the arms (it said "inconclusive" and exited 1)."""
    from marin.launch.checks import load
    from marin.track import record
    from marin.train.loop import train
    from tests.helpers import compose_dict, new_store, signals_kept
    from tests.trained import FORKABLE, _detach_run_logs

    root = tmp_path_factory.mktemp("stopped_parent")
    overrides = [*FORKABLE, "train.stop_after=3", f"run.out_dir={root}", f"tracking.uri={new_store(root)}"]
    composed, cfg = load(compose_dict(*overrides))
    parent = record.create(composed, cfg, overrides)
    with signals_kept():
        train(cfg, parent)
    _detach_run_logs()
    ab.main([f"{parent.run_dir}@3", "optim.lr=0.005", "--steps", "2"])        # no SystemExit: exit 0
    out, err = capfd.readouterr()
    _check_report(out, err, parent, None)
    assert "control vs parent: the parent logged no loss at steps 4…5 (it stopped at step 3): nothing to compare" in out
