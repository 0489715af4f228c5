"""`python -m marin.lineage`: a fork's chain back to its first run, the metric stitched across it
(each step from the run in force), and the hero's published lineage (conf/lineage/mochi_hero.yaml)."""
import io
import json
import re

import pytest

from marin import lineage
from tests.helpers import new_store
from tests.trained import fork_of, forkable_run


@pytest.mark.slow
def test_lineage_prints_the_chain_and_stitches_the_loss(tmp_path_factory, capsys):
    parent = forkable_run(tmp_path_factory)
    child = fork_of(tmp_path_factory, "optim.lr=0.005")
    links = lineage.chain(str(child.run_dir))
    assert [(link.run_id, link.from_step, link.to_step) for link in links] == [(parent.run_id, 0, 3), (child.run_id, 3, 6)]
    assert links[1].changes["optim.lr"][1] == 0.005 and "run.name" not in links[1].changes
    points = lineage.stitch(links, "train/loss")
    assert [(s, r) for s, _, r in points] == [(1, parent.run_id), (2, parent.run_id), (3, parent.run_id),
                                              (4, child.run_id), (5, child.run_id), (6, child.run_id)]
    own = {row["step"]: row["value"] for row in map(json.loads, (child.run_dir / "metrics.jsonl").read_text().splitlines())
           if row["key"] == "train/loss"}
    assert [v for s, v, _ in points if s > 3] == [own[4], own[5], own[6]]    # the fork's values, not the parent's

    lineage.main([child.run_id, "--tracking-uri", child.tracking_uri, "--metric", "train/loss"])
    out = capsys.readouterr().out
    assert f"lineage of run {child.run_id}: 2 runs" in out
    assert "forked at 3: optim.lr: 0.003 → 0.005" in out and "train/loss, stitched: 6 steps" in out

    from marin import status  # marin.status and the report stitch too
    from marin.track import report

    shown = io.StringIO()
    status.show_run(child, shown)
    assert f"train/loss stitched across the lineage: 6 steps, latest {own[6]:.4f} at step 6" in shown.getvalue()
    assert "Lineage (train/loss stitched across forks)" in report.run_page(child)


def test_published_hero_lineage_prints_its_seven_runs_as_commands(capsys):
    lineage.main(["mochi_hero"])
    out = capsys.readouterr().out
    assert "published lineage mochi_hero: 7 runs" in out
    for run, steps in [("hero-12d8b6f0-dee637", "0–58,014"), ("hero-wd-gate-router-p02-step58k", "58,014–81,716"),
                       ("hero-ragged_a2a-nccl2307-ep-step81k", "81,716–108,000"),
                       ("hero-mix-996f4891-step108k", "108,000–108,778"), ("hero-nopdl-step108k", "108,778–121,638"),
                       ("hero-main-step121638", "121,638–146,139"), ("hero-fa4sm100-nomask-step146k", "146,139–")]:
        assert run in out and steps in out
    assert ("fork=hero-wd-gate-router-p02-step58k@81716 run.name=hero-ragged_a2a-nccl2307-ep-step81k "
            "model.ep_transport=ragged eval.with_drops=false train.stop_at=108000") in out
    assert ("fork=hero-ragged_a2a-nccl2307-ep-step81k@108000 run.name=hero-mix-996f4891-step108k data=mochi_hero_108k "
            "train.stop_at=108778") in out
    # Runs as written (issue 40 item 7): each run stops, with a checkpoint, exactly where the next forks.
    commands = [line.strip() for line in out.splitlines() if line.startswith("  python launch.py")]
    assert len(commands) == 7
    for before, after in zip(commands, commands[1:]):
        stop = re.search(r"train\.stop_at=(\d+)", before).group(1)
        name = re.search(r"run\.name=(\S+)", before).group(1)
        assert f"fork={name}@{stop} " in after
    assert "train.stop_at" not in commands[-1]


def test_unknown_published_lineage_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        lineage.main(["no_such_lineage", "--published"])
    assert exit_.value.code == 2 and "no published lineage 'no_such_lineage' (conf/lineage/: mochi_hero)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../config", "../../conf/config", "../lineage/mochi_hero"])
def test_a_published_lineage_is_a_file_of_conf_lineage_only(name, capsys):
    """A name with `../` reads no other YAML file (issue 42's probe: `conf/config.yaml` was read and
    printed as a lineage, with a traceback)."""
    assert lineage.published(name) is None
    with pytest.raises(SystemExit) as exit_:
        lineage.main([name, "--published"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "no published lineage" in err


def test_a_run_under_another_output_folder_by_its_name(tmp_path, capsys):
    """--out-dir (and --tracking-uri), as marin.status and marin.diff take them."""
    from tests.helpers import fake_run_dir

    run_id = fake_run_dir(tmp_path, "run: {name: probe}\n")
    lineage.main(["probe", "--out-dir", str(tmp_path), "--tracking-uri", new_store(tmp_path)])
    assert f"lineage of run {run_id}: 1 run" in capsys.readouterr().out


def test_every_nth_step_and_csv(tmp_path, capsys):
    """A long run's stitched curve: `--every N` keeps steps divisible by N and the last; `--csv`
    prints only the curve as CSV (step,value,run_id)."""
    from tests.helpers import fake_run_dir

    run_id = fake_run_dir(tmp_path, "run: {name: probe}\ntrain: {steps: 25}\n")
    run_dir = next((tmp_path / "runs").iterdir())
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"key": "train/loss", "value": 10 / s, "step": s,
                                                               "timestamp": 0}) + "\n" for s in range(1, 26)))
    lineage.main([str(run_dir), "--metric", "train/loss", "--every", "10"])
    out = capsys.readouterr().out
    assert "train/loss, stitched: 25 steps, shown every 10 steps and the last" in out
    curve = out[out.index("every 10 steps and the last"):].splitlines()[1:]
    assert [line.split()[0] for line in curve] == ["10", "20", "25"]
    lineage.main([str(run_dir), "--metric", "train/loss", "--every", "5", "--csv"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step,value,run_id", *(f"{s},{10 / s!r},{run_id}" for s in (5, 10, 15, 20, 25))]
    for argv, says in ((["--every", "0", "--metric", "train/loss"], "--every: must be a whole number ≥ 1"),
                       (["--csv"], "--csv: give the metric"),
                       # a metric no run logged: "stitched: 0 steps" was all it said
                       (["--metric", "train/los"], "--metric train/los: no run of the lineage logged it; "
                                                   "did you mean train/loss? logged: train/loss\n")):
        with pytest.raises(SystemExit) as exit_:
            lineage.main([str(run_dir), *argv])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
