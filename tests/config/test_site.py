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
