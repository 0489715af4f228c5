"""The Slurm tests (marked `slurm`) get the local cluster from tests/services.py: started by the
first of them in a run, skipped with the reason where Slurm cannot run, failed under CI (CI=true).
Their MLflow store is a real server, started for the run by the first test that asks."""
import os

import pytest

from tests import services


@pytest.fixture(scope="session")
def tracking_uri(request, tmp_path_factory) -> str:
    """MARIN_TEST_MLFLOW_URI if it answers, else this run's MLflow server (started on a free port by
    the first worker that asks); where it cannot start, a sqlite store (also shared with Slurm
    tasks) — under CI that is an error."""
    given = os.environ.get("MARIN_TEST_MLFLOW_URI")
    if given and services.healthy(given):
        return given
    server = services.mlflow_server(request.config)
    if "uri" in server:
        return server["uri"]
    if services.under_ci():
        pytest.fail(f"the MLflow server is required under CI: {server['error']}", pytrace=False)
    return "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
