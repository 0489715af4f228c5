"""reproduce=<run>: saved config + new overrides; errors; python -m marin.diff."""
import logging
import subprocess
import sys

import pytest
import yaml
from mlflow import MlflowClient

from marin import diff
from marin.config.paths import PROJECT_ROOT
from marin.launch.reproduce import ReproduceError, recompose
from marin.track import record


@pytest.fixture(scope="module")
def source(store):
    from marin.launch.checks import load
    from tests.helpers import compose_dict

    overrides = ["model=micro", "train.steps=4", f"tracking.uri={store['uri']}", f"run.out_dir={store['out']}",
                 "optim.lr=0.002", "train.seed=7", "run.name=src"]
    composed, resolved = load(compose_dict(*overrides))
    return record.create(composed, resolved, overrides)


def _edit_saved(rec, edit):
    """A copy of `rec`'s run directory with its composed.yaml edited (as if made by other code)."""
    import shutil

    copy = rec.run_dir.with_name(rec.run_dir.name + "-edited-" + edit.__name__)
    shutil.copytree(rec.run_dir, copy)
    tree = yaml.safe_load((copy / "composed.yaml").read_text())
    edit(tree)
    (copy / "composed.yaml").write_text(yaml.safe_dump(tree))
    return copy


def test_saved_values_kept_new_overrides_applied(source, store, tmp_path):
    composed, resolved, overrides = recompose(str(source.run_dir), ["train.steps=6", f"run.out_dir={tmp_path}"])
    assert resolved.train.seed == 7 and resolved.optim.lr == 0.002      # as saved
    assert resolved.train.steps == 6                                    # new override
    assert composed.attention.num_heads == "auto" and resolved.attention.num_heads == 2  # derived again
    assert resolved.run.out_dir == str(tmp_path) and resolved.tracking.uri is None  # site: from now
    assert resolved.reproduce == source.run_id
    assert "optim.lr=0.002" in overrides and "train.steps=6" in overrides
    assert not any(o.startswith(("tracking.uri=", "run.out_dir=" + str(store["out"]))) for o in overrides)


def test_a_new_value_of_a_saved_key_replaces_it_in_the_new_records_overrides(source, tmp_path):
    """Both the saved optim.lr=0.002 and the new one were kept: a multirun of reproductions named
    its jobs `optim.lr=0.002,optim.lr=0.1` (both are swept keys) instead of `lr=0.1`."""
    _, resolved, overrides = recompose(str(source.run_dir), ["optim.lr=0.1", f"run.out_dir={tmp_path}"])
    assert resolved.optim.lr == 0.1
    assert [o for o in overrides if o.startswith("optim.lr=")] == ["optim.lr=0.1"]
    assert "train.seed=7" in overrides   # the other saved ones stay


def test_new_run_is_tagged_reproduced_from(source, store):
    composed, resolved, overrides = recompose(source.run_id, [f"tracking.uri={store['uri']}",
                                                               f"run.out_dir={store['out']}"])
    made = record.create(composed, resolved, overrides)
    run = MlflowClient(store["uri"]).get_run(made.run_id)
    assert run.data.tags["reproduced_from"] == source.run_id
    assert run.data.tags["config_hash"] == MlflowClient(store["uri"]).get_run(source.run_id).data.tags["config_hash"]


def test_conf_edits_since_the_run_do_not_leak_in(source, caplog):
    def widen_capacity(tree):
        tree["model"]["capacity_factor"] = 2.0   # the saved run used 2.0; conf/ now says 1.25
    edited = _edit_saved(source, widen_capacity)
    with caplog.at_level(logging.WARNING, logger="marin.launch"):
        _, resolved, _ = recompose(str(edited), [])
    assert resolved.model.capacity_factor == 2.0
    assert any("model.capacity_factor" in r.message for r in caplog.records)


def test_incompatible_schema_names_the_fields(source):
    def old_schema(tree):
        tree["schema_version"] = 0
        tree["model"]["moe_every"] = 1
        del tree["model"]["latent_dim"]
    with pytest.raises(ReproduceError, match=r"schema_version 0 .* reads 1.*model\.moe_every.*model\.latent_dim"):
        recompose(str(_edit_saved(source, old_schema)), [])


