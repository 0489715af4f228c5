"""`python -m marin.ui [run]` (or `marin-ui`): a link to click for a run in MLflow's UI.

A sqlite store (the default, `<run.out_dir>/mlflow/mlflow.db`) has no server: this starts MLflow's
UI for it on a free port of this machine (127.0.0.1, `--port` to choose), waits until it answers,
prints the run's page (the model-training view: `backend.ui_url`) and serves until Ctrl-C. A
tracking server is its own UI: the link is printed and nothing is started. With no run: the
project's store (or `--tracking-uri`) and its experiments' page.

`--check` starts the UI, prints the link, fetches the run's page and the run from the server
(they must answer), then stops it: for a script or a test. Exit 0; 2 for bad input (a run or
store that is not there), 1 when the UI did not start.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from marin.cli import Parser, fail
from marin.config.schema import Config, RunConfig
from marin.track import backend, record, refs
from marin.track.errors import first_line
from marin.track.secrets import safe_uri

START_S = 120  # MLflow's server imports and migrates the store: seconds on a busy machine


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int) -> str | None:
    """Why `port` cannot be listened on (in use, not allowed), or None: MLflow's server would
    otherwise start, fail to bind and shut down with a line that does not say so."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as err:
            return err.strerror or str(err)
    return None


def answers(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 (our own server's URL)
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start(uri: str, host: str, port: int, log: Path) -> subprocess.Popen:
    """MLflow's UI (its tracking server) for the store `uri`; its output in `log`."""
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true")
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host,
                                 "--port", str(port), "--workers", "1"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def wait_until_up(server: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if answers(f"{base}/health", timeout=2):
            return
        if server.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            fail(f"the MLflow UI did not start (exit status {server.returncode}): {tail[0]}", code=1)
        time.sleep(0.2)
    stop(server)
    fail(f"the MLflow UI did not answer within {START_S} s (its log: {log})", code=1)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, 15)  # its own session: the server and the workers it started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)


def links(base: str, experiment_id: str | None, run_id: str | None) -> list[str]:
    """The run's page and its experiment's (the model-training view), or the experiments' list."""
    if experiment_id is None:
        return [f"experiments: {base}/#/experiments?{backend.UI_TRAINING_VIEW}"]
    out = [f"experiment {experiment_id}: {backend.ui_url(base, experiment_id)}"]
    return ([f"run {run_id}: {backend.ui_url(base, experiment_id, run_id)}"] if run_id else []) + out


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m marin.ui", description=__doc__.split("\n\n")[0])
    p.add_argument("run", nargs="?", help="a run (its directory, name, a unique prefix or MLflow run id); "
                   "none: the store's experiments")
    p.add_argument("--port", type=int, help="the UI's port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on (default 127.0.0.1: this machine)")
    p.add_argument("--check", action="store_true", help="start, print the link, check the run's page answers, stop")
    p.add_argument("--tracking-uri", help="the store (default: the run's; $MLFLOW_TRACKING_URI or the project's)")
    p.add_argument("--out-dir", help="where run names are looked up (default: the project's outputs/)")
    args = p.parse_args(argv)
    if args.port is not None and not 0 < args.port < 65536:
        fail(f"--port: a port number 1…65535; got {args.port}")
    experiment_id = run_id = None
    if args.run:
        try:
            rec = record.open(args.run, tracking_uri=args.tracking_uri, out_dir=args.out_dir)
        except record.RecordError as err:
            fail(first_line(err))
        uri, run_id = rec.tracking_uri, rec.run_id
        experiment_id = rec.info().get("experiment_id")
    else:
        site = Config(run=RunConfig(out_dir=str(refs.out_root(args.out_dir))))
        uri = args.tracking_uri or backend.tracking_uri(site)
    if uri.startswith(("http://", "https://")):  # a server is its own UI
        base = backend.ui_base(uri)
        print("\n".join(links(base, experiment_id, run_id)))
        return 0
    if not backend.is_sqlite(uri):
        fail(f"{safe_uri(uri)}: marin.ui serves a sqlite store or links a tracking server's UI")
    if not backend.sqlite_path(uri).is_file():
        fail(f"{safe_uri(uri)}: no MLflow store there yet (a run makes it)")
    if args.port is not None and (taken := bind_error(args.host, args.port)):
        fail(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({taken}); leave --port out for a free one")
    port = args.port or free_port(args.host)
    base = f"http://{args.host}:{port}"
    log = backend.sqlite_path(uri).parent / "ui.log"
    server = start(uri, args.host, port, log)
    try:
        wait_until_up(server, base, log)
        print(f"MLflow UI for {safe_uri(uri)} at {base} (Ctrl-C stops it; its log: {log})")
        print("\n".join(links(base, experiment_id, run_id)), flush=True)
        if args.check:
            api = f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}" if run_id else f"{base}/health"
            page = backend.ui_url(base, experiment_id, run_id) if experiment_id else base
            if not (answers(api) and answers(page)):
                fail(f"the MLflow UI at {base} did not answer for {run_id or 'the store'}", code=1)
            print("checked: the run's page and the run answer")
            return 0
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
