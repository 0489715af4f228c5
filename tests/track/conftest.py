"""A real sqlite MLflow store and output folder shared by the tracking tests (creating MLflow's
tables takes seconds; each test uses its own run names)."""
import pytest

from tests.helpers import compose_dict
from marin.config.validate import load


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("track")
    return {"uri": f"sqlite:///{root}/mlflow/mlflow.db", "out": root / "out", "root": root}


@pytest.fixture
def configure(store):
    """(composed, resolved, overrides) for model=tiny plus `extra`, tracked in the module's store."""
    def make(*extra: str):
        overrides = ["model=tiny", "train.steps=4", f"tracking.uri={store['uri']}",
                     f"run.out_dir={store['out']}", *extra]
        composed, resolved = load(compose_dict(*overrides))
        return composed, resolved, overrides
    return make
