"""Whether a run fits its devices' memory, from the estimate of `marin.model.accounting`: what the
dry run prints (marin/launch/plan.py) and what a Slurm submission refuses (marin/launch/slurm.py).
Pure Python, no JAX."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from marin.config import derive
from marin.config.schema import Config
from marin.model import accounting
from marin.track.errors import address_limits


def host_limit_gib(hw) -> float | None:
    """Pinned host memory a device may use (`hardware.host_memory_per_device_gib`); None = unknown."""
    return getattr(hw, "host_memory_per_device_gib", None)


def host_fits(cfg: Config, host_gib: float | None = None) -> bool | None:
    """Whether the pinned host bytes (optim.offload, model.offload_carry: the estimate's "host")
    are within the host memory per device; None where the hardware has no figure."""
    limit = host_limit_gib(cfg.hardware)
    if limit is None:
        return None
    host = accounting.memory_per_device(cfg)["host"] if host_gib is None else host_gib
    return host <= limit


def fits(cfg: Config, estimate_gib: float) -> bool | None:
    """Whether the estimate is within derive.memory_limit_gib, and the host bytes within the host
    memory per device where the hardware gives it; None where the hardware has no device figure."""
    limit = derive.memory_limit_gib(cfg.hardware)
    if limit is None:
        return None
    return estimate_gib <= limit and host_fits(cfg) is not False


def device_peak(cfg: Config) -> float:
    """The larger of the train step's and the eval step's estimates (GiB per device), each the
    larger over `accounting.verdict_backends`: what a verdict judges."""
    return accounting.device_peak(cfg)


def over_memory(cfg: Config) -> str | None:
    """One line with the figures when the run's memory estimate exceeds the device's usable
    memory, or its pinned host bytes the host memory per device (None when it fits or the
    hardware has no figure)."""
    hw = cfg.hardware
    memory = accounting.memory_per_device(cfg)
    peaks = accounting.step_peaks(cfg)
    train, evaluation = peaks["train"], peaks["eval"]
    estimate = max(train, evaluation)
    limit = derive.memory_limit_gib(hw)
    if limit is not None and estimate > limit:
        step = "train" if train >= evaluation else "eval"
        return (f"memory: the estimate is {estimate:.1f} GiB per device ({step} step), over the {limit:.1f} GiB "
                f"this hardware allows ({hw.name}: hardware.memory_per_device_gib {hw.memory_per_device_gib} × "
                f"memory_usable_fraction {hw.memory_usable_fraction}); lower train.micro_batch, offload "
                f"(optim.offload, model.remat) or set plan.allow_over_memory=true")
    if limit is not None and host_fits(cfg, memory["host"]) is False:
        return (f"memory: the estimate puts {memory['host']:.1f} GiB per device in pinned host memory, over the "
                f"{host_limit_gib(hw):.1f} GiB of host memory per device ({hw.name}: "
                f"hardware.host_memory_per_device_gib); offload less (optim.offload, model.offload_carry) or set "
                f"plan.allow_over_memory=true")
    return None


def offload_reason(cfg: Config) -> str:
    """Why the resolved offload layout is what it is, in the plan's figures: what each switch
    that is on would leave without it (derive.choose_offload picks the fitting layout that moves
    the fewest bytes), or that everything fits without offload."""
    limit = derive.memory_limit_gib(cfg.hardware)
    if limit is None:
        return "no memory figure for this hardware: nothing to fit (auto = off)"
    cost = accounting.offload_estimate(cfg)
    on = [name for name in derive.OFFLOAD_FIELDS if derive.offload_value(cfg, name)]
    if not on:
        return f"the plan fits without offload ({cost.device_gib:.1f} GiB per device, limit {limit:.1f})"
    parts = []
    for name in on:
        other = accounting.offload_estimate(derive.with_offload(cfg, {name: False}))
        verdict = "fits" if derive.offload_fits(cfg, other) else "does not fit"
        parts.append(f"without {name} {other.device_gib:.1f} GiB per device, {other.host_gib:.1f} on host: {verdict}")
    return f"{cost.device_gib:.1f} GiB per device with it, limit {limit:.1f}; " + "; ".join(parts)


def machine_memory_gib() -> float | None:
    """This machine's physical memory in GiB; None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (AttributeError, ValueError, OSError):
        return None


# Address space a CPU run's process takes beyond its arrays: JAX's and MLflow's libraries, the
# stacks of XLA's and LLVM's thread pools, malloc's per-thread arenas. Measured here (2 cores,
# jaxlib 0.10.2): the default run (estimate 0.2 GiB) fails under `ulimit -v 2400000` (2.29 GiB)
# and trains under 2600000 (2.48 GiB). More cores start more threads: a floor, not a bound.
RUNTIME_ADDRESS_SPACE_GIB = 2.25


@dataclass(frozen=True)
class Limit:
    """A limit on this process's memory besides the machine's: `name` says which and how to
    change it; `address_space`: it counts reserved address space (the runtime's too), not only
    the memory in use."""
    gib: float
    name: str
    address_space: bool


CGROUP_FILES = ("memory.max", "memory.limit_in_bytes")  # cgroup v2, v1
UNLIMITED_BYTES = 2 ** 60  # cgroup v1 writes "no limit" as the largest page-aligned int64


def cgroup_limit_bytes(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> tuple[int, Path] | None:
    """This process's cgroup memory limit in bytes and the file that sets it; None when unlimited
    or unknown. The cgroup's own directory first; a container sees its cgroup at the mount's root."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:  # "0::/path" (v2), "4:memory:/path" (v1)
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        mount = root if controllers == "" else root / "memory" if "memory" in controllers.split(",") else None
        if mount is not None:
            places += [mount / path.lstrip("/"), mount]
    for place in places:
        for name in CGROUP_FILES:
            try:
                text = (place / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < UNLIMITED_BYTES:
                return int(text), place / name
            if text == "max" or text.isdigit():
                return None
    return None


def process_limits() -> list[Limit]:
    """The limits this process runs under besides the machine's memory: `ulimit -v` (RLIMIT_AS),
    `ulimit -d` (RLIMIT_DATA), its cgroup's memory limit."""
    limits = [Limit(gib, f"this process's limit ({name})", True) for name, gib in address_limits()]
    if (cgroup := cgroup_limit_bytes()) is not None:
        limits.append(Limit(cgroup[0] / 2 ** 30, f"its cgroup's memory limit ({cgroup[1]})", False))
    return limits


_SMALLER = "lower train.micro_batch, train.global_batch or train.seq_len, choose a smaller model"


def over_machine_memory(cfg: Config, machine_gib: float | None = None, limits: list[Limit] | None = None) -> str | None:
    """A run on this machine's CPU: every device is this machine's memory. One line when the
    estimate (each device's peak plus its pinned host bytes, times the devices) exceeds the
    machine's memory (it would swap, or be killed part-way), or a limit on this process
    (`process_limits`; `limits` stands in for them): a `ulimit -v` counts the runtime's own
    address space too (RUNTIME_ADDRESS_SPACE_GIB). None otherwise, or for other runs."""
    hw = cfg.hardware
    if hw.launcher != "local" or hw.platform != "cpu":
        return None
    machine = machine_memory_gib() if machine_gib is None else machine_gib
    devices = derive.device_count(hw)
    per_device = device_peak(cfg) + accounting.memory_per_device(cfg)["host"]
    if machine is not None and devices * per_device > machine:
        return (f"memory: the estimate for this CPU run is {devices * per_device:.1f} GiB ({devices} device(s) × "
                f"{per_device:.1f} GiB), over this machine's {machine:.1f} GiB: it would swap or be killed part-way; "
                f"{_SMALLER}, or set plan.allow_over_memory=true")
    for limit in process_limits() if limits is None else limits:
        need = devices * per_device + (RUNTIME_ADDRESS_SPACE_GIB if limit.address_space else 0.0)
        if need > limit.gib:
            what = (f"{need:.1f} GiB of address space ({devices} device(s) × {per_device:.1f} GiB estimated + "
                    f"{RUNTIME_ADDRESS_SPACE_GIB} GiB for JAX's runtime)" if limit.address_space
                    else f"{need:.1f} GiB ({devices} device(s) × {per_device:.1f} GiB)")
            return (f"memory: this CPU run needs about {what}, over {limit.name} of {limit.gib:.2f} GiB: it would "
                    f"fail part-way; raise that limit, {_SMALLER}, or set plan.allow_over_memory=true")
    return None


def out_of_memory_line(what: str, limits: list[Limit] | None = None) -> str:
    """The one line for a run that ran out of memory (`what`: the error's first line), naming the
    limit it ran under and what to change."""
    limits = process_limits() if limits is None else limits
    machine = machine_memory_gib()
    under = "; ".join(f"{limit.name} is {limit.gib:.2f} GiB" for limit in limits)
    if not under:
        under = f"this machine has {machine:.1f} GiB" if machine is not None else "no limit is set"
    return (f"out of memory ({what.rstrip('.')}): {under}; {_SMALLER} (`dry_run=true` prints the estimate)"
            + (", or raise that limit" if limits else ""))


def launch_refusal(cfg: Config, machine_gib: float | None = None) -> str | None:
    """The one line that refuses to launch a run over memory, checked before anything is written,
    unless plan.allow_over_memory: a Slurm run over its devices' usable memory (`over_memory`), a
    CPU run here over this machine's memory or a limit on this process (`over_machine_memory`;
    `machine_gib` stands in for the machine's memory)."""
    if cfg.plan.allow_over_memory:
        return None
    if cfg.hardware.launcher == "slurm":
        return over_memory(cfg)
    return over_machine_memory(cfg, machine_gib)
