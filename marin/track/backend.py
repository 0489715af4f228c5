"""What the tracking modules share: where the MLflow store is, a client for it, its experiments
(the rule for secrets lives in `marin.track.secrets`)."""
from __future__ import annotations

import base64
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from marin.config.paths import project_path
from marin.config.schema import Config
from marin.track.secrets import safe_uri


class TrackingUnavailable(ConnectionError):
    """The tracking store cannot take the run (no answer, or sqlite for parallel jobs); raised
    before anything is written."""


def out_dir(cfg: Config) -> Path:
    """`run.out_dir`, absolute: relative paths resolve against the project root, not the cwd."""
    return project_path(cfg.run.out_dir)


def tracking_uri(cfg: Config) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else a sqlite store under the output folder."""
    uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return "sqlite:///" + str(out_dir(cfg) / "mlflow" / "mlflow.db")


def default_uri() -> str:
    """The tracking URI when no config is at hand: $MLFLOW_TRACKING_URI or the project's store."""
    return tracking_uri(Config())


# The stores MLflow takes new runs in (its file store, a folder or file://, is in maintenance mode
# and refuses them; MLflow said so only when the run was being made, in a paragraph).
SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


def check_uri(cfg: Config) -> list[tuple[str, str]]:
    """validate's check of the tracking URI a run would use (tracking.uri or $MLFLOW_TRACKING_URI)."""
    uri = tracking_uri(cfg)
    scheme = urllib.parse.urlsplit(uri).scheme.split("+")[0]   # postgresql+psycopg2://
    if scheme in SCHEMES:
        return []
    what = "MLflow's file store (a folder, file://) takes no new runs" if scheme in ("", "file") else \
        f"{scheme}: is not a store MLflow takes"
    return [("tracking.uri" if cfg.tracking.uri else "$MLFLOW_TRACKING_URI",
             f"{what}: use sqlite:///<path>/mlflow.db, http(s)://<server> or a database URL (postgresql://, "
             f"mysql://, mssql://); got {safe_uri(uri)}")]


def experiment_name(cfg: Config) -> str:
    return cfg.tracking.experiment or cfg.run.experiment or "default"


def is_sqlite(uri: str) -> bool:
    return uri.startswith("sqlite:")


def sqlite_path(uri: str) -> Path:
    return Path(uri.split(":///", 1)[1])


def check_reachable(uri: str, timeout: float = 3.0, create: bool = True) -> None:
    """Fail fast on an http(s) store that does not answer (MLflow's own client retries for
    minutes); make the folder of a sqlite store, or with `create` False (a tool that only reads)
    refuse one that does not exist. Other schemes are left to MLflow."""
    if is_sqlite(uri) and not create:
        _exists(uri)
        return
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(_health_request(uri), timeout=timeout) as reply:
                if reply.status == 200:
                    return
                problem = f"HTTP {reply.status}"
        except urllib.error.HTTPError as err:  # an answer, but not a healthy one (401: wrong credentials)
            problem = f"HTTP {err.code} {err.reason}"
        except (urllib.error.URLError, OSError, ValueError) as err:  # ValueError: http.client.InvalidURL
            problem = safe_uri(str(getattr(err, "reason", err)))
        raise TrackingUnavailable(f"MLflow tracking server {safe_uri(uri)} is not reachable ({problem}); "
                                  "start it, or set tracking.uri / MLFLOW_TRACKING_URI to a reachable store")
    if is_sqlite(uri):
        sqlite_path(uri).parent.mkdir(parents=True, exist_ok=True)


def _health_request(uri: str) -> urllib.request.Request:
    """GET <server>/health. Credentials in the URI (``http://user:password@host``, which MLflow's
    client sends as basic auth) go in an Authorization header: urllib cannot parse them in the host."""
    parts = urllib.parse.urlsplit(uri.rstrip("/"))
    netloc = parts.hostname or ""
    if ":" in netloc:  # an IPv6 address
        netloc = f"[{netloc}]"
    if parts.port is not None:
        netloc += f":{parts.port}"
    request = urllib.request.Request(urllib.parse.urlunsplit((parts.scheme, netloc, parts.path + "/health", "", "")))
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    return request


