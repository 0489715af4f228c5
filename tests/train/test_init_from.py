"""`train.init_from`: by default a run takes the source's weights (and router state) and trains
train.steps new steps from step 0 with a fresh optimizer; `init_from_mode=continue` keeps the
source's step counter and refuses a run that would end at or before it; a checkpoint the model
cannot take is refused before anything is written. The source is the shared tiny run
(tests/trained.py: 4 steps, a checkpoint at 4)."""
import json

import pytest

from marin.launch.checks import load
from tests.helpers import compose_dict, launch_here
from tests.trained import TINY_RUN, tiny_run


def _rows(run_dir, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["value"] for r in rows if r["key"] == key}


def _tree_equal(a, b) -> bool:
    import jax
    import numpy as np

    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_weights_mode_trains_train_steps_from_step_0_with_the_sources_weights(tmp_path_factory):
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.track import record
    from marin.train import init_from
    from marin.train.checkpoint import listed_steps, restore_from
    from marin.train.loop import train
    from marin.train.state import init_sharded

    source, _ = tiny_run(tmp_path_factory)
    root = source.run_dir.parent.parent
    overrides = [*TINY_RUN, "train.steps=3", f"run.out_dir={root}", f"tracking.uri={source.tracking_uri}",
                 f"train.init_from={source.run_dir}"]
    composed, cfg = load(compose_dict(*overrides))
    assert cfg.train.init_from_mode == "weights"  # the default

    # The state it starts from: the source's parameters and router state, step 0, a fresh optimizer
    # state (optax's schedule counts from its state: a fresh one starts the schedule again).
    fresh, _ = init_sharded(cfg, build_optimizer(cfg), make_mesh(cfg), cfg.train.seed)
    state, meta, info = init_from.restore(cfg, fresh, init_from.locate(cfg.train.init_from))
    saved, _ = restore_from(source.run_dir, fresh)
    assert int(saved.step) == 4 and int(state.step) == 0 and meta is None
    assert info["step"] == 4 and info["mode"] == "weights"
    assert _tree_equal(state.params, saved.params) and not _tree_equal(state.params, fresh.params)
    assert _tree_equal(state.router_state, saved.router_state)
    assert _tree_equal(state.opt_state, fresh.opt_state) and not _tree_equal(saved.opt_state, fresh.opt_state)

    rec = record.create(composed, cfg, overrides)
    train(cfg, rec)
    losses = _rows(rec.run_dir, "train/loss")
    assert sorted(losses) == [1, 2, 3]  # train.steps new steps, counted from 0 (not 5…3: nothing)
    assert listed_steps(rec.run_dir / "checkpoints") == [3]
    # Step 1 sees the same first batch as the source's step 1, with the source's trained weights.
    assert losses[1] < _rows(source.run_dir, "train/loss")[1] - 0.1
    assert json.loads((rec.run_dir / "record.json").read_text())["init_from"]["mode"] == "weights"


@pytest.mark.parametrize("extra, field", [
    (("train.steps=4",), "train.steps"),                         # the restored step itself: nothing to train
    (("train.steps=8", "train.stop_after=3"), "train.stop_after"),
])
def test_continue_mode_refuses_a_run_that_ends_at_or_before_the_restored_step(tmp_path, tmp_path_factory, capsys,
                                                                               extra, field):
    source, _ = tiny_run(tmp_path_factory)
    capsys.readouterr()  # the source run's own output (it tokenizes on a fresh clone)
    code = launch_here(*TINY_RUN, f"run.out_dir={tmp_path}", f"tracking.uri={source.tracking_uri}",
                       f"train.init_from={source.run_dir}", "train.init_from_mode=continue", *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: invalid config: {field}: must be above step 4") and "init_from_mode=weights" in err[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("where", [(), ("hardware=slurm_cpu",)], ids=["local", "slurm"])
def test_a_model_the_checkpoint_does_not_fit_is_refused_before_anything_is_written(tmp_path, tmp_path_factory, capsys,
                                                                                   where):
    """Refused before the run exists, here or before a Slurm job is submitted."""
    from mlflow.tracking import MlflowClient

    source, _ = tiny_run(tmp_path_factory)
    client = MlflowClient(source.tracking_uri)
    def runs() -> int:
        return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))

    runs_before = runs()
    capsys.readouterr()  # the source run's own output (it tokenizes on a fresh clone)
    code = launch_here(*TINY_RUN, "model.num_layers=3", f"run.out_dir={tmp_path}",
                       f"tracking.uri={source.tracking_uri}", f"train.init_from={source.run_dir}", *where)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: train.init_from: checkpoint ") and "does not fit" in err[0]
    assert "params.layers" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "runs").exists()
    assert runs() == runs_before  # no MLflow run either
