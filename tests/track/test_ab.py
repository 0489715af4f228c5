"""`python -m marin.ab <run>@<step> <candidate overrides>`: a paired A/B from one checkpoint as a
two-job sweep (here; one Slurm array on the cluster), its side-by-side table and verdict, and the
control checked bit for bit against the parent's own steps."""
import json

import pytest

from marin import ab
from tests.trained import forkable_run

TABLE = ("loss (mean)", "eval loss (last)", "dropped fraction (mean)", "tokens/s (steady)", "MFU (steady)",
         "peak memory GiB (max)")


def _check_report(out: str, parent, steps: str) -> None:
    for label in TABLE:
        assert label in out
    assert f"control vs parent: train/loss bit-for-bit equal at steps {steps}" in out
    assert out.strip().splitlines()[-1].startswith("verdict: candidate ")


@pytest.mark.slow
def test_local_ab_is_one_sweep_of_two_forks_with_a_table_and_a_verdict(tmp_path_factory, capfd):
    parent = forkable_run(tmp_path_factory)
    ab.main([f"{parent.run_dir}@3", "optim.lr=0.005", "--steps", "2"])
    out = capfd.readouterr().out
    _check_report(out, parent, "4…5 (2 steps)")
    sweeps = list((parent.run_dir.parent.parent / "sweeps").glob("ab-*"))
    jobs = [json.loads(line) for s in sweeps for line in (s / "jobs.jsonl").read_text().splitlines()]
    assert sorted(o for j in jobs for o in j["overrides"]) == ["+ab=candidate", "+ab=control"]  # one sweep, two arms


def test_bad_candidate_is_refused_before_anything_is_written(tmp_path_factory, capfd):
    parent = forkable_run(tmp_path_factory)
    out_dir = parent.run_dir.parent.parent
    before = sorted(p.name for p in out_dir.iterdir())
    for argv, says in [([f"{parent.run_dir}@3", "model.num_experts=8", "--steps", "2"], "ab: model.num_experts 4 → 8 changes the train state"),
                       ([f"{parent.run_dir}@3", "optim.lr=0.003", "--steps", "2"], "change nothing"),
                       ([f"{parent.run_dir}@3", "optim.lr=0.005", "--steps", "0"], "--steps: must be a whole number ≥ 1")]:
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
    assert ab.divergence({}, {4: 1.5}, 4, 4)[1] is False                     # nothing to check is no pass
