"""The run record: directory contents, the MLflow run read back, atomicity, open()."""
import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import yaml
from mlflow import MlflowClient

from marin.track import backend, record, secrets
from marin.track.backend import TrackingUnavailable
from tests.helpers import ROOT


def test_create_writes_directory_and_mlflow_run(configure, store, monkeypatch):
    monkeypatch.setenv("MARIN_TEST_API_TOKEN", "hunter2")  # must never be logged
    composed, resolved, overrides = configure("run.name=rec", "optim.lr=0.002",
                                              "+hardware.env.HF_TOKEN=hunter2")
    rec = record.create(composed, resolved, overrides)

    assert rec.run_dir.parent == store["out"] / "runs"
    assert rec.run_dir.name.startswith(f"rec-{record.config_hash(resolved)[:8]}-")
    assert yaml.safe_load((rec.run_dir / "composed.yaml").read_text())["attention"]["num_heads"] == "auto"
    assert yaml.safe_load((rec.run_dir / "resolved.yaml").read_text())["attention"]["num_heads"] == resolved.attention.num_heads
    assert rec.overrides()[-2] == "optim.lr=0.002"
    info = rec.info()
    assert info["run_id"] == rec.run_id and info["seeds"] == {"train.seed": 0}
    assert "mlflow" in info["packages"] and info["git"]["commit"]

    run = MlflowClient(store["uri"]).get_run(rec.run_id)
    assert run.data.params["optim.lr"] == "0.002"
    assert run.data.params["model.d_model"] == "64"
    assert run.data.params["data.phase_names"] == '["pretrain"]'   # lists are stringified
    assert run.data.params["hardware.env.HF_TOKEN"] == secrets.REDACTED
    assert run.data.tags["config_hash"] == record.config_hash(resolved)
    assert run.data.tags["run_dir"] == str(rec.run_dir)
    assert run.data.tags["git_dirty"] in ("true", "false")
    assert json.loads(run.data.tags["overrides"])[0] == "model=micro"
    artifacts = {a.path for a in MlflowClient(store["uri"]).list_artifacts(rec.run_id, "record")}
    assert {"record/composed.yaml", "record/resolved.yaml", "record/overrides.yaml"} <= artifacts
    # artifacts beside the store, not in ./mlruns of the cwd
    assert str(store["uri"].split(":///")[1].rsplit("/", 1)[0]) in run.info.artifact_uri
    everything = "".join(p.read_text() for p in rec.run_dir.iterdir()) + json.dumps(run.data.to_dictionary())
    assert "hunter2" not in everything


def test_same_config_twice_gets_two_directories(configure):
    composed, resolved, overrides = configure("run.name=twice")
    a = record.create(composed, resolved, overrides)
    b = record.create(composed, resolved, overrides)
    assert a.run_dir != b.run_dir and a.run_id != b.run_id
    assert a.run_dir.name.split("-")[1] == b.run_dir.name.split("-")[1]  # same config hash


