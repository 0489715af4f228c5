"""Process environment and multi-process JAX start-up, from the hardware config and Slurm's variables.

`apply_environment(hw)` must run before JAX creates its backend (it sets XLA_FLAGS, the forced
host device count and the hardware's `env`); `initialize(hw)` then joins the job's processes.
Inside a Slurm step JAX reads the coordinator, process count and rank from SLURM_* variables;
outside Slurm, or with one task, nothing is initialised and the run is single-process.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("marin.distributed")

FORCED_DEVICES_FLAG = "--xla_force_host_platform_device_count"


# The XLA_FLAGS the first marin process of a run started with, passed on to the processes it
# starts (launch.py jobs, Slurm tasks), which then read this rather than the XLA_FLAGS it exported:
# so one hardware's flags never leak into another's.
INHERITED_FLAGS = "MARIN_INHERITED_XLA_FLAGS"


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def xla_flags(hw) -> str:
    """The XLA_FLAGS a process of this hardware runs with: `hardware.xla_flags`, the forced host
    device count on CPU, then the environment's own XLA_FLAGS (a user's `--xla_dump_to`, the test
    suite's faster compile) except those the hardware sets."""
    flags = [f for f in hw.xla_flags.split() if not f.startswith(FORCED_DEVICES_FLAG)]
    if hw.platform == "cpu" and hw.host_devices > 1:
        flags.append(f"{FORCED_DEVICES_FLAG}={hw.host_devices}")
    inherited = os.environ.get(INHERITED_FLAGS, os.environ.get("XLA_FLAGS", "")).split()
    set_here = {_flag_name(f) for f in flags} | {FORCED_DEVICES_FLAG}
    return " ".join(flags + [f for f in inherited if _flag_name(f) not in set_here])


def process_environment(hw) -> dict[str, str]:
    """Every variable the hardware sets for its processes (shown by dry runs, exported by jobs)."""
    env = {"XLA_FLAGS": xla_flags(hw)}
    if hw.platform == "cpu" and hw.host_devices > 1:
        # XLA:CPU sizes its thread pool by core count; collectives over more forced devices than
        # cores then abort ("only N threads arrived").
        env["PJRT_NPROC"] = str(max(16, 2 * hw.host_devices))
    if hw.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    # A <redacted> value is a secret the job inherits from sbatch's environment (marin/launch/slurm.py).
    env.update({k: str(v) for k, v in hw.env.items() if str(v) != "<redacted>"})
    return env


def apply_environment(hw) -> None:
    """Set this process's variables for `hw`; warn if JAX's backend already started without them."""
    os.environ.setdefault(INHERITED_FLAGS, os.environ.get("XLA_FLAGS", ""))
    changes = {k: v for k, v in process_environment(hw).items() if os.environ.get(k) != v}
    os.environ.update(changes)
    started = False
    if changes and "jax" in sys.modules:  # not imported yet: nothing can have started
        try:
            from jax._src import xla_bridge  # no public API for this question

            started = xla_bridge.backends_are_initialized()
        except (ImportError, AttributeError):
            pass
    if started:
        log.warning("JAX's backend started before the hardware environment was applied; "
                    "XLA_FLAGS / forced host devices may not take effect")


def in_slurm_step() -> bool:
    """True inside an srun / submitit task (JAX's Slurm detection needs the step's variables)."""
    return all(k in os.environ for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID"))


def initialize(hw) -> tuple[int, int]:
    """Join the job's processes; returns (process_index, process_count).

    One process per GPU: JAX maps each process to the GPU at SLURM_LOCALID, which is right when
    every task sees all of its node's GPUs (`--gpus-per-node`, never `--gpus-per-task`).
    """
    import jax

    if hw.platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if in_slurm_step() and int(os.environ["SLURM_NTASKS"]) > 1:
        if not jax.distributed.is_initialized():
            jax.distributed.initialize(initialization_timeout=hw.init_timeout_s)
        log.info("process %d of %d, %d local / %d global devices", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())
    return jax.process_index(), jax.process_count()


def check_gpu_install(hw) -> str | None:
    """None if this install can drive `hw`'s platform; else what is missing (CPU-only jaxlib)."""
    if hw.platform != "gpu":
        return None
    from importlib import metadata

    for dist in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            metadata.version(dist)
            return None
        except metadata.PackageNotFoundError:
            continue
    return (f"hardware {hw.name} runs on GPUs but this Python has a CPU-only JAX; "
            "install the GPU extra on the cluster's environment: pip install -e '.[gpu]'")
