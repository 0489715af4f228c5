"""Checkpoints: round trip of a train-state-like tree, retention, atomicity, corrupt newest,
per-process content manifests (a missing one refuses the checkpoint, never renames it), structure
checks that never rename, the rolling (time) cadence. The manifests across processes: test_manifest.py."""
import hashlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marin.train import manifest
from marin.train.checkpoint import Checkpointer, NoCheckpointError, StructureMismatch, check_structure, listed_steps, restore_from


def config(every=1, keep_last=2, permanent=0, async_save=True, minutes=0.0, steps=()):
    return NS(train=NS(steps=100, seed=7, checkpoint=NS(every_steps=every, keep_last=keep_last, every_minutes=minutes,
                                                        permanent_every=permanent, async_save=async_save,
                                                        permanent_steps=list(steps))),
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
    assert meta == {"step": 3, "data_position": 3, "horizon": 100, "rng_seed": 7, "mlflow_run_id": "abc123",
                    "manifests": 1}


def test_keeps_last_n_and_permanent_every_m(tmp_path):
    ckpt = Checkpointer(tmp_path, config(every=1, keep_last=2, permanent=4))
    for step in range(1, 11):
        ckpt.save(step, state_at(step), {})
    ckpt.wait()
    assert listed_steps(ckpt.directory) == [4, 8, 9, 10]


def test_permanent_steps_are_written_and_kept_past_keep_last(tmp_path):
    """The hero's retention (spec §9): one rolling checkpoint and a one-off permanent one."""
    ckpt = Checkpointer(tmp_path, config(every=2, keep_last=1, steps=[5]))
    for step in range(1, 11):
        ckpt.save(step, state_at(step), {})
    ckpt.wait()
    assert listed_steps(ckpt.directory) == [5, 8, 10]   # 8: the newest sealed while 10 was written


def test_a_permanent_checkpoint_outlives_a_changed_cadence(tmp_path):
    """Written as permanent (permanent_every 4), kept by a resumed run whose config has none."""
    first = Checkpointer(tmp_path, config(every=1, keep_last=1, permanent=4))
    for step in range(1, 6):
        first.save(step, state_at(step), {})
    first.wait()
    assert listed_steps(first.directory) == [4, 5]
    again = Checkpointer(tmp_path, config(every=1, keep_last=1, permanent=0))
    for step in range(6, 10):
        again.save(step, state_at(step), {})
    again.wait()
    assert listed_steps(again.directory) == [4, 8, 9]   # 8: the newest sealed while 9 was written


def test_only_forced_saves_without_a_period(tmp_path):
    ckpt = Checkpointer(tmp_path, config(every=0, permanent=0))
    assert not ckpt.save(5, state_at(5), {})
    assert ckpt.save(6, state_at(6), {}, force=True)
    ckpt.wait()
    assert listed_steps(ckpt.directory) == [6]


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
    assert "damaged" in caplog.text and "instead of the newest" in caplog.text
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


def _data_files(step_dir: Path) -> list[Path]:
    return sorted(f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d")


@pytest.mark.parametrize("async_save", [True, False])
def test_every_checkpoint_has_a_manifest_when_listed(tmp_path, async_save):
    ckpt = Checkpointer(tmp_path, config(async_save=async_save))
    ckpt.save(1, state_at(1), {})
    ckpt.wait()
    files = json.loads((Path(ckpt.directory) / "1" / manifest.name(0)).read_text())["files"]
    assert any(name.startswith("state/ocdbt.process_0/") for name in files) and "meta/metadata" in files


def test_a_single_flipped_bit_is_detected_and_set_aside(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path, config())
    for step in (1, 2):
        ckpt.save(step, state_at(step), {})
    ckpt.wait()
    victim = _flip_a_bit(Path(ckpt.directory) / "2")
    with caplog.at_level(logging.WARNING, logger="marin.checkpoint"):
        restored, meta = Checkpointer(tmp_path, config()).restore(state_at(0))
    assert meta["step"] == 1 and same(restored, state_at(1))
    assert "does not match its sha256" in caplog.text
    assert (Path(ckpt.directory) / "2.corrupt" / victim.relative_to(Path(ckpt.directory) / "2")).is_file()  # kept


def test_a_different_structure_never_renames_a_checkpoint(tmp_path):
    ckpt = Checkpointer(tmp_path, config())
    ckpt.save(1, state_at(1), {})
    ckpt.wait()
    other = state_at(0)
    other["params"]["layers"]["moe"]["w_up"] = jnp.zeros((2, 8, 3, 5))   # num_experts 4 → 8
    other["opt_state"] = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(other["params"])
    with pytest.raises(StructureMismatch, match=r"params\.layers\.moe\.w_up: \(2, 4, 3, 5\) float32 → \(2, 8, 3, 5\)"):
        check_structure(tmp_path, jax.eval_shape(lambda: other))
    with pytest.raises(StructureMismatch):
        Checkpointer(tmp_path, config()).restore(other)
    assert sorted(p.name for p in Path(ckpt.directory).iterdir()) == ["1"]
    check_structure(tmp_path, jax.eval_shape(lambda: state_at(0)))  # the same structure passes


def _flip_a_bit(step_dir: Path) -> Path:
    victim = max(_data_files(step_dir), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    return victim


def _as_before_manifests(step_dir: Path) -> None:
    """What a checkpoint from before manifests looks like: none, and a meta that records none."""
    (step_dir / manifest.name(0)).unlink()
    meta = step_dir / "meta" / "metadata"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "manifests"}))


