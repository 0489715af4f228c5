"""Slurm tests need the local cluster and MLflow server of scripts/services_up.sh (the README's
test command starts them). Where Slurm cannot run they are skipped with the reason; under CI
(CI=true) they fail instead, so CI always runs them."""
import os
import shutil
import subprocess
import urllib.request
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES_ENV = ROOT / "outputs" / "services" / "services.env"


@lru_cache(maxsize=1)
def services() -> dict:
    """What scripts/services_up.sh wrote (MARIN_TEST_MLFLOW_URI, MARIN_SLURM_SKIP)."""
    found = {}
    if SERVICES_ENV.is_file():
        for line in SERVICES_ENV.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                found[key.strip()] = value.strip().strip('"')
    return found


@lru_cache(maxsize=1)
def slurm_unavailable() -> str | None:
    """None if the local cluster answers; else why not."""
    if shutil.which("sinfo") is None:
        return services().get("MARIN_SLURM_SKIP") or "sinfo not found: start the cluster with bash scripts/services_up.sh"
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


def pytest_runtest_setup(item):
    if item.get_closest_marker("slurm") is None:
        return
    reason = slurm_unavailable()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"Slurm is required under CI: {reason}", pytrace=False)
    pytest.skip(f"no local Slurm cluster: {reason}")


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory) -> str:
    """The test MLflow server if one is up, else a sqlite store (also shared with Slurm tasks)."""
    for uri in (os.environ.get("MARIN_TEST_MLFLOW_URI"), services().get("MARIN_TEST_MLFLOW_URI"),
                "http://127.0.0.1:5055"):
        if not uri:
            continue
        try:
            with urllib.request.urlopen(uri + "/health", timeout=3) as reply:
                if reply.status == 200:
                    return uri
        except OSError:
            continue
    return "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
