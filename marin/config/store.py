"""Registers the root schema (and the named sweeps) in Hydra's ConfigStore.

``conf/config.yaml`` starts its defaults list with ``schema`` (the `Config` dataclass, stored at
the root, where Hydra lists no options), so every group option is merged into a typed node:
unknown keys and wrong types fail at compose time, also for option files found through
``--config-dir``. The group schemas are not stored as group options: an option named ``schema``
would show in ``--help``, tab completion and ``glob(*)`` and compose as the defaults. The files in
``sweeps/`` are stored as the ``sweep`` group (package ``_global_``), which is how
``sweep=<name>`` finds them; ``sweep/`` and ``experiment/`` files in a user's folder
(``--config-dir``, the site folder) get the same package from ``hydra_plugins/marin_groups``. The
resolver ``marin.sweep_folder`` gives Hydra's sweep folder, where nothing is written.

An option file does not repeat its own name: ``conf/config.yaml`` leaves each group's ``name``
missing and `name_options` fills it with the option Hydra chose (an experiment may set its own, as
the ladder names its models). `compose` composes as ``launch.py`` does, names included.
"""
from __future__ import annotations

import os
import re
import shlex
import stat
import sys
from pathlib import Path
from typing import NoReturn

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from marin.config.paths import CONF_DIR, SWEEPS_DIR
from marin.config.schema import GROUPS, Config

_registered = False


def override_key(override: str) -> str:
    """The key a command-line override sets: `+a.b=1`, `~a.b` and `a.b=1` all set `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def last_per_key(overrides: list[str]) -> list[str]:
    """Later overrides of a key replace earlier ones, in the place of the last: a saved run's
    `optim.lr=0.001` and this command line's `optim.lr=0.1` are one override, the new one."""
    out: dict[str, str] = {}
    for o in overrides:
        out.pop(override_key(o), None)
        out[override_key(o)] = o
    return list(out.values())


def override_value(override: str) -> str:
    """The value an override sets, as Hydra reads it: `run.out_dir='/a=b'` sets `/a=b`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return str(OverridesParser.create().parse_override(override).value())
    except Exception:  # noqa: BLE001 (not Hydra's grammar: Hydra refuses it where it composes)
        return override.split("=", 1)[-1]


def override(key: str, value) -> str:
    """`key=value` as one command-line override that Hydra reads back as exactly this string:
    as it is where Hydra's parser reads it so (`fork=mochi-launch@81716`), else quoted. Hydra's
    grammar refuses an unquoted `=` (a sweep job's name and directory, `grid-lr=0.001-…`), reads a
    `,` as a sweep, brackets, spaces and quotes as syntax and a hex id such as 99e73426 as a
    number. Inside the quotes a quote is escaped, and so are the backslashes before one or at the
    end (Hydra reads two there as one). For a shell, `shell_join` quotes the override again."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = str(value)
    try:
        if OverridesParser.create().parse_override(f"{key}={value}").value() == value:
            return f"{key}={value}"
    except Exception:  # noqa: BLE001 (Hydra's grammar error: quoted below)
        pass
    text = re.sub(r"(\\*)'", lambda m: m[1] * 2 + "\\'", value)
    text = re.sub(r"(\\+)$", lambda m: m[1] * 2, text)
    return f"{key}='{text}'"


def shell_join(args: list[str]) -> str:
    """A command line to print for a shell (shlex's quoting), an override quoted for Hydra in
    double quotes where they need no escape: `"reproduce='grid/lr=0.001'"`, which reads better
    than shlex's `'reproduce='"'"'grid/lr=0.001'"'"''` and means the same."""
    return " ".join(f'"{a}"' if "'" in a and not re.search(r'["$`\\!]', a) else shlex.quote(a) for a in args)


def sweep_folder() -> str:
    """Hydra's sweep folder: `sweep-<pid>` in `private_tmp`, where the ``multirun.yaml`` that
    Hydra's sweeper saves before any job runs (the whole command line, secret overrides included)
    is a link to /dev/null made beforehand. Nothing is written, so a sweep killed in its first
    second leaves no copy of a secret (marin writes each sweep's record itself, masked:
    marin.track.sweep). The launcher removes the folder (marin.launch.multirun.discard_sweep_file).
    Named by the process, so every resolution of ``hydra.sweep.dir`` gives the same folder."""
    folder = Path(private_tmp()) / f"sweep-{os.getpid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    saved = folder / "multirun.yaml"
    if not (saved.is_symlink() and os.readlink(saved) == os.devnull):
        saved.unlink(missing_ok=True)   # a folder a killed process of the same pid left
        saved.symlink_to(os.devnull)
    return str(folder)


def private_tmp() -> str:
    """$TMPDIR/marin-hydra-<uid>, made (or fixed to) mode 0700, as $TMPDIR is often shared: the
    parent of `sweep_folder`. Anything else at that path (a symlink someone
    planted, another user's folder, a file) stops the command with one line, exit 2: this runs
    as a Hydra resolver, where an exception would become a page of traceback."""
    folder = Path(os.environ.get("TMPDIR") or "/tmp") / f"marin-hydra-{os.getuid()}"
    try:
        if not os.path.lexists(folder):
            folder.mkdir(mode=0o700, parents=True)
        info = folder.lstat()
    except OSError as err:
        _refuse(f"cannot make {folder} ({err.strerror}); set TMPDIR to a folder of yours")
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        what = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a folder of this user"
        _refuse(f"{folder} is {what}; remove it, or set TMPDIR to a folder of yours")
    if stat.S_IMODE(info.st_mode) != 0o700:
        folder.chmod(0o700)
    return str(folder)


def _refuse(why: str) -> NoReturn:
    # marin.cli.fail's format; SystemExit passes through OmegaConf's and Hydra's error handling
    print(f"error: hydra.sweep.dir: {why}", file=sys.stderr)
    raise SystemExit(2)


def register() -> None:
    global _registered
    if _registered:
        return
    if not OmegaConf.has_resolver("marin.sweep_folder"):
        OmegaConf.register_new_resolver("marin.sweep_folder", sweep_folder)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for path in sorted(SWEEPS_DIR.glob("*.yaml")):
        cs.store(group="sweep", name=path.stem, node=OmegaConf.load(path), package="_global_")
    _registered = True


def options(group: str) -> list[str]:
    """The selectable options of a group (its YAML files)."""
    folder = SWEEPS_DIR if group == "sweep" else CONF_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def name_options(cfg: DictConfig, choices) -> DictConfig:
    """`cfg` with each group's missing `name` set to the option chosen for it (`choices`: Hydra's
    ``hydra.runtime.choices``, group -> option)."""
    for group in GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig) and OmegaConf.is_missing(node, "name") and choices.get(group):
            node.name = choices[group]
    return cfg


def compose(overrides) -> DictConfig:
    """The config of these command-line overrides, composed as ``launch.py`` composes it, in or
    outside a running Hydra app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()

    def composed() -> DictConfig:
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
        choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]
        return name_options(cfg, choices)

    if GlobalHydra.instance().is_initialized():  # inside launch.py's @hydra.main: its search path
        return composed()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return composed()
