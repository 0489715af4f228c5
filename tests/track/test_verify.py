"""`reproduce=<run> verify=true`: a replay compared metric by metric with the record.

One tiny original run (6 steps, checkpoints at 2, 4, 6) is shared by every test; the replays run
in this process through launch.py's dispatch, so JAX compiles once."""
import json
import shutil

import pytest
from mlflow import MlflowClient

from tests.helpers import compose_dict, launch_here, new_store, signals_kept

TINY = ["model=micro", "train.steps=6", "train.seq_len=32", "train.global_batch=4", "train.eval_every=3",
        "train.eval_batches=1", "train.checkpoint.every_steps=2", "train.checkpoint.keep_last=0",
        "train.checkpoint.async_save=false", "train.seed=5"]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    from marin.launch.checks import load
    from marin.track import record
    from marin.train.loop import train

    tmp = tmp_path_factory.mktemp("verify")
    site = [f"run.out_dir={tmp}", f"tracking.uri={new_store(tmp)}"]
    composed, resolved = load(compose_dict(*TINY, *site))
    rec = record.create(composed, resolved, TINY + site)
    with signals_kept():
        train(resolved, rec)
    return rec, site, tmp


def runs(tmp):
    return sorted(p.name for p in (tmp / "runs").iterdir())


def replay_of(tmp, before):
    (made,) = set(runs(tmp)) - set(before)
    return tmp / "runs" / made


@pytest.mark.slow
def test_untouched_run_verifies_identical(original, capsys):
    rec, site, tmp = original
    before = runs(tmp)
    assert launch_here(f"reproduce={rec.run_dir}", "verify=true", *site) == 0
    out = capsys.readouterr().out
    assert "verify: identical (bit for bit)" in out and "steps 1–6" in out, out
    replay = replay_of(tmp, before)
    result = json.loads((replay / "verify.json").read_text())
    assert result["result"] == "identical" and result["compared"] > 6 * 10   # every step's train/* and both evals
    run_id = json.loads((replay / "record.json").read_text())["run_id"]
    tags = MlflowClient(rec.tracking_uri).get_run(run_id).data.tags
    assert tags["verification_of"] == rec.run_id and tags["verify_result"] == "identical"
    from marin.launch.verify import main
    from marin.track import record
    assert main([str(rec.run_dir), str(replay)]) == 0         # the command-line comparison of two runs agrees
    assert replay.name.startswith("default-verify-")          # a replay is named as one, so the original's
    assert record.open("default", out_dir=tmp).run_id == rec.run_id   # name still names the original alone


@pytest.mark.slow
def test_window_starts_from_the_checkpoint_below_it(original, capsys, caplog):
    rec, site, tmp = original
    before = runs(tmp)
    with caplog.at_level("INFO", logger="marin.train"):
        assert launch_here(f"reproduce={rec.run_id}", "verify=true", "verify_steps=3:5", *site) == 0
    assert f"init from {rec.run_dir} step 2 (asked 2)" in caplog.text
    assert "identical" in capsys.readouterr().out
    replay = replay_of(tmp, before)
    steps = {json.loads(line)["step"] for line in (replay / "metrics.jsonl").read_text().splitlines()}
    assert steps == {3, 4, 5}   # steps 3…5 trained from checkpoint 2; the closing eval at 5


@pytest.mark.slow
def test_a_changed_data_seed_diverges_at_the_first_step_it_touches(original, capsys):
    rec, site, tmp = original
    # The window restores checkpoint 4 (identical state); seed 6 draws other batches from step 4.
    assert launch_here(f"reproduce={rec.run_dir}", "verify=true", "verify_steps=4:6", "train.seed=6", *site) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("verify: first divergence at step 4: train/"), out
    recorded, replayed = first.split(" = ")[1].split(" recorded vs ")
    assert float(recorded) != float(replayed.split(" replayed")[0])
    assert "train/aux_loss" not in first          # equal (0.0) in both: not a divergence
    assert "replayed with overrides: train.seed=6" in out and "environment differences:" in out


@pytest.mark.slow
def test_copied_run_directory_is_verified_against_its_metrics_file(original, capsys):
    """Another machine's run: its MLflow run is unknown here; metrics.jsonl is the record. One
    recorded value nudged by 1e-6 (relative) is the first divergence, and passes with an rtol."""
    rec, site, tmp = original
    copy = tmp / "elsewhere" / rec.run_dir.name
    shutil.copytree(rec.run_dir, copy)
    info = json.loads((copy / "record.json").read_text())
    info.update(run_id="0" * 32, tracking_uri=f"sqlite:///{tmp}/gone/mlflow.db")
    (copy / "record.json").write_text(json.dumps(info))
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if row["key"] == "train/loss" and row["step"] == 5:
            row["value"] *= 1 + 1e-6
            nudged = row["value"]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    assert launch_here(f"reproduce={copy}", "verify=true", "verify_steps=4:6", *site) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"verify: first divergence at step 5: train/loss = {nudged!r} recorded vs "), out
    assert str(copy / "metrics.jsonl") in out.splitlines()[0]


