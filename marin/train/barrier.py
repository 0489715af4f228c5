"""Waiting for the job's other processes without running a collective.

A collective is the wrong way to wait for a process that lags: on CPU the first collective of a
job is also gloo's rendezvous, which gives up after a fixed 30 s (XLA's constant, not a setting),
and a process's set-up can lag another's by more than that (its compile missed the persistent
cache that the other hit, its data preparation, a loaded host). So before the first collective
after such uneven work, every process meets at the barrier of jax.distributed's coordination
service, which waits `hardware.init_timeout_s` (as long as the processes had to start at all).

    meet("compiled", cfg.hardware.init_timeout_s)   # a no-op in a single process
"""
from __future__ import annotations


def meet(name: str, timeout_s: float) -> None:
    """Return once every process of the job has called `meet(name, ...)`; each name once per job
    start. A process that does not come within `timeout_s` fails the others (DEADLINE_EXCEEDED,
    naming the barrier)."""
    import jax

    if jax.process_count() == 1:
        return
    # jax.distributed's client: JAX's public barriers (multihost_utils) are collectives themselves.
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"marin-{name}", int(timeout_s * 1000))
