"""Compiled steps kept across processes: a warm run does not trace its steps again.

JAX's persistent compilation cache skips XLA's compile, but every process still traces the model
and lowers it to find that cache's key: 1.4 s of a warm 5-step `model=tiny` run (the train step
and the eval step), far more for a deep model. This keeps the compiled executables themselves
(`jax.experimental.serialize_executable`), beside JAX's cache, under a key made of everything
that decides the program:

- the step's name and the config as the steps are traced from it (`marin.optim.hparams.
  structure_key`: optimizer numbers are inputs, so sweep points share one entry);
- the sha256 of every source file the steps are traced from (`PROGRAM_SOURCES`: the model, the
  optimizer, the config, the mesh, the step and state modules; tests/train/test_executables.py
  checks that they import nothing else of the package), so editing any of them is a new key;
- the versions of jax, jaxlib, flax, optax and numpy, every `jax.config` value and `XLA_FLAGS`;
- the backend, its devices, and the arguments' tree, shapes, dtypes and shardings.

A miss, or an entry that does not load, compiles and keeps the result (written to a temporary
file, then renamed: a reader never sees half of one). That compile bypasses JAX's persistent cache
and is kept only if XLA really compiled it: on CPU, an executable that JAX's cache loaded does not
serialize whole (its copy fails to run: "Function … not found"). So the first run of a program
after a change to those sources compiles for real, once. Single-process runs only: a multi-process
executable would have to be loaded on every process at once.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
from pathlib import Path

log = logging.getLogger("marin.train")

VERSION = "marin-executables-2"  # 1: kept copies of persistent-cache hits (broken on CPU)
PACKAGE = Path(__file__).resolve().parents[1]  # marin/
# What the train and eval steps are traced from (folders and files under marin/).
PROGRAM_SOURCES = ("model", "optim", "config", "launch/mesh.py", "train/step.py", "train/state.py",
                   "train/executables.py")


class Cached:
    """`jitted`, called through a compiled executable that is loaded from the cache when it can
    be (and compiled and kept there when not), at its first call."""

    def __init__(self, name: str, jitted, structure: str):
        self.name, self.jitted, self.structure = name, jitted, structure
        self._compiled = None

    def __call__(self, *args):
        if self._compiled is None:
            self._compiled = compiled(self.name, self.jitted, self.structure, args)
        return self._compiled(*args)


def compiled(name: str, jitted, structure: str, args):
    """The compiled executable of `jitted` for `args`: from the cache, else compiled and kept."""
    import jax

    if jax.process_count() > 1:
        return jitted
    path = cache_dir() / f"{name}-{key(name, structure, args)[:40]}.pkl"
    if path.is_file():
        try:
            return _load(path)
        except Exception as err:  # noqa: BLE001 — a stale or damaged entry is compiled again
            log.warning("compiled %s in %s does not load (%s: %s); compiling it again",
                        name, path.parent, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            path.unlink(missing_ok=True)  # a cache entry (not the user's data): replaced when kept again
    made, fresh = _compile_fresh(jitted, args)
    if fresh:
        try:
            _keep(path, made)
        except Exception as err:  # noqa: BLE001 — the run goes on without a cache entry
            log.debug("compiled %s not kept (%s)", name, err)
    return made


_seen = {"compiles": 0, "cache_hits": 0}  # backend compiles and persistent-cache hits in this process
_listening = []  # the listeners above, once registered


def _on_duration(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _seen["compiles"] += 1


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _seen["cache_hits"] += 1


def _compile_fresh(jitted, args):
    """(compiled, whether XLA compiled it just now). JAX's persistent cache is switched off for
    this compile (`reset_cache` makes JAX look at the switch again); no backend compile at all
    means JAX's in-memory cache answered with an executable of unknown origin (not kept)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listening.append(True)
    before = dict(_seen)
    enabled = jax.config.values.get("jax_enable_compilation_cache", True)
    quiet = logging.getLogger("jax._src.compilation_cache")
    level, quiet.level = quiet.level, logging.WARNING  # reset_cache says so at INFO
    try:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        made = jitted.lower(*args).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()
        quiet.level = level
    fresh = _seen["compiles"] > before["compiles"] and _seen["cache_hits"] == before["cache_hits"]
    return made, fresh


def cache_dir() -> Path:
    """Beside JAX's persistent compilation cache (marin.train.loop.enable_compilation_cache)."""
    import jax

    from marin.config.store import project_path

    base = jax.config.values.get("jax_compilation_cache_dir") or os.environ.get("MARIN_JAX_CACHE")
    return Path(base) / "executables" if base else project_path("outputs/cache/jax/executables")


def key(name: str, structure: str, args) -> str:
    import jax

    leaves, tree = jax.tree.flatten(args)
    parts = [VERSION, name, structure, source_digest(), _versions(), os.environ.get("XLA_FLAGS", ""),
             sorted((k, repr(v)) for k, v in jax.config.values.items()),
             jax.default_backend(), [(d.id, d.device_kind) for d in jax.devices()],
             repr(tree), [(leaf.shape, str(leaf.dtype), repr(getattr(leaf, "sharding", None))) for leaf in leaves]]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def program_files() -> list[Path]:
    files = []
    for name in PROGRAM_SOURCES:
        path = PACKAGE / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the path and bytes of every file in PROGRAM_SOURCES."""
    digest = hashlib.sha256()
    for path in program_files():
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            found.append((package, version(package)))
        except PackageNotFoundError:
            found.append((package, None))
    return repr(found)


def _load(path: Path):
    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = pickle.loads(path.read_bytes())
    return deserialize_and_load(payload, in_tree, out_tree)


def _keep(path: Path, made) -> None:
    from jax.experimental.serialize_executable import serialize

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps(serialize(made), protocol=pickle.HIGHEST_PROTOCOL))
    tmp.replace(path)
