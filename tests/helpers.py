"""Test helpers: compose a config exactly as launch.py does (Hydra's compose API)."""
from __future__ import annotations

from hydra import compose, initialize_config_dir

from marin.config.paths import CONF_DIR
from marin.config.store import register
from marin.launch.checks import load


def compose_dict(*overrides: str):
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def make_config(*overrides: str):
    """The resolved `Config` for these overrides (validation included)."""
    return load(compose_dict(*overrides))[1]
