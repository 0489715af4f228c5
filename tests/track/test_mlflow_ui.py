"""The MLflow UI, as a user opens it: the page marin links a run to shows the training runs (not
MLflow 3's GenAI view of traces), with the run's readable name, user and source. Headless
Chromium against this test run's MLflow server (tests/services.py)."""
import re
import subprocess
import uuid

import pytest

from marin.launch.checks import load
from marin.track import backend, record
from tests import services
from tests.helpers import compose_dict


def page_text(url: str, profile) -> str:
    """The text of the page once its script has run (Chromium's virtual time: no fixed sleep)."""
    done = subprocess.run([services.chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    html = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", done.stdout, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.mark.browser
@pytest.mark.slow
def test_the_linked_mlflow_page_opens_on_the_training_run(request, tmp_path):
    server = services.mlflow_server(request.config)
    if "uri" not in server:
        pytest.fail(server["error"]) if services.under_ci() else pytest.skip(server["error"])
    uri = server["uri"]
    composed, resolved = load(compose_dict("model=micro", "train.steps=4", "run.name=uiprobe", f"tracking.uri={uri}",
                                           f"tracking.experiment=ui-{uuid.uuid4().hex[:8]}", f"run.out_dir={tmp_path}"))
    rec = record.create(composed, resolved, ["model=micro", "optim.lr=0.002", f"tracking.uri={uri}"])

    link = record.mlflow_link(rec)   # what the trainer prints: `mlflow run: <id> (<link>)`
    assert link.endswith(backend.UI_TRAINING_VIEW)
    run_page = page_text(link, tmp_path / "profile")
    name = f"uiprobe-{record.unique_suffix(rec.run_dir)} model=micro,lr=0.002"   # MLflow's name of an ad-hoc run
    assert name in run_page
    assert "Model metrics" in run_page and "Evaluation runs" not in run_page   # the training sidebar, not GenAI's
    assert "Created by —" not in run_page and "Source —" not in run_page       # mlflow.user, mlflow.source.name

    runs = page_text(link.replace(f"/runs/{rec.run_id}", ""), tmp_path / "profile2")
    assert name in runs and "Token Usage" not in runs  # the runs table, not trace charts
