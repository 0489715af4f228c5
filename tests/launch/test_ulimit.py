"""A CPU run under a memory limit (`ulimit -v`, RLIMIT_AS) ends: refused before it starts when the
estimate plus JAX's own address space is over the limit, and with one line (exit 1, the MLflow
run FAILED) when it runs out anyway; never a hang (issue 42's probe: it hung in `int(state.step)`
and ignored SIGINT and SIGTERM). A subprocess's timeout is the hang's signal, not a speed test."""
import resource
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from marin.launch import memory
from marin.track.errors import out_of_memory
from tests.helpers import ROOT, make_config

GIB = 2 ** 30
HANG_S = 300  # far past what these runs take (seconds): reaching it means a hang


def limited(gib: float):
    """A preexec_fn: the child's address space limited to `gib` (what `ulimit -v` sets)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * GIB), int(gib * GIB)))
    return apply


def launch(tmp_path, gib: float, *overrides: str) -> subprocess.CompletedProcess:
    site = (f"run.out_dir={tmp_path / 'out'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    return subprocess.run([sys.executable, "launch.py", "train.steps=2", *overrides, *site], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_S, preexec_fn=limited(gib))


def test_a_run_under_a_small_ulimit_is_refused_before_anything_is_written(tmp_path):
    done = launch(tmp_path, 1.0, "model=micro")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("error: memory: this CPU run needs about"), err
    assert "RLIMIT_AS" in err[0] and "1.00 GiB" in err[0] and "plan.allow_over_memory=true" in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_a_run_out_of_memory_under_a_ulimit_ends_with_one_line_and_a_failed_run(tmp_path):
    """Insisting (plan.allow_over_memory) on a model whose state does not fit 4 GiB of address
    space: its initialisation fails to allocate. Before: `int(state.step)` waited for ever."""
    done = launch(tmp_path, 4.0, "model=micro", "model.d_model=4096", "plan.allow_over_memory=true")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: out of memory (RESOURCE_EXHAUSTED"), done.stderr[-2000:]
    assert "RLIMIT_AS" in errors[0] and "4.00 GiB" in errors[0]
    assert done.stdout.startswith("failed in set-up")  # the run's summary line
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert [status for (status,) in db.execute("select status from runs")] == ["FAILED"]


# A program whose outputs (3 GiB) are over a 4 GiB address-space limit: `step`, the small one,
# is what the host then reads.
OVER_LIMIT = textwrap.dedent("""
    import jax, jax.numpy as jnp

    @jax.jit
    def make(key):
        big = [jax.random.normal(jax.random.fold_in(key, i), (50_000, 4096)) for i in range(4)]  # 3 GiB
        return jnp.zeros((), jnp.int32), big
    step, _ = make(jax.random.key(0))
""")


def test_a_host_read_of_a_computation_that_ran_out_of_memory_raises(tmp_path):
    """The root of the hang, alone: several outputs over the limit, then the small one read on
    the host. `jax.device_get` waits for ever there (jaxlib 0.10.2); `to_host` raises the error."""
    probe = OVER_LIMIT + textwrap.dedent("""
        from marin.train.host import to_host
        try:
            to_host(step)
        except jax.errors.JaxRuntimeError as err:
            print(str(err).splitlines()[0])
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S, preexec_fn=limited(4.0))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("RESOURCE_EXHAUSTED: Out of memory"), done.stdout


def test_the_refusal_names_each_limit_it_reads():
    cfg = make_config("model=micro", "hardware=local_cpu")
    need = memory.device_peak(cfg) + memory.accounting.memory_per_device(cfg)["host"]
    runtime = memory.RUNTIME_ADDRESS_SPACE_GIB
    address = memory.Limit(need + runtime / 2, "this process's limit (RLIMIT_AS, `ulimit -v`)", True)
    line = memory.over_machine_memory(cfg, machine_gib=1e6, limits=[address])
    assert line is not None and "RLIMIT_AS" in line and f"{need + runtime:.1f} GiB of address space" in line
    assert memory.over_machine_memory(cfg, machine_gib=1e6, limits=[replace(address, gib=need + runtime * 2)]) is None
    cgroup = memory.Limit(need * 2, "its cgroup's memory limit (/sys/fs/cgroup/memory.max)", False)  # resident: no runtime share
    assert memory.over_machine_memory(cfg, machine_gib=1e6, limits=[cgroup]) is None
    line = memory.over_machine_memory(cfg, machine_gib=1e6, limits=[memory.Limit(need / 2, cgroup.name, False)])
    assert line is not None and "memory.max" in line


def test_the_cgroup_limit_is_read_for_v1_and_v2(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{3 * GIB}\n")
    (tmp_path / "v2.cgroup").write_text("0::/job\n")
    assert memory.cgroup_limit_bytes(v2, tmp_path / "v2.cgroup") == (3 * GIB, v2 / "job" / "memory.max")
    (v2 / "job" / "memory.max").write_text("max\n")
    assert memory.cgroup_limit_bytes(v2, tmp_path / "v2.cgroup") is None
    v1 = tmp_path / "v1"   # a container: its cgroup's directory at the mount's root
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (tmp_path / "v1.cgroup").write_text("4:memory:/outside/this/container\n0::/\n")
    assert memory.cgroup_limit_bytes(v1, tmp_path / "v1.cgroup") is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    assert memory.cgroup_limit_bytes(v1, tmp_path / "v1.cgroup") == (GIB, v1 / "memory" / "memory.limit_in_bytes")


@pytest.mark.parametrize("err", [MemoryError(), OSError(12, "Cannot allocate memory"),
                                 RuntimeError("can't start new thread"),
                                 ImportError("libjax_common.so: failed to map segment from shared object"),
                                 RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 67108864 bytes.")])
def test_allocation_failures_are_recognised(err):
    assert out_of_memory(err)
    try:
        raise ValueError("while handling it") from err
    except ValueError as outer:
        assert out_of_memory(outer) == out_of_memory(err)
    assert out_of_memory(ValueError("a bad value")) is None


def test_stop_signals_end_a_process_stuck_inside_xla(tmp_path):
    """The main thread waits inside XLA for ever (the host read that hung, kept here on purpose):
    SIGTERM's Python handler never runs. The first SIGTERM is explained; the second ends the
    process (marin.train.escort) with 128 + SIGTERM."""
    import os
    import signal
    import time

    probe = OVER_LIMIT + textwrap.dedent("""
        from marin.train import preempt
        preempt.install()
        print("waiting", flush=True)
        jax.device_get(step)  # never answers (jaxlib 0.10.2)
    """)
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    proc = subprocess.Popen([sys.executable, "-c", probe], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=limited(4.0))
    try:
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(escort_s() + 1.0)
        assert proc.poll() is None  # the first one waits for the next step boundary
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=HANG_S)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM again stops it at once" in err and "SIGTERM again, and the training process is still inside XLA" in err


def escort_s() -> float:
    from marin.train import escort

    return escort.NOTICE_S
