"""A real sqlite MLflow store and output folder shared by the tracking tests (creating MLflow's
tables takes seconds; each test uses its own run names)."""
import pytest

from marin.launch.checks import load
from tests.helpers import compose_dict, new_store


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("track")
    return {"uri": new_store(root / "mlflow"), "out": root / "out", "root": root}


@pytest.fixture
def configure(store):
    """(composed, resolved, overrides) for model=micro plus `extra`, tracked in the module's store."""
    def make(*extra: str):
        overrides = ["model=micro", "train.steps=4", f"tracking.uri={store['uri']}",
                     f"run.out_dir={store['out']}", *extra]
        composed, resolved = load(compose_dict(*overrides))
        return composed, resolved, overrides
    return make


@pytest.fixture
def multirun_job(store):
    """make(num, *overrides) -> (composed, resolved, overrides) of job `num` of a multirun, with
    HydraConfig set as Hydra's basic launcher sets it (mode MULTIRUN, hydra.job.num)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from marin.config.paths import CONF_DIR
    from marin.config.store import name_options, register

    def make(num: int, *extra: str):
        overrides = ["model=micro", "train.steps=4", f"tracking.uri={store['uri']}",
                     f"run.out_dir={store['out']}", *extra]
        register()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.mode = RunMode.MULTIRUN
            cfg.hydra.job.num = num
        HydraConfig.instance().set_config(cfg)
        task = cfg.copy()
        with open_dict(task):
            del task["hydra"]
        return (*load(name_options(task, cfg.hydra.runtime.choices)), overrides)

    yield make
    HydraConfig.instance().cfg = None


@pytest.fixture
def lr_sweep_parent(store, multirun_job, monkeypatch):
    """make(sweep_id) -> the parent run id of a finished 3-point learning-rate multirun (not a
    ladder: one compute scale), its jobs' eval/macro_loss 3, 4, 5 at step 4."""
    import sys

    from mlflow import MlflowClient

    from marin.track import record, tracker

    def make(sweep_id: str) -> str:
        monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "optim.lr=1e-3,3e-3,1e-2"])
        runs = []
        for i, lr in enumerate((1e-3, 3e-3, 1e-2)):
            rec = record.create(*multirun_job(i, f"run.sweep_id={sweep_id}", f"optim.lr={lr}"))
            t = tracker.Tracker(rec)
            t.log_metrics({"eval/macro_loss": 3.0 + i}, 4)
            t.finish()
            runs.append(rec.run_id)
        return MlflowClient(store["uri"]).get_run(runs[0]).data.tags["mlflow.parentRunId"]
    return make