def _exists(uri: str) -> None:
    if not sqlite_path(uri).is_file():
        raise TrackingUnavailable(f"no MLflow store at {safe_uri(uri)} (nothing was created there: a tool that "
                                  "reads makes no store); give --tracking-uri the run's store")


def client(uri: str, create: bool = True):
    """MLflow's client of the store at `uri`. A sqlite store is made at first opening unless
    `create` is False (the tools that only read: marin.status, marin.report, marin.diff)."""
    if is_sqlite(uri) and not create:
        _exists(uri)
    from mlflow import MlflowClient

    # MLflow prints "View run … at: <its link>" to stdout as a server's run ends: a link without the
    # training view (MLflow 3 may open its GenAI view), beside the one marin prints (ui_url)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # MLflow announces a new sqlite store's tables and migrations at INFO on stderr: not ours to say
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not is_sqlite(uri):
        return MlflowClient(tracking_uri=uri)
    # MLflow creates (and migrates) a sqlite store's tables when a client first opens it; two
    # jobs doing that at once collide ("table already exists"). A lock file beside the database
    # makes the first opening one at a time; later ones find the tables and return at once.
    import fcntl

    path = sqlite_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return MlflowClient(tracking_uri=uri)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# MLflow 3 files an experiment under "GenAI apps & agents" or "Machine learning" by this tag
# (values in its UI's ExperimentKind); ours hold training runs.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
# MLflow 3.17's UI opens every experiment in its GenAI view (traces, an assistant panel) unless the
# address asks for the other one; links marin prints carry this query (`ui_url`).
UI_TRAINING_VIEW = "workflowType=machine_learning"


def ui_url(uri: str, experiment_id: str, run_id: str | None = None) -> str | None:
    """The MLflow UI's page of an experiment (or one run of it) in its model-training view, for
    an http(s) store (the UI is its server); None for a file or sqlite store (`mlflow ui`)."""
    if not uri.startswith(("http://", "https://")):
        return None
    page = f"experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{ui_base(uri)}/#/{page}?{UI_TRAINING_VIEW}"


def ui_base(uri: str) -> str:
    """A server's address as a link to click: no user or password in it (the browser asks)."""
    parts = urllib.parse.urlsplit(uri)
    netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")


def experiment_id(mlflow_client, name: str, uri: str) -> str:
    """The id of experiment `name`, created if absent and tagged as model training
    (`EXPERIMENT_KIND`, also added to an existing experiment that has no kind). On a sqlite store
    the artifacts go beside the database (MLflow would otherwise put them in ./mlruns of whatever
    the cwd is)."""
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(exp.experiment_id)
        if not any(key in exp.tags for key in EXPERIMENT_KIND):
            for key, value in EXPERIMENT_KIND.items():
                mlflow_client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    location = None
    if is_sqlite(uri):
        location = (sqlite_path(uri).parent / "artifacts").as_uri()
    try:
        made = mlflow_client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    except Exception:  # created meanwhile by another job of the same sweep
        exp = mlflow_client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id
    _hide_default_experiment(mlflow_client)
    return made


def _hide_default_experiment(mlflow_client) -> None:
    """MLflow makes an experiment `Default` (id 0) in every new store, artifacts in ./mlruns;
    marin never uses it: an empty one is deleted (kept in the store, hidden from the UI)."""
    try:
        default = mlflow_client.get_experiment("0")
        if default.lifecycle_stage == "active" and not mlflow_client.search_runs(["0"], max_results=1):
            mlflow_client.delete_experiment("0")
    except Exception:  # a server that forbids it, or no experiment 0: harmless either way
        pass

