"""A full disk during a checkpoint save is one line, naming the checkpoint, the folder and the
newest checkpoint a resume starts from, and a resume restores that one (issue 42's probe: 610
lines and 7 tracebacks: orbax's threads, the run log's handler, the ending's own writes, Hydra's)."""
import errno
import logging
from types import SimpleNamespace as NS

import jax.numpy as jnp
import numpy as np
import pytest

from marin.track.errors import disk_full
from marin.train.checkpoint import Checkpointer, DiskFull


def config():
    return NS(train=NS(steps=100, seed=7, checkpoint=NS(every_steps=1, keep_last=2, every_minutes=0.0,
                                                        permanent_every=0, async_save=True, permanent_steps=[])),
              schedule=NS(horizon_steps=None))


def state_at(step: int):
    return {"step": jnp.int32(step), "params": {"w": jnp.full((4, 3), float(step))}}

# what orbax's commit thread raises when tensorstore cannot write (the probe's run, on a full tmpfs)
ORBAX_FULL = ('RESOURCE_EXHAUSTED: Error writing "params.head.kernel/0.0" in OCDBT database at local file '
              '"…/checkpoints/2.orbax-checkpoint-tmp/": [OS error 28: No space left on device]')


def test_a_full_disk_during_a_save_is_one_error_and_resume_restores_the_one_before(tmp_path, monkeypatch, caplog):
    ckpt = Checkpointer(tmp_path, config())
    assert ckpt.save(1, state_at(1), {})
    ckpt.wait()
    real_wait = ckpt._manager.wait_until_finished

    def full():   # step 1's save (waited for by save(2)) went well; step 2's runs out of space
        real_wait()
        if ckpt._saving != 2 or ckpt._sealer is None:   # not orbax's own wait inside save(2)
            return
        logging.getLogger("absl").error("Save Finalize thread failed", exc_info=ValueError(ORBAX_FULL))
        raise ValueError(ORBAX_FULL)

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", full)
    with caplog.at_level(logging.WARNING):
        assert ckpt.save(2, state_at(2), {})   # its commit fails on the sealer thread
        with pytest.raises(DiskFull) as err:
            ckpt.wait()
    message = str(err.value)
    assert "\n" not in message and "no space left" in message.lower()
    assert "checkpoint 2" in message and str(ckpt.directory) in message and "checkpoint 1" in message
    assert not [r for r in caplog.records if r.name == "absl"]   # orbax's traceback: ours is the one line
    monkeypatch.undo()
    restored, meta = Checkpointer(tmp_path, config()).restore(state_at(0))
    assert meta["step"] == 1 and np.array_equal(restored["params"]["w"], state_at(1)["params"]["w"])


def test_disk_full_is_found_anywhere_in_the_chain():
    try:
        try:
            raise DiskFull("checkpoint 2 not saved: no space left on device")
        except DiskFull:
            raise OSError(errno.ENOSPC, "No space left on device")   # the ending's own write, after it
    except OSError as err:
        assert disk_full(err) == "checkpoint 2 not saved: no space left on device"
    assert disk_full(OSError(errno.ENOSPC, "No space left on device")).startswith("no space left on device")
    assert disk_full(ValueError(ORBAX_FULL)).startswith("no space left on device")
    assert disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory")) is None
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None


def test_the_run_log_stops_quietly_when_the_disk_is_full(tmp_path, capsys):
    from types import SimpleNamespace

    from marin.track import record

    handler = record.attach_log(SimpleNamespace(run_dir=tmp_path))
    try:
        class Full:
            def write(self, _):
                raise OSError(errno.ENOSPC, "No space left on device")

            def flush(self):
                pass
        handler.stream = Full()
        logging.getLogger("marin.test").warning("one")
        logging.getLogger("marin.test").warning("two")
    finally:
        logging.getLogger().removeHandler(handler)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert "run.log" in line and "no space left on device" in line
