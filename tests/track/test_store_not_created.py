"""The tools that read a run (`marin.status`, `marin.report`, `marin.diff`) never create an MLflow
store: a sqlite store that a record.json names but that does not exist is one line, and no file or
folder is made there (issue 42's probe: a store was created wherever a record pointed)."""
import json

import pytest

from marin.track import backend
from tests.helpers import fake_run_dir


def run_pointing_at(tmp_path, uri: str):
    fake_run_dir(tmp_path, "train: {steps: 4}\nrun: {name: probe}\n")
    [run_dir] = (tmp_path / "runs").iterdir()
    info = json.loads((run_dir / "record.json").read_text())
    (run_dir / "record.json").write_text(json.dumps({**info, "tracking_uri": uri}))
    return run_dir


def test_a_reader_does_not_create_a_sqlite_store(tmp_path):
    uri = f"sqlite:///{tmp_path}/elsewhere/mlflow.db"
    with pytest.raises(backend.TrackingUnavailable, match="no MLflow store at"):
        backend.check_reachable(uri, create=False)
    with pytest.raises(backend.TrackingUnavailable, match="no MLflow store at"):
        backend.client(uri, create=False)
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("tool", ["report", "status"])
def test_report_and_status_of_a_run_whose_store_is_gone_make_none(tmp_path, tool, capsys):
    from marin import report, status

    run_dir = run_pointing_at(tmp_path, f"sqlite:///{tmp_path}/elsewhere/mlflow.db")
    main = report.main if tool == "report" else status.main
    try:
        main([str(run_dir), "--no-log"] if tool == "report" else [str(run_dir), "--mlflow"])
    except SystemExit:
        pass
    assert not (tmp_path / "elsewhere").exists()


def test_report_on_a_store_that_does_not_answer_gives_up_in_seconds(tmp_path, capsys):
    """issue 42's probe: 250 s of MLflow's retries before a traceback; now the server's health is
    asked first (a few seconds at most) and the answer is one line."""
    import socket
    import time

    from marin import report

    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = run_pointing_at(tmp_path, f"http://127.0.0.1:{port}")
    began = time.monotonic()
    with pytest.raises(SystemExit) as end:
        report.main([str(run_dir), "--no-log"])
    assert time.monotonic() - began < 15 and end.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "is not reachable" in line