def test_a_config_saved_before_the_newer_fields_still_recomposes_as_it_ran(source):
    """Fields added since schema_version 1 get what an older config meant: an older init_from
    continued its source's state and step (init_from_mode continue), no watchdog, no restarts."""
    def before_the_fields(tree):
        for group, key in (("train", "init_from_mode"), ("train", "watchdog_minutes"), ("hardware", "max_restarts"),
                           ("hardware", "segment_nodes"), ("hardware", "exclusive"), ("tracking", "system_metrics")):
            del tree[group][key]
        del tree["debug"], tree["fork"]
    _, resolved, _ = recompose(str(_edit_saved(source, before_the_fields)), [])
    assert resolved.train.init_from_mode == "continue" and resolved.train.watchdog_minutes is None
    assert resolved.hardware.max_restarts == 0 and resolved.debug.hang_at_step is None


def test_target_outside_allow_list_is_refused(source):
    def target(tree):
        tree["optim"]["_target_"] = "os.system"
    with pytest.raises(ReproduceError, match="optim._target_=os.system is not allowed"):
        recompose(str(_edit_saved(source, target)), [])


def test_override_that_does_not_apply(source):
    with pytest.raises(ReproduceError, match="overrides do not apply to the saved config: .*lrr"):
        recompose(str(source.run_dir), ["optim.lrr=1"])


def test_launch_reproduce_errors_exit_2(source, tmp_path):
    cmd = [sys.executable, "launch.py", f"reproduce={tmp_path / 'missing'}", "dry_run=true"]
    done = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: reproduce: {tmp_path / 'missing'}: no such run directory"


def test_launch_reproduce_dry_run(source):
    cmd = [sys.executable, "launch.py", f"reproduce={source.run_dir}", "dry_run=json", "train.steps=8"]
    done = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"steps": 8' in done.stdout.replace(" ", "").replace('"steps":8', '"steps": 8')


def test_diff_lists_differing_leaves(source, store, capsys):
    site = [f"tracking.uri={store['uri']}", f"run.out_dir={store['out']}"]
    composed, resolved, overrides = recompose(str(source.run_dir), ["optim.lr=0.004", "model.num_layers=3", *site])
    other = record.create(composed, resolved, overrides)
    rows = {key: (a, b, derived) for key, a, b, derived in diff.differences(source, other)}
    assert rows["optim.lr"] == (0.002, 0.004, False)
    assert rows["model.num_layers"] == (2, 3, False)
    assert not any(k.startswith("run.") for k in rows)
    assert diff.main([str(source.run_dir), other.run_id, "--tracking-uri", store["uri"]]) == 1
    assert "optim.lr" in capsys.readouterr().out
    client = MlflowClient(store["uri"])
    for key, value in (("train/loss", 3.25), ("eval/macro_loss", 3.5), ("train/tokens_per_s", 1200.0)):
        client.log_metric(other.run_id, key, value, step=4)
    client.set_terminated(other.run_id, "FINISHED")
    # id prefixes; the source's directory has copies here (same id): the store says which is the run
    assert diff.main([source.run_id[:10], other.run_id[:10], "--out-dir", str(store["out"]),
                      "--tracking-uri", store["uri"], "--mlflow"]) == 1  # logged to the store alone
    out = capsys.readouterr().out
    results = {line.split()[0]: line.split()[1:] for line in out[out.index("\nresult"):].splitlines()[2:]}
    assert results["state"] == ["RUNNING", "FINISHED"] and results["step"] == ["-", "4"]
    assert results["train/loss"] == ["-", "3.2500"] and results["eval/macro_loss"] == ["-", "3.5000"]
    assert results["train/tokens_per_s"] == ["-", "1,200"]
    assert diff.main([str(source.run_dir), str(source.run_dir)]) == 0
    with pytest.raises(SystemExit, match="^2$"):
        diff.main([str(source.run_dir), "/nope"])


def test_warns_when_commit_or_packages_differ(source, caplog, tmp_path):
    import json
    import shutil

    copy = tmp_path / "older"
    shutil.copytree(source.run_dir, copy)
    info = json.loads((copy / "record.json").read_text())
    info["git"]["commit"] = "0" * 40
    info["packages"]["jax"] = "0.0.1"
    (copy / "record.json").write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING, logger="marin.launch"):
        recompose(str(copy), [])
    messages = " ".join(r.message for r in caplog.records)
    assert "git commit 000000000000" in messages and "jax 0.0.1 →" in messages


HARDWARE = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "hardware").glob("*.yaml"))
# One model and batch every shipped option accepts (64 experts, a batch every data-parallel size divides).
FITS_EVERY_RACK = ["model=tiny", "model.num_experts=64", "train.global_batch=4224", "train.seq_len=32", "train.steps=4"]


