"""Memory spaces: arrays in pinned host memory (offloaded fp32 masters, optimizer state) are read
onto the device where they are used. Used by the model (expert weights) and the optimizer, which
sits above the model."""
from __future__ import annotations

import jax


def on_host(x) -> bool:
    """Whether traced `x` lives in pinned host memory (JAX tracks memory spaces in avals)."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def fetch(x: jax.Array) -> jax.Array:
    """`x` on the device: a host slice is copied in; a device array is returned as it is."""
    return jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x


def store(like: jax.Array, x: jax.Array) -> jax.Array:
    """`x` in the memory space of `like` (back to the host when `like` lives there)."""
    return jax.device_put(x, jax.memory.Space.Host) if on_host(like) else x
