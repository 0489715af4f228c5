"""Test helpers: compose a config exactly as launch.py does (Hydra's compose API)."""
from __future__ import annotations

from marin.config.store import compose
from marin.launch.checks import load


def compose_dict(*overrides: str):
    return compose(overrides)


def make_config(*overrides: str):
    """The resolved `Config` for these overrides (validation included)."""
    return load(compose_dict(*overrides))[1]