@pytest.mark.parametrize("hardware", HARDWARE)
def test_every_hardware_option_round_trips(hardware, store):
    """reproduce= and resume= (dry runs: the hardware is absent) of a run on each shipped option
    give back its hardware, env included (a non-empty hardware.env was refused as schema drift)."""
    from marin.launch.checks import load
    from marin.launch.resume import resume
    from tests.helpers import compose_dict

    overrides = [f"hardware={hardware}", *FITS_EVERY_RACK, f"tracking.uri={store['uri']}",
                 f"run.out_dir={store['out']}", f"run.name=hw-{hardware}"]
    composed, resolved = load(compose_dict(*overrides))
    made = record.create(composed, resolved, overrides)
    _, again, _ = recompose(str(made.run_dir), ["dry_run=true"])
    assert record.config_dict(again)["hardware"] == record.config_dict(resolved)["hardware"]
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        resume([f"resume={made.run_dir}", "dry_run=true", f"run.out_dir={store['out']}"], dry_run=True)
    out = printed.getvalue()
    assert f"resuming run {made.run_id}" in out and "changes:" not in out


def _record_under_hydra(store, tmp_path, extra_dir, *overrides):
    """A run composed as launch.py composes it with `hydra.searchpath` (HydraConfig set)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from marin.config.paths import CONF_DIR
    from marin.config.store import name_options, register
    from marin.launch.checks import load

    overrides = ["model=micro", "train.steps=4", f"tracking.uri={store['uri']}", f"run.out_dir={tmp_path}", *overrides]
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra.searchpath=[file://{extra_dir}]", *overrides],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        task = cfg.copy()
        with open_dict(task):
            del task["hydra"]
        return record.create(*load(name_options(task, cfg.hydra.runtime.choices)), overrides)
    finally:
        HydraConfig.instance().cfg = None


def test_config_dir_of_the_run_is_used_again_and_a_gone_one_is_one_line(store, tmp_path, caplog):
    extra = tmp_path / "site_conf"
    (extra / "experiment").mkdir(parents=True)
    (extra / "experiment" / "mine.yaml").write_text("train:\n  seed: 11\n")  # no package header needed
    rec = _record_under_hydra(store, tmp_path, extra, "experiment=mine")
    assert rec.info()["config_search_path"] == [f"file://{extra}"]
    _, resolved, _ = recompose(str(rec.run_dir), [f"run.out_dir={tmp_path}"])  # no --config-dir given again
    assert resolved.train.seed == 11
    extra.rename(tmp_path / "moved")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="marin.launch"):
        _, resolved, overrides = recompose(rec.run_id[:12], [f"run.out_dir={tmp_path}", "train.steps=6"])
    assert resolved.train.seed == 11 and resolved.train.steps == 6  # the saved config, the new override on it
    notes = [r.getMessage() for r in caplog.records if "config folder" in r.getMessage() or "conf/" in r.getMessage()]
    assert len(notes) == 1 and f"config folder {extra} " in notes[0] and "experiment=mine" in notes[0]
    assert "experiment=mine" not in overrides  # the new run's record composes without the gone folder

    import contextlib
    import io

    from marin.launch.resume import resume

    with contextlib.redirect_stdout(io.StringIO()) as printed:  # resume= takes a run id prefix as well
        resume([f"resume={rec.run_id[:12]}", "dry_run=true", f"run.out_dir={tmp_path}"], dry_run=True)
    assert f"resuming run {rec.run_id}" in printed.getvalue()


def test_the_reproducing_line_counts_only_the_overrides_given(source, caplog):
    """`reproduce=<run>` alone said "with 1 new override(s)": the run.name it adds itself."""
    with caplog.at_level(logging.INFO, logger="marin"):
        recompose(str(source.run_dir), [])
        recompose(str(source.run_dir), ["train.steps=6", "optim.lr=0.004"])
        recompose(str(source.run_dir), ["verify=true"], added=["run.name=probe-verify"])  # as verify calls it
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reproducing run")]
    assert lines == [f"reproducing run {source.run_id} ({source.run_dir}), as it was",
                     f"reproducing run {source.run_id} ({source.run_dir}) with 2 new override(s): train.steps=6 "
                     "optim.lr=0.004",
                     f"reproducing run {source.run_id} ({source.run_dir}) with 1 new override(s): verify=true"]
