"""What `launch.py` does with a composed config, in order:

validate (no JAX) → dry run, or → create the run record (directory + MLflow run) → train here
or submit to Slurm. A config error prints one line per bad field and exits with status 2, before
anything is written. Everything printed goes through marin.track.secrets (secrets masked).
"""
from __future__ import annotations

import logging
import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from marin.config.validate import ConfigError, load

log = logging.getLogger("marin")


def setup_logging() -> None:
    """Logs go to stderr, so `dry_run=json` keeps stdout for its one JSON object; stdout, stderr
    and the log handlers mask secrets (values of secret-named variables and overrides)."""
    from marin.track.secrets import guard_output

    guard_output(sys.argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    guard_output()  # the handler just made gets the masking filter too


def fail(message: str, code: int = 2) -> None:
    from marin.track.secrets import mask

    print(f"error: {mask(message)}", file=sys.stderr)
    sys.exit(code)


def overrides() -> list[str]:
    """The command-line overrides of this job (for the run record and reproduction)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main (tests calling dispatch directly)
        return []


def dispatch(cfg: DictConfig) -> None:
    setup_logging()
    job_overrides = overrides()
    from marin.track import secrets
    from marin.track.backend import TrackingUnavailable

    secrets.scan_overrides(job_overrides)
    try:
        _dispatch(cfg, job_overrides)
    except TrackingUnavailable as err:  # ours: one masked line, not Hydra's crash report (which prints the overrides)
        fail(str(err), code=1)


def _dispatch(cfg: DictConfig, job_overrides: list[str]) -> None:
    if cfg.get("verify"):  # replay a recorded run and compare its metrics (marin/track/verify.py)
        from marin.track.verify import verify

        verify(cfg, job_overrides)
        return
    if cfg.get("resume"):  # continue a run: its own config, dir and MLflow run (marin/launch/resume.py)
        from marin.launch.resume import resume

        resume(job_overrides, dry_run=cfg.get("dry_run"), wait=bool(cfg.get("wait")), ref=str(cfg.resume))
        return
    try:
        if cfg.get("reproduce"):  # the saved run's config, with this command line's overrides on top
            from marin.track.reproduce import ReproduceError, recompose

            try:
                composed, resolved, job_overrides = recompose(cfg.reproduce, job_overrides)
            except ReproduceError as err:
                fail(f"reproduce: {err}")
        else:
            composed, resolved = load(cfg)
    except ConfigError as err:
        fail("invalid config\n" + "\n".join(f"  {n}: {m}" for n, m in err.problems))
    if resolved.dry_run:
        from marin.launch.plan import print_plan

        print_plan(resolved, as_json=resolved.dry_run == "json")
        return
    if resolved.hardware.launcher == "slurm":
        from marin.launch.slurm import submit

        submit(composed, resolved, job_overrides)
        return
    from marin.launch.distributed import apply_environment
    from marin.train.loop import run_local

    apply_environment(resolved.hardware)  # XLA_FLAGS etc. before JAX starts (local_cpu8's 8 devices)
    run_local(composed, resolved, job_overrides)
