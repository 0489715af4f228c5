"""What `launch.py` does with a composed config, in order:

validate (no JAX) → dry run, or → create the run record (directory + MLflow run) → train here
or submit to Slurm. A config error prints one line per bad field and exits with status 2, before
anything is written.
"""
from __future__ import annotations

import logging
import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from marin.config.validate import ConfigError, load

log = logging.getLogger("marin")


def setup_logging() -> None:
    """Logs go to stderr, so `dry_run=json` keeps stdout for its one JSON object."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def overrides() -> list[str]:
    """The command-line overrides of this job (for the run record and reproduction)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main (tests calling dispatch directly)
        return []


def dispatch(cfg: DictConfig) -> None:
    setup_logging()
    try:
        composed, resolved = load(cfg)
    except ConfigError as err:
        fail("invalid config\n" + "\n".join(f"  {n}: {m}" for n, m in err.problems))
    if resolved.dry_run:
        from marin.launch.plan import print_plan

        print_plan(resolved, as_json=resolved.dry_run == "json")
        return
    if resolved.hardware.launcher == "slurm":
        from marin.launch.slurm import submit

        submit(composed, resolved, overrides())
        return
    from marin.train.loop import run_local

    run_local(composed, resolved, overrides())
