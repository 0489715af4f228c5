"""Registers the root schema (and the named sweeps) in Hydra's ConfigStore.

``conf/config.yaml`` starts its defaults list with ``schema`` (the `Config` dataclass, stored at
the root, where Hydra lists no options), so every group option is merged into a typed node:
unknown keys and wrong types fail at compose time, also for option files found through
``--config-dir``. The group schemas are not stored as group options: an option named ``schema``
would show in ``--help``, tab completion and ``glob(*)`` and compose as the defaults. The files in
``sweeps/`` are stored as the ``sweep`` group (package ``_global_``), which is how
``sweep=<name>`` finds them. The resolver
``marin.private_tmp`` gives Hydra's sweep folder a parent that only its owner can read.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from marin.config.paths import CONF_DIR, SWEEPS_DIR
from marin.config.schema import Config

_registered = False


def private_tmp() -> str:
    """$TMPDIR/marin-hydra-<uid>, made (or fixed to) mode 0700: Hydra's multirun.yaml there holds
    the command line, secrets included, and $TMPDIR is often shared."""
    folder = Path(os.environ.get("TMPDIR") or "/tmp") / f"marin-hydra-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{folder} is not a folder of this user; remove it or set TMPDIR")
    if stat.S_IMODE(info.st_mode) != 0o700:
        folder.chmod(0o700)
    return str(folder)


def register() -> None:
    global _registered
    if _registered:
        return
    if not OmegaConf.has_resolver("marin.private_tmp"):
        OmegaConf.register_new_resolver("marin.private_tmp", private_tmp)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for path in sorted(SWEEPS_DIR.glob("*.yaml")):
        cs.store(group="sweep", name=path.stem, node=OmegaConf.load(path), package="_global_")
    _registered = True


def options(group: str) -> list[str]:
    """The selectable options of a group (its YAML files)."""
    folder = SWEEPS_DIR if group == "sweep" else CONF_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml"))
