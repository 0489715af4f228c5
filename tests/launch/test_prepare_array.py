"""Data preparation as a Slurm job array on the local cluster (`marin.launch.prepare`): a
multi-file corpus prepared by 3 array tasks, one of them killed mid-shard (SIGKILL), then the same
command again, without waiting (the array's last task writes the index): the shards and index
equal a local, uninterrupted preparation's."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marin.data import prepare, prepare_tasks
from tests.data.test_prepare_tasks import _cfg, corpus, fingerprint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def prepare_on_slurm(root: Path, cache: str, *extra: str, wait: bool = True) -> subprocess.CompletedProcess:
    source = f"{{name:a,kind:jsonl,paths:['{root}/in/*.jsonl'],weights:[1.0]}}"
    args = ["hardware=slurm_cpu", "model=tiny", f"data.sources=[{source}]", "data.eval_sets=[]",
            f"data.cache_dir={root / cache}", "data.shard_tokens=600", "data.prepare_tasks=3", f"wait={str(wait).lower()}", *extra]
    env = {k: v for k, v in os.environ.items() if k != prepare_tasks.KILL_VARIABLE}
    return subprocess.run([sys.executable, "-m", "marin.data.prepare", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)


def test_an_array_with_a_killed_task_reruns_to_the_uninterrupted_shards(tmp_path):
    corpus(tmp_path)
    local = _cfg(tmp_path, "local")
    prepare.prepare(local, progress=False)
    killed = prepare_on_slurm(tmp_path, "slurm", f"+hardware.env.{prepare_tasks.KILL_VARIABLE}='1:20'")
    assert killed.returncode == 2, killed.stdout + killed.stderr
    assert "slurm array:" in killed.stdout and "the array failed" in killed.stderr and "task 1" in killed.stderr
    (src,) = prepare.plan(_cfg(tmp_path, "slurm")).sources
    assert not (Path(src.dir) / "index.json").exists()   # a source with a lost shard is not listed
    again = prepare_on_slurm(tmp_path, "slurm", wait=False)   # returns once submitted
    assert again.returncode == 0 and "run this command again afterwards" in again.stdout, again.stdout + again.stderr
    deadline = time.time() + 300
    while not (Path(src.dir) / "index.json").exists() and time.time() < deadline:   # the array's last task
        time.sleep(1)
    assert fingerprint(_cfg(tmp_path, "slurm")) == fingerprint(local)
