"""Where the project's configs live (conf/, sweeps/), and configured paths made absolute."""
from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"
SWEEPS_DIR = PROJECT_ROOT / "sweeps"


def project_path(path: str | Path) -> Path:
    """A configured path, absolute: relative ones resolve against the project root, not the cwd."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else PROJECT_ROOT / p
