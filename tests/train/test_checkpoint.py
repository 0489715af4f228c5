"""Checkpoints: round trip of a train-state-like tree, retention, atomicity, corrupt newest."""
import logging
from pathlib import Path
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marin.train.checkpoint import Checkpointer, NoCheckpointError, restore_from


def config(every=1, keep_last=2, permanent=0, async_save=True):
    return NS(train=NS(steps=100, seed=7, checkpoint=NS(every_steps=every, keep_last=keep_last,
                                                        permanent_every=permanent, async_save=async_save)),
              schedule=NS(horizon_steps=None))


def state_at(step: int):
    params = {"layers": {"moe": {"w_up": jnp.full((2, 4, 3, 5), float(step))}}, "head": {"kernel": jnp.ones((3, 7)) * step}}
    return {"step": jnp.int32(step), "params": params, "opt_state": optax.adam(1e-3).init(params),
            "router_state": jnp.arange(8.0).reshape(2, 4) * step, "rng": jax.random.key(step)}


def same(a, b) -> bool:
    def leaf(x):
        return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return all(np.array_equal(leaf(x), leaf(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_round_trip_keeps_state_and_meta(tmp_path):
    ckpt = Checkpointer(tmp_path, config())
    assert ckpt.latest_step() is None
    assert ckpt.save(3, state_at(3), {"mlflow_run_id": "abc123"})
    ckpt.wait()
    restored, meta = Checkpointer(tmp_path, config()).restore(state_at(0))
    assert same(restored, state_at(3))
    assert meta == {"step": 3, "data_position": 3, "horizon": 100, "rng_seed": 7, "mlflow_run_id": "abc123"}


def test_keeps_last_n_and_permanent_every_m(tmp_path):
    ckpt = Checkpointer(tmp_path, config(every=1, keep_last=2, permanent=4))
    for step in range(1, 11):
        ckpt.save(step, state_at(step), {})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 9, 10]


def test_only_forced_saves_without_a_period(tmp_path):
    ckpt = Checkpointer(tmp_path, config(every=0, permanent=0))
    assert not ckpt.save(5, state_at(5), {})
    assert ckpt.save(6, state_at(6), {}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [6]


def test_half_written_checkpoint_is_never_listed(tmp_path):
    ckpt = Checkpointer(tmp_path, config())
    ckpt.save(2, state_at(2), {})
    ckpt.wait()
    # What a save killed mid-write leaves behind: orbax's temporary directory, never renamed.
    tmp = Path(ckpt.directory) / "5.orbax-checkpoint-tmp"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "junk").write_bytes(b"\0" * 10)
    reopened = Checkpointer(tmp_path, config())
    assert reopened.latest_step() == 2
    assert same(reopened.restore(state_at(0))[0], state_at(2))


def _corrupt(step_dir: Path) -> None:
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"not a checkpoint")


def test_corrupt_newest_falls_back_with_a_warning(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path, config())
    for step in (1, 2):
        ckpt.save(step, state_at(step), {})
    ckpt.wait()
    _corrupt(Path(ckpt.directory) / "2")
    reopened = Checkpointer(tmp_path, config())
    with caplog.at_level(logging.WARNING, logger="marin.checkpoint"):
        restored, meta = reopened.restore(state_at(0))
    assert meta["step"] == 1 and same(restored, state_at(1))
    assert "unreadable" in caplog.text and "instead of the newest" in caplog.text
    # the bad one is set aside, so the resumed run can write step 2 again
    assert (Path(ckpt.directory) / "2.corrupt").is_dir() and reopened.latest_step() == 1
    assert reopened.save(2, state_at(2), {})
    reopened.wait()
    assert reopened.latest_step() == 2


def test_no_readable_checkpoint_is_an_error(tmp_path):
    ckpt = Checkpointer(tmp_path, config())
    ckpt.save(1, state_at(1), {})
    ckpt.wait()
    _corrupt(Path(ckpt.directory) / "1")
    with pytest.raises(NoCheckpointError):
        Checkpointer(tmp_path, config()).restore(state_at(0))


def test_restore_from_another_run(tmp_path):
    ckpt = Checkpointer(tmp_path / "stage1", config())
    ckpt.save(9, state_at(9), {"mlflow_run_id": "first"})
    ckpt.wait()
    restored, meta = restore_from(tmp_path / "stage1", state_at(0))
    assert same(restored, state_at(9)) and meta["mlflow_run_id"] == "first"
    with pytest.raises(NoCheckpointError):
        restore_from(tmp_path / "nowhere", state_at(0))
