"""Every key a config can have, read from the schema dataclasses, and the nearest ones to a typo.

Hydra answers an unknown key (`train.step=50`, `modle=tiny`) with advice to add it with `+`,
which validation then refuses: `nearest` gives the names the user most likely meant instead.
No JAX.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Optional

from omegaconf import OmegaConf

from marin.config.paths import CONF_DIR
from marin.config.schema import Config

OPEN = object()  # a node that takes any key below it (a dict, `Any`)


@functools.lru_cache(maxsize=None)
def root_groups() -> tuple[str, ...]:
    """The groups in conf/config.yaml's defaults list (`experiment`, `sweep`, `local`, the typed
    ones), selectable with `group=option` although only some are fields of `Config`."""
    names = []
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            key = next(iter(entry)).removeprefix("optional ")
            if not key.startswith("override "):
                names.append(key)
    return tuple(names)


def _unwrap(kind) -> Any:
    """The type a field's value is walked as: Optional[X] is X, a list its element, a dict OPEN."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        return _unwrap(next(a for a in args if a is not type(None)))
    if origin in (dict, typing.Dict) or kind is Any:
        return OPEN
    return kind


@functools.lru_cache(maxsize=None)
def _fields(cls) -> dict[str, Any]:
    return {name: _unwrap(kind) for name, kind in typing.get_type_hints(cls).items()
            if name in {f.name for f in dataclasses.fields(cls)}}


def _children(node) -> Optional[list[str]]:
    """The keys below `node` (None: a leaf, or open to any key)."""
    if node is Config:
        return list(_fields(Config)) + [g for g in root_groups() if g not in _fields(Config)]
    return list(_fields(node)) if dataclasses.is_dataclass(node) else None


def _child(node, key: str):
    """The node at `key` below `node`; None: no such key; OPEN: anything goes from here."""
    if node is OPEN:
        return OPEN
    if typing.get_origin(node) in (list, typing.List):  # an index, then the element's type
        return _unwrap(typing.get_args(node)[0]) if key.isdigit() else None
    if node is Config and key in root_groups() and key not in _fields(Config):
        return OPEN  # experiment, sweep, local: options merged at the root, checked when composed
    if dataclasses.is_dataclass(node):
        return _fields(node).get(key)
    return None  # below a leaf


def is_mapping(key: str) -> bool:
    """Whether `key` is a dict field of the schema (`hardware.env`): it takes keys of the user's own."""
    *parents, last = key.split(".")
    node: Any = Config
    for part in parents:
        node = _child(node, part)
    if not dataclasses.is_dataclass(node):
        return False
    kind = typing.get_type_hints(node).get(last)
    if typing.get_origin(kind) is typing.Union:  # Optional[Dict[...]]
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return typing.get_origin(kind) in (dict, typing.Dict)


def unknown_at(key: str) -> Optional[int]:
    """The index of the first dotted part of `key` the schema does not have (None: all known)."""
    node: Any = Config
    for i, part in enumerate(key.split(".")):
        node = _child(node, part)
        if node is None:
            return i
        if node is OPEN:
            return None
    return None


def _all_keys(node=Config, prefix: str = "") -> list[str]:
    keys = []
    for name in _children(node) or ():
        child = _child(node, name)
        keys.append(prefix + name)
        if child is not OPEN and _children(child):
            keys += _all_keys(child, f"{prefix}{name}.")
    return keys


def nearest(key: str) -> tuple[list[str], list[str]]:
    """(the valid keys closest to the unknown `key`, the valid names where it went wrong).

    The misspelt part is matched against its siblings, the rest of the key kept when it fits
    (`trian.steps` → `train.steps`). A key unknown from its first part may be a field typed
    without its group: keys ending in the same name come first (`steps` → `train.steps`), and
    failing any match, the whole key against every key (`seqlen` → `train.seq_len`)."""
    parts = key.split(".")
    at = unknown_at(key)
    if at is None:
        return [], []
    node: Any = Config
    for part in parts[:at]:
        node = _child(node, part)
    siblings = _children(node) or []
    guesses = [k for k in _all_keys() if k.rsplit(".", 1)[-1] == parts[-1]] if at == 0 else []
    for name in difflib.get_close_matches(parts[at], siblings, n=3):
        whole = ".".join(parts[:at] + [name] + parts[at + 1:])
        guesses.append(whole if unknown_at(whole) is None else ".".join(parts[:at] + [name]))
    if not guesses and at == 0:
        guesses = difflib.get_close_matches(key, _all_keys(), n=3)
    return list(dict.fromkeys(guesses))[:3], siblings


def unknown_key_message(key: str) -> str:
    """What a user is told about the unknown `key`: the nearest names, or what is allowed there."""
    guesses, siblings = nearest(key)
    if guesses:
        return f"did you mean {' / '.join(guesses)}?"
    where = ".".join(key.split(".")[:unknown_at(key) or 0]) or "the config"
    if not siblings:  # below a leaf: hardware.xla_flags.foo
        return f"{where} is one value, with no keys below it ({where}=<value>)"
    return f"{where} has {', '.join(siblings)}"
