"""Cheap stand-ins for the training loop inside Slurm tasks (MARIN_SLURM_ENTRY=module:function):
they exercise the launch path — environment, distributed init, mesh, sharding — in seconds."""
import json
import os


def probe(cfg, rec):
    """Each process writes what it sees to <run_dir>/probe-<process>.json."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state, state_sharding

    mesh = make_mesh(cfg)
    tx = build_optimizer(cfg)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    shardings = state_sharding(cfg, abstract, mesh)
    w_up = abstract.params["layers"]["moe"]["w_up"]
    local_shape = shardings.params["layers"]["moe"]["w_up"].shard_shape(w_up.shape)
    total = multihost_utils.process_allgather(np.array([jax.process_index()]))  # a real collective
    seen = {
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
        "mesh": dict(mesh.shape), "experts": int(w_up.shape[1]), "experts_here": int(local_shape[1]),
        "gathered": [int(x) for x in np.ravel(total)],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "XLA_", "JAX_PLATFORMS", "MARIN_", "CUDA_VISIBLE"))},
    }
    path = rec.run_dir / f"probe-{jax.process_index()}.json"
    path.write_text(json.dumps(seen, indent=1))
    return seen


def probe_and_train(cfg, rec):
    """The probe, then the real training: a job array's element that is checked for what it
    sees and then reproduced bit for bit from its losses."""
    from marin.train.loop import train

    probe(cfg, rec)
    return train(cfg, rec)


def crash(cfg, rec):
    """A task that fails: `wait=true` must exit non-zero with the task's error."""
    raise RuntimeError(f"deliberate failure in {rec.run_id}")


def _kill_one_task() -> None:
    """Task MARIN_TEST_DYING_TASK (default 1) dies by SIGKILL; the others wait for srun to end
    the step (--kill-on-bad-exit=1), as processes blocked in a collective would."""
    import signal
    import time

    if int(os.environ["SLURM_PROCID"]) == int(os.environ.get("MARIN_TEST_DYING_TASK", "1")):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    raise RuntimeError("srun did not end the step after a task died")


def fail_once(cfg, rec):
    """Every task raises in the job's first start (each leaves an error result for submitit);
    after the restart every process probes. The tasks raise together (a file barrier): once one
    has exited, srun ends the others, and one still starting would die by SIGTERM, leaving none."""
    import time

    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
        (rec.run_dir / f"fail_once-{os.environ['SLURM_PROCID']}").touch()
        while len(list(rec.run_dir.glob("fail_once-*"))) < int(os.environ["SLURM_NTASKS"]):
            time.sleep(0.1)
        raise RuntimeError(f"deliberate failure in the first start of {rec.run_id}")
    return probe(cfg, rec)


def late_start(cfg, rec):
    """The real training, task 1 starting it LATE_START_S after task 0: a process whose data
    preparation or compile lags the others' by more than gloo's fixed 30 s rendezvous, as on a
    loaded host. Task 0 must wait for it, not fail its first collective."""
    import time

    from marin.train.loop import train

    if int(os.environ["SLURM_PROCID"]) == 1:
        time.sleep(LATE_START_S)
    return train(cfg, rec)


LATE_START_S = 40


def die(cfg, rec):
    """A task dies in every start of the job."""
    _kill_one_task()