def test_checkpoint_from_before_manifests_restores_unverified(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path, config())
    ckpt.save(1, state_at(1), {})
    ckpt.wait()
    _as_before_manifests(Path(ckpt.directory) / "1")
    assert listed_steps(ckpt.directory) == [1]
    with caplog.at_level(logging.WARNING, logger="marin.checkpoint"):
        restored, _ = Checkpointer(tmp_path, config()).restore(state_at(0))
    assert same(restored, state_at(1)) and "restored unverified" in caplog.text


def test_a_deleted_manifest_and_a_flipped_bit_fall_back_and_rename_nothing(tmp_path, caplog):
    """Issue 20: the checkpoint says it was sealed; without its manifest it is not restored (the
    one before is), and it stays where it is under its own name."""
    ckpt = Checkpointer(tmp_path, config())
    for step in (1, 2):
        ckpt.save(step, state_at(step), {})
    ckpt.wait()
    newest = Path(ckpt.directory) / "2"
    (newest / manifest.name(0)).unlink()
    _flip_a_bit(newest)
    assert listed_steps(ckpt.directory) == [1]   # what init_from and verify see
    with caplog.at_level(logging.WARNING, logger="marin.checkpoint"):
        restored, meta = Checkpointer(tmp_path, config()).restore(state_at(0))
    assert meta["step"] == 1 and same(restored, state_at(1))
    assert "lacks manifest.0.json" in caplog.text and "left in place" in caplog.text
    assert "unverified" not in caplog.text and "before manifests" not in caplog.text
    assert sorted(p.name for p in Path(ckpt.directory).iterdir()) == ["1", "2"]


def test_a_run_whose_only_checkpoint_never_sealed_starts_again_and_leaves_it_in_place(tmp_path, caplog):
    """A task killed between orbax's commit and the manifests (a Slurm restart's common case):
    that checkpoint is no verified one, so the restarted run starts from step 0 (None), with a
    warning, and never restores or renames it; init_from of that step is refused."""
    ckpt = Checkpointer(tmp_path, config())
    ckpt.save(1, state_at(1), {})
    ckpt.wait()
    (Path(ckpt.directory) / "1" / manifest.name(0)).unlink()
    with caplog.at_level(logging.WARNING, logger="marin.checkpoint"):
        assert Checkpointer(tmp_path, config()).restore(state_at(0)) is None
    assert "a manifest missing, left in place: 1" in caplog.text and "starting from step 0" in caplog.text
    assert sorted(p.name for p in Path(ckpt.directory).iterdir()) == ["1"]
    with pytest.raises(NoCheckpointError):
        restore_from(tmp_path, state_at(0))   # init_from refuses it


def test_a_checkpoint_of_the_previous_version_is_still_verified(tmp_path, caplog):
    """Process 0's single `marin_manifest.json` (whole-file sha256) still catches a flipped bit."""
    ckpt = Checkpointer(tmp_path, config())
    ckpt.save(1, state_at(1), {})
    ckpt.wait()
    step_dir = Path(ckpt.directory) / "1"
    names = json.loads((step_dir / manifest.name(0)).read_text())["files"]
    _as_before_manifests(step_dir)
    legacy = {n: hashlib.sha256((step_dir / n).read_bytes()).hexdigest() for n in names}
    (step_dir / manifest.LEGACY).write_text(json.dumps({"algorithm": "sha256", "files": legacy}))
    assert same(Checkpointer(tmp_path, config()).restore(state_at(0))[0], state_at(1))
    _flip_a_bit(step_dir)
    with caplog.at_level(logging.WARNING, logger="marin.checkpoint"), pytest.raises(NoCheckpointError):
        Checkpointer(tmp_path, config()).restore(state_at(0))
    assert "does not match its sha256" in caplog.text and (Path(ckpt.directory) / "1.corrupt").is_dir()


def test_retention_keeps_the_newest_sealed_checkpoint_until_the_next_is_sealed(tmp_path):
    ckpt = Checkpointer(tmp_path, config(keep_last=1))
    ckpt.save(1, state_at(1), {})
    ckpt.save(2, state_at(2), {})    # step 1 is sealed by now: kept while step 2 is hashed
    ckpt.wait()
    assert listed_steps(ckpt.directory) == [1, 2]
    ckpt.save(3, state_at(3), {})    # step 2 sealed: step 1 may go
    ckpt.wait()
    assert listed_steps(ckpt.directory) == [2, 3] and ckpt.newest_sealed == 2


def test_rolling_checkpoint_is_due_by_the_clock(tmp_path):
    now = [0.0]
    ckpt = Checkpointer(tmp_path, config(every=0, minutes=60), clock=lambda: now[0])
    assert not ckpt.time_due()
    now[0] = 3599.0
    assert not ckpt.time_due()
    now[0] = 3600.0
    assert ckpt.time_due()
    ckpt.save(7, state_at(7), {}, force=True)
    assert not ckpt.time_due()                       # the hour counts from the last save
    ckpt.wait()
    assert not Checkpointer(tmp_path, config(every=0, minutes=0), clock=lambda: 1e9).time_due()  # 0 = off