def test_failure_leaves_no_directory_and_no_live_run(configure, store, monkeypatch):
    composed, resolved, overrides = configure("run.name=atomic")

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")
    monkeypatch.setattr(record, "_log_params", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        record.create(composed, resolved, overrides)
    runs = store["out"] / "runs"
    assert not [p for p in runs.iterdir() if p.name.startswith("atomic-")]
    client = MlflowClient(store["uri"])
    exp = client.get_experiment_by_name("default")
    assert not client.search_runs([exp.experiment_id], "tags.run_name = 'atomic'")  # deleted runs are hidden


def test_unreachable_server_fails_before_any_directory(configure, store):
    composed, resolved, overrides = configure("run.name=offline", "tracking.uri=http://127.0.0.1:9")
    with pytest.raises(TrackingUnavailable, match="not reachable"):
        record.create(composed, resolved, overrides)
    assert not list(store["out"].glob("runs/offline-*"))


def test_open_by_directory_and_by_run_id(configure, store):
    composed, resolved, overrides = configure("run.name=opened")
    made = record.create(composed, resolved, overrides)
    assert record.open(made.run_dir) == made
    by_id = record.open(made.run_id, tracking_uri=store["uri"])
    assert by_id.run_dir == made.run_dir and by_id.run_id == made.run_id
    assert record.open(made.run_dir.name, out_dir=store["out"]).run_id == made.run_id


def test_open_errors(configure, store, tmp_path):
    with pytest.raises(record.RecordError, match="no such run directory"):
        record.open(tmp_path / "missing")
    with pytest.raises(record.RecordError, match="neither a run directory nor an MLflow run id"):
        record.open("0123456789abcdef0123456789abcdef", tracking_uri=store["uri"])
    composed, resolved, overrides = configure("run.name=noconfig")
    made = record.create(composed, resolved, overrides)
    (made.run_dir / "composed.yaml").unlink()
    with pytest.raises(record.RecordError, match="lacks its config"):
        record.open(made.run_dir)


def test_default_uri_is_absolute_sqlite_under_out_dir(monkeypatch):
    from marin.config.paths import PROJECT_ROOT
    from tests.helpers import make_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = backend.tracking_uri(make_config("model=tiny"))
    assert uri == f"sqlite:///{PROJECT_ROOT}/outputs/mlflow/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert backend.tracking_uri(make_config("model=tiny")) == "http://example:5000"
    assert backend.tracking_uri(make_config("model=tiny", "tracking.uri=sqlite:////x.db")) == "sqlite:////x.db"


def test_values_past_the_param_limit_go_to_an_artifact(configure, store, caplog):
    """A value past MLflow's 6,000 characters is logged cut short with a note, whole in
    record/long_params.json and the resolved config; said once. The overrides tag stays JSON."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH

    long_value = "x" * 9000   # past both limits: the param and the overrides tag
    with caplog.at_level(logging.WARNING, logger="marin.track"):
        rec = record.create(*configure("run.name=longparam", f"+hardware.env.LONG_FLAG={long_value}"))
    client = MlflowClient(store["uri"])
    run = client.get_run(rec.run_id)
    logged = run.data.params["hardware.env.LONG_FLAG"]
    assert len(logged) == MAX_PARAM_VAL_LENGTH and logged.startswith("x" * 5000)
    assert logged.endswith("(truncated: 9,000 characters, whole in record/resolved.yaml)")
    path = client.download_artifacts(rec.run_id, "record/long_params.json", str(rec.run_dir / "dl"))
    assert json.loads(open(path).read())["hardware.env.LONG_FLAG"] == long_value
    assert long_value in (rec.run_dir / record.RESOLVED).read_text()
    said = [r.getMessage() for r in caplog.records if "hardware.env.LONG_FLAG" in r.getMessage()]
    assert len(said) == 1 and "logged truncated" in said[0], said
    overrides = json.loads(run.data.tags["overrides"])   # marin.report parses it
    assert len(run.data.tags["overrides"]) <= MAX_TAG_VAL_LENGTH
    assert overrides[:2] == ["model=micro", "train.steps=4"]
    assert [o for o in overrides if "LONG_FLAG" in o][0].endswith("whole in record/overrides.yaml)")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A one-commit git project (a.py, pkg/m.py) standing in for the project root."""

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("y = 1\n")
    git("add", "a.py", "pkg/m.py")
    git("commit", "-qm", "one")
    monkeypatch.setattr(record, "PROJECT_ROOT", tmp_path)
    return tmp_path


def test_untracked_files_outside_the_tracked_folders_leave_the_tree_clean(project):
    """`mlflow ui` in the project writes ./mlartifacts, a user keeps notes at the top or a
    scratch folder: no source change. A new file in a tracked folder is one."""
    (project / "mlartifacts" / "0").mkdir(parents=True)
    (project / "mlartifacts" / "0" / "model.pkl").write_text("artifact")
    (project / "notes.txt").write_text("todo\n")
    (project / "scratch").mkdir()
    (project / "scratch" / "try.py").write_text("z = 3\n")
    git, _ = record.git_state()
    assert git["dirty"] is False and "notes.txt" in git["untracked"]
    (project / "pkg" / "new.py").write_text("w = 4\n")
    assert record.git_state()[0]["dirty"] is True


def test_a_secret_in_an_uncommitted_edit_is_not_saved(project, configure, store, monkeypatch):
    (project / "a.py").write_text('x = 1\nHF_TOKEN = "hf_diffsecret9931"\n')
    (project / "pkg" / "m.py").write_text("export GH_PAT=ghp_diffsecret4410\n")
    rec = record.create(*configure("run.name=diffsecret"))
    saved = (rec.run_dir / record.DIFF).read_text()
    assert "HF_TOKEN" in saved and "GH_PAT" in saved and rec.info()["git"]["dirty"] is True
    client = MlflowClient(store["uri"])
    artifact = client.download_artifacts(rec.run_id, f"record/{record.DIFF}", str(project / "dl"))
    for text in (saved, open(artifact).read()):
        assert "diffsecret9931" not in text and "diffsecret4410" not in text


def test_run_directory_keeps_its_log_masked(configure, monkeypatch):
    import logging

    monkeypatch.setenv("MARIN_TEST_API_KEY", "s3cr3t-value-123")
    composed, resolved, overrides = configure("run.name=logged")
    rec = record.create(composed, resolved, overrides)
    logging.getLogger("marin.train").warning("step 3 loss 1.0 key s3cr3t-value-123")
    text = (rec.run_dir / "run.log").read_text()
    assert f"run {rec.run_id}" in text and "step 3 loss 1.0" in text and "s3cr3t-value-123" not in text


def test_mlflow_shows_user_source_git_and_a_readable_name(configure, store):
    """What MLflow's own start_run would set (User, Source, git) and a name that says what the run
    changed; its experiment is filed as model training."""
    import getpass

    rec = record.create(*configure("run.name=readable", "optim.lr=0.002"))
    client = MlflowClient(store["uri"])
    run = client.get_run(rec.run_id)
    # no store, folder or name overrides; the directory's unique suffix: ad-hoc runs of one command differ
    assert run.info.run_name == f"readable-{rec.run_dir.name.rsplit('-', 1)[-1]} model=micro,steps=4,lr=0.002"
    again = record.create(*configure("run.name=readable", "optim.lr=0.002"))
    assert client.get_run(again.run_id).info.run_name != run.info.run_name
    tags = run.data.tags
    assert tags["mlflow.user"] == getpass.getuser() and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"].startswith("/") and tags["mlflow.source.git.commit"] == rec.info()["git"]["commit"]
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_server_behind_basic_auth_is_reachable_with_credentials_in_the_uri():
    """`http://user:password@host` is how MLflow's client takes basic-auth credentials."""
    import base64
    import http.server
    import threading

    expected = "Basic " + base64.b64encode(b"alice:s3cr%t").decode()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            ok = self.path == "/health" and self.headers.get("Authorization") == expected
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        backend.check_reachable(f"http://alice:s3cr%25t@127.0.0.1:{port}")   # percent-encoded, as in any URL
        with pytest.raises(TrackingUnavailable, match="HTTP 401") as err:
            backend.check_reachable(f"http://alice:wrong-pw-77@127.0.0.1:{port}")
        assert "wrong-pw-77" not in str(err.value)
    finally:
        server.shutdown()


OFFLINE_PROBE = """
import socket, sys, time
asked = []
def refuse(host, *args, **kwargs):
    asked.append(host)
    raise socket.gaierror("offline")
socket.getaddrinfo = refuse
from marin.track import backend
client = backend.client(sys.argv[1])
run = client.create_run(client.create_experiment("offline"))
client.log_metric(run.info.run_id, "train/loss", 1.0)
client.set_terminated(run.info.run_id)
time.sleep(2)  # room for a background sender
print(sorted(set(asked)))
"""


def test_tracking_contacts_no_host_but_its_store(tmp_path):
    """MLflow 3 sends usage telemetry (and fetches its settings from the internet) from every
    process that imports it, unless it sees CI; a run's tracking resolves no host at all (the
    store here is a file), outside the test environment too: the probe gets a bare environment,
    with none of the variables by which MLflow recognises CI or a test."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    done = subprocess.run([sys.executable, "-c", OFFLINE_PROBE, f"sqlite:///{tmp_path}/m.db"], cwd=ROOT,
                          env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


def test_files_that_can_hold_secrets_are_private(project, configure, store):
    """record.json, the saved configs, the overrides and git.diff are mode 0600 whatever the
    umask: masking misses what it was never told, the file's mode does not."""
    (project / "a.py").write_text("x = 2\n")   # a dirty tree: git.diff is written
    old = os.umask(0o022)
    try:
        rec = record.create(*configure("run.name=private-modes"))
    finally:
        os.umask(old)
    names = [record.INFO, record.COMPOSED, record.RESOLVED, record.OVERRIDES, record.DIFF]
    modes = {n: stat.S_IMODE((rec.run_dir / n).stat().st_mode) for n in names}
    assert modes == dict.fromkeys(names, 0o600)
