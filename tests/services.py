"""The services some tests need, started by the first test of a run that needs them and stopped at
the end of that run (tests/conftest.py): the local Slurm cluster (tests marked `slurm`), a
headless Chromium (`browser`, installed, never removed) and an MLflow server (the `tracking_uri`
fixture of tests/launch). A run that selects none of those tests starts nothing.

Where a service cannot run (not root, no apt-get) its tests are skipped with the reason; under CI
(CI=true) they fail instead, so CI always runs them. What a run starts is listed in
<run dir>/services/started (scripts/services_up.sh writes it) and stopped by
scripts/services_down.sh from the xdist controller, once all workers are done."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# One Slurm cluster and one dpkg per machine: starting the cluster and apt-get installs are serialized
# across workers and runs by this lock (a file lock: released if its holder dies).
MACHINE_LOCK = ROOT / "outputs" / "services" / "start.lock"

_known: dict[str, str | None] = {}   # per process: service -> None (usable) or why not


def under_ci() -> bool:
    return os.environ.get("CI") == "true"


def services_dir(config) -> Path:
    from tests.conftest import run_dir

    return run_dir(config) / "services"


def script_env(config, **extra: str) -> dict:
    folder = services_dir(config)
    return {**os.environ, "MARIN_SERVICES_DIR": str(folder), "MLFLOW_DIR": str(folder / "mlflow"), **extra}


def can_install() -> str | None:
    """None if this process may install and start system services; else why not."""
    if os.geteuid() != 0:
        return "not root: the local cluster and the browser need root to install and start"
    if shutil.which("apt-get") is None:
        return "no apt-get: cannot install on this system"
    return None


def require(config, name: str) -> None:
    """Make `name` ("slurm" or "browser") usable for the test being set up, or skip it with the
    reason (fail under CI)."""
    if name not in _known:
        _known[name] = {"slurm": _slurm, "browser": _browser}[name](config)
    reason = _known[name]
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"{name} is required under CI: {reason}", pytrace=False)
    pytest.skip(f"no {name}: {reason}")


# --- Slurm ---------------------------------------------------------------------------------------

def slurm_unavailable() -> str | None:
    """None if the local cluster answers (sinfo) and its accounting works (sacct: submitit polls
    it); else why not."""
    if shutil.which("sinfo") is None:
        return "sinfo not found"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 15 s"
    states = done.stdout.split()
    if done.returncode != 0 or not any(s.rstrip("*") in ("idle", "mixed", "allocated") for s in states):
        return f"no usable Slurm node (sinfo: {(done.stderr or done.stdout).strip()[:200]})"
    if shutil.which("sacct") is None or subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True,
                                                         timeout=15).returncode != 0:
        return "sacct does not work (submitit needs slurmdbd): start the cluster with SLURM_DBD=1"
    return None


def _slurm(config) -> str | None:
    if slurm_unavailable() is None:
        return None                      # already up (started by hand or by another run): reused, not stopped
    from tests.helpers import locked

    with locked(MACHINE_LOCK):
        if slurm_unavailable() is None:
            return None
        why_not = can_install()
        if why_not:
            return why_not
        done = subprocess.run(["bash", str(SCRIPTS / "services_up.sh"), "slurm"], cwd=ROOT, env=script_env(config),
                              capture_output=True, text=True, timeout=900)
        reason = slurm_unavailable()
        if reason is not None:
            return f"scripts/services_up.sh slurm did not bring it up ({reason}): {done.stderr.strip()[-1500:]}"
    return None


# --- the browser -----------------------------------------------------------------------------------

def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browser(config) -> str | None:
    if chromium():
        return None
    why_not = can_install()
    if why_not:
        return f"no headless chromium ({why_not}; scripts/browser_install.sh installs it)"
    from tests.helpers import locked

    with locked(MACHINE_LOCK):
        if chromium() is None:
            done = subprocess.run(["bash", str(SCRIPTS / "browser_install.sh")], cwd=ROOT, capture_output=True,
                                  text=True, timeout=900)
            if chromium() is None:
                return f"scripts/browser_install.sh did not install chromium: {done.stderr.strip()[-1500:]}"
    return None


# --- the MLflow server -------------------------------------------------------------------------------

def healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(uri + "/health", timeout=3) as reply:
            return reply.status == 200
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_server(config) -> dict:
    """{"uri": ...} of this run's MLflow server, started on a free port by the first worker that
    asks (its folder and pid file under this run's folder, so parallel runs never share one), or
    {"error": why it did not start}."""
    from tests.conftest import once

    def start() -> dict:
        port = str(free_port())
        done = subprocess.run(["bash", str(SCRIPTS / "services_up.sh"), "mlflow"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env=script_env(config, MLFLOW_PORT=port))
        uri = f"http://127.0.0.1:{port}"
        if done.returncode == 0 and healthy(uri):
            return {"uri": uri}
        return {"error": f"the MLflow server did not start: {(done.stdout + done.stderr).strip()[-1500:]}"}
    return once(config, "mlflow-server", start)


# --- the end of the run ----------------------------------------------------------------------------

def stop_started(config) -> None:
    """scripts/services_down.sh for what this run started (nothing if it started nothing)."""
    folder = services_dir(config)
    started = folder / "started"
    if not started.is_file() or not started.read_text().strip():
        return
    subprocess.run(["bash", str(SCRIPTS / "services_down.sh")], cwd=ROOT, env=script_env(config),
                   capture_output=True, text=True, timeout=300)
