"""Sweep points differing only in optimizer/schedule numbers compile one train step: the numbers
are inputs of the step (marin.optim.hparams), not constants baked into it."""
import logging

import jax
import pytest

from marin.optim import build_optimizer
from marin.train.state import init_state
from tests.helpers import make_config

TINY = ["model=micro", "train.seq_len=32", "train.global_batch=8", "train.eval_every=0", "train.eval_batches=1"]


def lowered_text(cfg):
    """The train step's program as the loop jits it, built afresh (no in-process memo)."""
    from marin.model.mesh import make_mesh
    from marin.train.state import state_sharding
    from marin.train.step import _jit_steps, hyperparams

    mesh = make_mesh(cfg)
    tx = build_optimizer(cfg)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    shardings = state_sharding(cfg, abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    rows = (cfg.train.global_batch, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(rows, d) for k, d in (("inputs", "int32"), ("targets", "int32"),
                                                           ("segment_ids", "int32"), ("loss_mask", "float32"))}
    train_step, _ = _jit_steps(cfg, tx, mesh, shardings)
    return train_step.lower(state, batch, hyperparams(cfg, mesh)).as_text()


def test_program_does_not_embed_optimizer_numbers():
    """The persistent compilation cache keys on this text: it must not change across points
    (lr, betas, eps, decay rule values, grad clip, warmup, steps, horizon)."""
    base = ["optim=muonh", "optim.grad_clip=1.0", "+optim.decay=[{pattern: adam, value: 0.02}]"]
    a = lowered_text(make_config(*TINY, *base, "train.steps=10"))
    b = lowered_text(make_config(*TINY, "optim=muonh", "optim.grad_clip=0.5", "optim.lr=7e-3", "optim.b1=0.8",
                                 "optim.b2=0.99", "optim.eps=1e-6", "optim.momentum=0.9", "schedule.warmup_frac=0.3",
                                 "schedule.final_ratio=0.2", "+optim.decay=[{pattern: adam, value: 0.05, start: 2}]",
                                 "train.steps=30", "schedule.horizon_steps=20"))
    assert a == b


@pytest.mark.slow
def test_three_point_lr_sweep_compiles_the_train_step_once(tmp_path, caplog):
    """Three runs of a learning-rate sweep in one process, through the loop: one compile of the
    train step, and the points still train differently (the in-process memo of
    marin.train.step.jit_steps). JAX logs "Compiling" when it lowers a function, before it looks
    in the persistent cache: the suite's shared cache serves the program and hides nothing."""
    from marin.train.loop import train
    from tests.train.test_loop import start

    losses = []
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        for i, lr in enumerate(("1e-3", "3e-3", "1e-2")):
            cfg, rec = start(tmp_path / str(i), "train.steps=3", "train.seq_len=32", f"optim.lr={lr}",
                             "train.eval_every=0")
            losses.append(train(cfg, rec)["loss"])
    compiles = [r.getMessage() for r in caplog.records
                if "train_step" in r.getMessage() and "Compiling" in r.getMessage()]
    assert len(compiles) == 1, compiles
    assert len(set(losses)) == 3, losses


def test_the_environments_cache_thresholds_win_over_marins(monkeypatch, tmp_path):
    """marin caches every compile (thresholds 0) unless the environment chose its own thresholds:
    the suite keeps its tiny eager programs out of the cache (tests/conftest.py)."""
    from marin.train.trainer import enable_compilation_cache

    cfg = make_config("model=micro", f"run.out_dir={tmp_path}")
    names = ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "4096")
        jax.config.update(names[0], 0.25)
        jax.config.update(names[1], 4096)
        enable_compilation_cache(cfg)
        assert (jax.config.jax_persistent_cache_min_compile_time_secs,
                jax.config.jax_persistent_cache_min_entry_size_bytes) == (0.25, 4096)
        monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
        monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
        enable_compilation_cache(cfg)
        assert (jax.config.jax_persistent_cache_min_compile_time_secs,
                jax.config.jax_persistent_cache_min_entry_size_bytes) == (0.0, 0)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_a_cache_folder_others_can_write_is_not_used(monkeypatch, tmp_path, caplog):
    """A compilation cache holds machine code this process would run: a folder that another user
    could have written to (world- or group-writable) is not used, and one
    log line says why (issue 42's probe: such a folder was loaded silently)."""
    from marin.train.trainer import enable_compilation_cache

    shared = tmp_path / "shared-cache"
    shared.mkdir()
    shared.chmod(0o777)
    cfg = make_config("model=micro", f"run.out_dir={tmp_path}")
    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("MARIN_JAX_CACHE", str(shared))
        with caplog.at_level(logging.WARNING):
            enable_compilation_cache(cfg)
        assert jax.config.jax_compilation_cache_dir != str(shared)
        assert [r for r in caplog.records if str(shared) in r.getMessage() and "0o777" in r.getMessage()]
        shared.chmod(0o755)   # the owner's alone: used
        enable_compilation_cache(cfg)
        assert jax.config.jax_compilation_cache_dir == str(shared)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
