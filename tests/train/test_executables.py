"""The executables cache (marin.train.executables): a step loaded from it computes exactly what
the jitted step computes; anything that changes the program changes the key; a damaged entry
is compiled again."""
import ast
import logging

import jax
import numpy as np
import pytest

from marin.launch.mesh import make_mesh
from marin.optim import build_optimizer
from marin.optim.hparams import structure_key
from marin.train import executables
from marin.train.state import batch_sharding, init_sharded
from marin.train.step import _jit_steps
from tests.helpers import make_config

TINY = ["model=tiny", "train.seq_len=32", "train.global_batch=8", "train.eval_batches=1"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(executables, "cache_dir", lambda: tmp_path / "executables")
    return tmp_path / "executables"


def setup(*overrides):
    cfg = make_config(*TINY, *overrides)
    mesh, tx = make_mesh(cfg), build_optimizer(cfg)
    state, shardings = init_sharded(cfg, tx, mesh, cfg.train.seed)
    rows = (cfg.train.global_batch, cfg.train.seq_len)
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(0, 200, rows, dtype=np.int32), "targets": rng.integers(0, 200, rows, dtype=np.int32),
             "segment_ids": np.ones(rows, np.int32), "loss_mask": np.ones(rows, np.float32)}
    batch = {k: jax.make_array_from_process_local_data(batch_sharding(mesh), v) for k, v in batch.items()}
    return cfg, state, batch, _jit_steps(cfg, tx, mesh, shardings)  # fresh jitted steps, no in-process memo


def small_step():
    """A jitted step small enough to serialize the same way every time (the model's steps are
    kept the same way by the loop: benchmarks/startup.py)."""
    step = jax.jit(lambda w, x: {"loss": jax.numpy.tanh(x @ w).mean(), "w": w * 0.5}, donate_argnums=0)
    return step, (lambda: jax.numpy.ones((16, 4))), jax.numpy.arange(32.0).reshape(2, 16) / 32


def test_a_loaded_step_computes_what_the_jitted_step_computes(cache):
    step, weights, x = small_step()
    first = executables.Cached("small", step, "structure")
    got = jax.device_get(first(weights(), x))
    assert len(list(cache.glob("small-*.pkl"))) == 1  # kept
    expected = jax.device_get(step(weights(), x))
    assert jax.tree.map(np.array_equal, got, expected) == {"loss": True, "w": True}
    again = executables.Cached("small", step, "structure")  # as a new process would
    w = weights()
    assert jax.tree.map(np.array_equal, jax.device_get(again(w, x)), expected) == {"loss": True, "w": True}
    assert w.is_deleted()  # the loaded executable donates as the jitted step does


def test_the_key_follows_the_program(monkeypatch):
    cfg, state, batch, _ = setup()
    base = executables.key("eval_step", structure_key(cfg), (state, batch))
    assert base == executables.key("eval_step", structure_key(make_config(*TINY, "optim.lr=0.5")), (state, batch))
    assert base != executables.key("train_step", structure_key(cfg), (state, batch))
    assert base != executables.key("eval_step", structure_key(make_config(*TINY, "model.d_model=32")), (state, batch))
    wider = dict(batch, inputs=jax.numpy.zeros((8, 64), jax.numpy.int32))
    assert base != executables.key("eval_step", structure_key(cfg), (state, wider))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert base != executables.key("eval_step", structure_key(cfg), (state, batch))
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(executables, "source_digest", lambda: "another version of the code")
    assert base != executables.key("eval_step", structure_key(cfg), (state, batch))


def test_a_damaged_entry_is_compiled_again(cache, caplog):
    step, weights, x = small_step()
    executables.Cached("small", step, "structure")(weights(), x)
    (entry,) = cache.glob("small-*.pkl")
    expected = jax.device_get(step(weights(), x))
    entry.write_bytes(entry.read_bytes()[:100])  # cut short
    with caplog.at_level(logging.WARNING, logger="marin.train"):
        got = jax.device_get(executables.Cached("small", step, "structure")(weights(), x))
    assert jax.tree.map(np.array_equal, got, expected) == {"loss": True, "w": True}
    assert "does not load" in caplog.text
    # Dropped, or written again whole (a fresh compile is kept; this process's in-memory copy is not).
    assert not entry.exists() or executables._load(entry) is not None


def test_the_steps_are_traced_from_the_hashed_sources_only():
    """The key hashes PROGRAM_SOURCES only: every module of the package that the step, state and
    mesh modules import (transitively) must be one of them, or a change to it would load a stale
    step."""
    package = executables.PACKAGE
    hashed = set(executables.program_files())

    def module_file(name):
        path = package.parent / name.replace(".", "/")
        return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")

    todo = [package / "train" / "step.py", package / "train" / "state.py", package / "launch" / "mesh.py"]
    seen, outside = set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path not in hashed:
            outside.add(path.relative_to(package).as_posix())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("marin"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("marin")]
            else:
                continue
            todo += [f for f in map(module_file, names) if f.is_file()]
    assert not outside, sorted(outside)
