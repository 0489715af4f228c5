"""The device mesh from `hardware.mesh`: axes (replica_dcn, data, expert, model).

In the model layer because the model shards by these axis names; JAX is imported only by
`make_mesh` (the config path checks a mesh against a device count without it).

Batch is split over replica_dcn × data × expert; experts over `expert`; `model` is tensor
parallel (same tokens). Axis types are Auto so that plain data-parallel matmuls need no
explicit sharding annotations (JAX 0.10 defaults `make_mesh` to Explicit).

Devices are laid out in process order, so `replica_dcn` (the outermost axis) takes contiguous
groups of processes: with one process per GPU and Slurm's task order following the racks, each
replica is one rack. Where the backend reports slices (`slice_index`, one per NVLink domain or
TPU slice) the hybrid layout puts exactly one slice in each replica instead.
"""
from __future__ import annotations

AXES = ("replica_dcn", "data", "expert", "model")
BATCH_AXES = ("replica_dcn", "data", "expert")


class MeshError(ValueError):
    """The configured mesh does not fit the devices this job sees."""


def mesh_shape(cfg) -> tuple[int, int, int, int]:
    m = cfg.hardware.mesh
    return (m.replica_dcn, int(m.data), m.expert, m.model)


def check_mesh(cfg, device_count: int) -> None:
    """Raise MeshError unless the mesh covers exactly `device_count` devices and splits the experts."""
    shape = mesh_shape(cfg)
    product = shape[0] * shape[1] * shape[2] * shape[3]
    if product != device_count:
        raise MeshError(
            f"hardware.mesh: replica_dcn × data × expert × model = {' × '.join(map(str, shape))} = {product}, "
            f"but this job has {device_count} devices (hardware {cfg.hardware.name}: check nodes, "
            f"tasks_per_node, gpus_per_node / host_devices, and that XLA_FLAGS took effect)")
    experts = cfg.model.num_experts
    if experts % shape[2]:
        raise MeshError(f"hardware.mesh.expert = {shape[2]} does not divide model.num_experts = {experts}")


def _slice_count(devices) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def make_mesh(cfg, devices=None):
    import jax  # JAX off the config path (slurm/plan check the mesh without it)
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    check_mesh(cfg, len(devices))
    shape = mesh_shape(cfg)
    axis_types = (AxisType.Auto,) * len(AXES)
    if shape[0] > 1 and _slice_count(devices) == shape[0]:
        grid = mesh_utils.create_hybrid_device_mesh((1, *shape[1:]), (shape[0], 1, 1, 1), devices)
        return Mesh(grid, AXES, axis_types=axis_types)
    return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)
