"""constraints.txt pins exactly what this environment installs: every pin is installed at its
version (a pin of a package nothing installs misleads whoever reads it), and every dependency
of pyproject.toml is pinned."""
import importlib.metadata
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in (l.split("#")[0].strip() for l in lines) if line)


def test_every_pin_is_installed_at_its_version():
    for name, version in _pins().items():
        assert importlib.metadata.version(name) == version, name


def test_every_dependency_is_pinned():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    assert names <= set(_pins())
