"""Composing, printing and validating a config never imports JAX (it costs ~1 s per command)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
sys.path.insert(0, {root!r})
from tests.helpers import make_config
make_config({overrides})
print('jax' in sys.modules, 'flax' in sys.modules, 'mlflow' in sys.modules)
"""


def test_validation_does_not_import_jax():
    for overrides in ("", "'experiment=mochi_535b_a23b', 'dry_run=true'", "'optim=muonh', 'train.steps=auto'"):
        out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), overrides=overrides)],
                             capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["False", "False", "False"], (overrides, out.stdout, out.stderr)


@pytest.mark.parametrize("flags", [["--cfg", "job"], ["--cfg", "job", "--resolve"]])
def test_cfg_job_does_not_import_jax(flags):
    probe = (f"import atexit, runpy, sys; sys.argv = ['launch.py', *{flags!r}]\n"
             "import marin.cli  # its exit handler ends the process: the probe registers after it, so runs before it\n"
             "atexit.register(lambda: print('jax' in sys.modules, file=sys.stderr))  # launch.py exits at once\n"
             "runpy.run_path('launch.py', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert "model:" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "False", out.stderr


def test_dry_run_config_prints_the_resolved_yaml_without_jax():
    """`dry_run=config`: the resolved config as YAML, every auto replaced, JAX not imported."""
    import yaml

    probe = ("import atexit, runpy, sys; sys.argv = ['launch.py', 'model=tiny', 'train.steps=auto', 'dry_run=config']\n"
             "import marin.cli  # its exit handler ends the process: the probe registers after it, so runs before it\n"
             "atexit.register(lambda: print('jax' in sys.modules, file=sys.stderr))  # launch.py exits at once\n"
             "runpy.run_path('launch.py', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.stderr.strip().splitlines()[-1] == "False", out.stderr
    tree = yaml.safe_load(out.stdout)
    assert isinstance(tree["train"]["steps"], int) and isinstance(tree["attention"]["num_heads"], int)
    assert "auto" not in out.stdout.split(), out.stdout


def test_dry_run_config_ends_with_the_derived_step_counts():
    """Warmup and the data phase boundaries are derived from fractions, so no field holds them:
    the YAML ends with them as comments (still YAML), the hero's as production ran (3,902; 312,192)."""
    import yaml

    out = subprocess.run([sys.executable, "launch.py", "experiment=mochi_535b_a23b", "dry_run=config"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tail = out.stdout.splitlines()[-3:]
    assert tail[0].startswith("# derived") and "warmup steps: 3902" in tail[1] and "[312192]" in tail[2], tail
    assert yaml.safe_load(out.stdout)["schedule"]["warmup_frac"] == 0.01
