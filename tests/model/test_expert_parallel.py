"""Expert parallelism on 8 forced host devices (mesh data=2 × expert=4) matches one device.

The device count must be forced before JAX is imported, and this pytest process has already
imported it, so the comparison runs in a subprocess (`tests/model/_ep_check.py`).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_expert_parallel_layer_matches_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", PJRT_NPROC="16",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.model._ep_check", "qb", "softmax_aux"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for router, r in results.items():
        assert r["devices"] == 8, r
        assert r["dropped"] == 0.0, (router, r)            # cf = E/k: a no-drop capacity
        assert r["y"] <= 1e-5 and r["grads"] <= 1e-5 and r["stats"] <= 1e-5, (router, r)
    assert results["softmax_aux"]["aux_loss"] > 0          # the psum'd aux loss is really there
