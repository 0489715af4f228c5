"""Device results read on the host: `to_host(tree)`, and `ready(tree)` before a host read.

Why not `jax.device_get` alone: when a computation cannot allocate its outputs (a CPU run under
`ulimit -v`: "RESOURCE_EXHAUSTED: Out of memory allocating …"), XLA's CPU client (jaxlib 0.10)
marks every output failed, but a host read of a small output (`int(state.step)`, a step's
metrics) waits on the buffer's memory, which is never made: the process hangs for good, and a
stop signal's Python handler never runs. `block_until_ready` waits on the outputs' definition
instead, and raises the computation's error.
"""
from __future__ import annotations


def ready(tree):
    """`tree` once every array in it is computed; raises the computation's error (JaxRuntimeError)."""
    import jax

    return jax.block_until_ready(tree)


def to_host(tree):
    """`jax.device_get(tree)`, raising a failed computation's error instead of hanging on it."""
    import jax

    return jax.device_get(ready(tree))
