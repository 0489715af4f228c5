"""The device mesh from `hardware.mesh`: axes (replica_dcn, data, expert, model).

Batch is split over replica_dcn × data × expert; experts over `expert`; `model` is tensor
parallel (same tokens). Axis types are Auto so that plain data-parallel matmuls need no
explicit sharding annotations (JAX 0.10 defaults `make_mesh` to Explicit).
"""
from __future__ import annotations

AXES = ("replica_dcn", "data", "expert", "model")
BATCH_AXES = ("replica_dcn", "data", "expert")


def make_mesh(cfg):
    import jax
    from jax.sharding import AxisType

    m = cfg.hardware.mesh
    shape = (m.replica_dcn, int(m.data), m.expert, m.model)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))
