"""Registries of the `kind:` dispatches: routers, expert transports, attention kernels, schedules.

Code registers an implementation under its name (`@ROUTERS.register("qb")` on a class in
`marin/model/routers.py`); the schema's field takes its allowed values from the registry
(`choices=ROUTERS.names`), so validation reads them without importing the code (and JAX): a
registry's names are those its config group's option files declare (`conf/router/*.yaml`'s
`kind:`), those it was created with, and those registered in this process. Adding a router is
its YAML and its registered class, nothing else. Pure Python: no JAX.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import yaml

from marin.config.paths import CONF_DIR


@lru_cache(maxsize=None)
def _declared_by_options(group: str, key: str) -> tuple[str, ...]:

    names = []
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        names.append(str(doc.get(key, path.stem)))
    return tuple(dict.fromkeys(names))


class Registry:
    """Implementations of one config field (`field`), by name."""

    def __init__(self, field: str, builtin: tuple[str, ...] = (), group: str | None = None, key: str = "name"):
        self.field, self._builtin, self._group, self._key = field, builtin, group, key
        self._impls: dict[str, Any] = {}

    def register(self, name: str) -> Callable:
        """Decorator: `@REGISTRY.register("name")` on a class (registered as an instance) or function."""
        def add(impl):
            self._impls[name] = impl() if isinstance(impl, type) else impl
            return impl
        return add

    def names(self) -> tuple[str, ...]:
        declared = _declared_by_options(self._group, self._key) if self._group else ()
        return tuple(dict.fromkeys((*self._builtin, *declared, *self._impls)))

    def get(self, name: str):
        try:
            return self._impls[name]
        except KeyError:
            raise ValueError(f"{self.field}: no code is registered for {name!r} "
                             f"(registered: {', '.join(self._impls)})") from None


ROUTERS = Registry("router.kind", group="router", key="kind")               # marin/model/routers.py
TRANSPORTS = Registry("model.ep_transport", builtin=("fixed", "pooled", "ragged"))  # marin/model/dispatch.py
ATTENTION = Registry("attention.impl", builtin=("blockwise", "cudnn", "reference"))  # marin/model/attention.py
SCHEDULES = Registry("schedule.name", group="schedule")                     # marin/optim/schedule.py
