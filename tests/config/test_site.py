"""Site config: `$MARIN_SITE/local/site.yaml` (or the git-ignored conf/local/site.yaml) sets site
values when present; absent, nothing changes; the command line beats it."""
import pytest

from tests.helpers import compose_dict

SITE = "# @package _global_\ndata:\n  root: /site/data\nhardware:\n  partition: site-part\n"


@pytest.fixture
def site(tmp_path, monkeypatch):
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "site.yaml").write_text(SITE)
    monkeypatch.setenv("MARIN_SITE", str(tmp_path))
    return tmp_path


def test_site_file_sets_values(site):
    cfg = compose_dict("hardware=slurm_cpu")
    assert cfg.data.root == "/site/data" and cfg.hardware.partition == "site-part"


def test_no_site_file_changes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("MARIN_SITE", str(tmp_path))  # a folder without local/site.yaml
    with_empty = compose_dict("hardware=slurm_cpu")
    monkeypatch.delenv("MARIN_SITE")
    assert with_empty == compose_dict("hardware=slurm_cpu") and with_empty.data.root != "/site/data"


def test_command_line_beats_the_site_file(site):
    cfg = compose_dict("hardware=slurm_cpu", "data.root=/mine", "hardware.partition=p2")
    assert cfg.data.root == "/mine" and cfg.hardware.partition == "p2"


# Bring your own config: a user's experiment and sweep, without `# @package _global_`, in a folder
# given with --config-dir (or hydra.searchpath) or in the site folder, compose as the shipped ones.
MY_EXPERIMENT = "# my experiment: no package header\ndefaults:\n  - override /model: tiny\ntrain:\n  steps: 7\n"
MY_SWEEP = "run:\n  sweep: my_lrs\nhydra:\n  sweeper:\n    params:\n      optim.lr: 1e-3,2e-3\n"


def _own_config(folder):
    (folder / "experiment").mkdir(parents=True)
    (folder / "experiment" / "mine.yaml").write_text(MY_EXPERIMENT)
    (folder / "sweep").mkdir()
    (folder / "sweep" / "my_lrs.yaml").write_text(MY_SWEEP)
    return folder


def _hydra_compose(*overrides):
    from hydra import compose, initialize_config_dir

    from marin.config.paths import CONF_DIR
    from marin.config.store import register

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_own_experiment_and_sweep_need_no_package_header(tmp_path):
    folder = _own_config(tmp_path / "mine")
    cfg = _hydra_compose(f"hydra.searchpath=[file://{folder}]", "experiment=mine", "sweep=my_lrs")
    assert cfg.train.steps == 7 and cfg.model.d_model == 64  # at the root, its defaults applied (model=tiny)
    assert cfg.run.sweep == "my_lrs" and cfg.hydra.sweeper.params["optim.lr"] == "1e-3,2e-3"


def test_own_experiment_and_sweep_in_the_site_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MARIN_SITE", str(_own_config(tmp_path / "site")))
    cfg = _hydra_compose("experiment=mine", "sweep=my_lrs")
    assert cfg.train.steps == 7 and cfg.hydra.sweeper.params["optim.lr"] == "1e-3,2e-3"


def test_own_sweep_under_config_dir_runs_its_jobs(tmp_path):
    """`launch.py -m --config-dir <folder> sweep=<own>` runs one job per swept value (dry runs)."""
    import json
    import subprocess
    import sys

    from marin.config.paths import PROJECT_ROOT

    folder = _own_config(tmp_path / "mine")
    done = subprocess.run([sys.executable, "launch.py", "-m", "--config-dir", str(folder), "sweep=my_lrs",
                           "experiment=mine", "dry_run=json"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    plans = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [p["lr"]["adamw"] for p in plans] == [1e-3, 2e-3] and {p["steps"] for p in plans} == {7}
