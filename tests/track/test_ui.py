"""`python -m marin.ui <run>` (marin-ui): MLflow's UI started for the default sqlite store on a free
port, and the run's link in the model-training view, the page the report and the trainer link to."""
import subprocess
import sys

import pytest

from marin import ui
from marin.track import backend, record
from tests.helpers import ROOT


@pytest.mark.slow
def test_the_ui_starts_on_the_sqlite_store_and_the_runs_link_answers(configure, store):
    rec = record.create(*configure("run.name=uilink"))
    done = subprocess.run([sys.executable, "-m", "marin.ui", str(rec.run_dir), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"MLflow UI for {rec.tracking_uri} at http://127.0.0.1:")
    base = lines[0].split(" at ", 1)[1].split()[0]
    assert f"run {rec.run_id}: {backend.ui_url(base, rec.info()['experiment_id'], rec.run_id)}" in lines
    assert lines[-1] == "checked: the run's page and the run answer"
    assert not ui.answers(f"{base}/health", timeout=2)  # stopped with --check


def test_a_server_store_is_linked_not_started(capsys):
    assert ui.main(["--tracking-uri", "http://user:pw@mlflow.example:5000"]) == 0
    assert capsys.readouterr().out.strip() == ("experiments: http://mlflow.example:5000/#/experiments?"
                                               + backend.UI_TRAINING_VIEW)


def test_bad_input_is_one_line(tmp_path, capsys):
    for argv, says in (([str(tmp_path / "nope")], "no such run directory"),
                       (["--tracking-uri", f"sqlite:///{tmp_path}/none.db"], "no MLflow store there yet"),
                       (["--port", "0"], "--port: a port number")):
        with pytest.raises(SystemExit) as exit_:
            ui.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err and err.count("\n") == 1, err


def test_a_port_in_use_is_one_line_before_mlflow_starts(tmp_path, capsys):
    """MLflow's server failed to bind, shut down and was reported as "did not start (exit status 0)"."""
    import socket

    (tmp_path / "mlflow.db").touch()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            ui.main(["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--port", str(port)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port} (") and "leave --port out" in err