def test_a_replay_is_named_after_its_original(original, capsys):
    """reproduce= and verify=true make runs of their own, named `<name>-reproduce` and
    `<name>-verify` (run.name= names one as asked), so the original's name still names it alone."""
    rec, site, tmp = original
    for args, name in [((f"reproduce={rec.run_dir}",), "default-reproduce"),
                       ((f"reproduce={rec.run_dir}", "verify=true"), "default-verify"),
                       ((f"reproduce={rec.run_dir}", "run.name=mine"), "mine")]:
        assert launch_here(*args, "dry_run=true", *site) == 0
        assert f"run {name}" in capsys.readouterr().out, args


def test_compare_rtol_and_missing_metrics():
    from marin.launch.verify import compare

    recorded = {("train/loss", 0): 2.0, ("train/loss", 1): 1.0, ("eval/loss", 1): 3.0, ("train/tokens_per_s", 1): 9.0}
    replayed = {("train/loss", 0): 2.0, ("train/loss", 1): 1.0 + 1e-9, ("train/tokens_per_s", 1): 7.0}
    first, compared = compare(recorded, replayed)
    assert (first.step, first.key, first.replayed) == (1, "eval/loss", None)   # recorded, not logged by the replay
    replayed[("eval/loss", 1)] = 3.0
    first, _ = compare(recorded, replayed)
    assert (first.step, first.key) == (1, "train/loss")                         # bitwise by default
    assert compare(recorded, replayed, rtol=1e-6) == (None, 3)                  # tokens/s never compared


def test_the_machines_own_measurements_are_never_compared():
    """MLflow's system metrics (tracking.system_metrics, on by default) sample the machine on their
    own clock: a replay logs others, at other steps. A default run verified against them failed at
    step 1 ("system/cpu_utilization_percentage = 85.4 recorded, not logged by the replay")."""
    from marin.launch.verify import compare

    recorded = {("train/loss", 1): 1.0, ("system/cpu_utilization_percentage", 1): 85.4,
                ("system/system_memory_usage_megabytes", 2): 900.0, ("train/loss", 2): 0.5}
    replayed = {("train/loss", 1): 1.0, ("train/loss", 2): 0.5, ("system/cpu_utilization_percentage", 2): 50.0}
    assert compare(recorded, replayed) == (None, 2)


@pytest.mark.parametrize("args, field", [
    ((), "verify"),                                           # no reproduce=
    (("verify_steps=5:9",), "verify_steps"),                  # past the run's last step (6)
    (("verify_steps=0:4",), "verify_steps"),                  # before the run's first step (1)
    (("verify_steps=4",), "verify_steps"),                    # not a:b
    (("verify_rtol=-1",), "verify_rtol"),
])
def test_bad_input_is_one_line_and_writes_nothing(original, capsys, args, field):
    rec, site, tmp = original
    ref = [] if field == "verify" and not args else [f"reproduce={rec.run_dir}"]
    before, mlflow_runs = runs(tmp), len(MlflowClient(rec.tracking_uri).search_runs([_experiment(rec)]))
    assert launch_here(*ref, "verify=true", *args, *site) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {field}: ") and len([e for e in err if e.startswith("error")]) == 1
    assert runs(tmp) == before
    assert len(MlflowClient(rec.tracking_uri).search_runs([_experiment(rec)])) == mlflow_runs


def _experiment(rec):
    return MlflowClient(rec.tracking_uri).get_run(rec.run_id).info.experiment_id


def test_init_from_a_step_is_checked_before_anything_is_written(original, capsys):
    rec, site, tmp = original
    before = runs(tmp)
    assert launch_here(*TINY, f"train.init_from={rec.run_dir}@1", *site) == 2
    err = capsys.readouterr().err
    assert "train.init_from: step 1 is below the first checkpoint" in err and "checkpoints: 2, 4, 6" in err
    assert launch_here(*TINY, f"train.init_from={rec.run_dir}@half", *site) == 2
    assert "train.init_from: the step after '@' must be a whole number" in capsys.readouterr().err
    assert runs(tmp) == before


def test_init_from_locates_the_newest_checkpoint_at_or_below_the_step(original):
    from marin.train.init_from import locate

    rec, site, tmp = original
    start = locate(f"{rec.run_id}@5", tracking_uri=rec.tracking_uri)      # an MLflow id works too
    assert (start.run_dir, start.step, start.asked) == (rec.run_dir, 4, 5)
    assert start.describe() == f"init from {rec.run_dir} step 4 (asked 5)"
    assert locate(str(rec.run_dir)).step == 6                              # no step: the newest
    assert locate(f"{rec.run_dir}@6").step == 6
