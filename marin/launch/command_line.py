"""launch.py's command line, read before Hydra sees it.

Hydra answers some habits badly: an override it does not know ends in several lines of advice
(`+key`) that fail again, and `--cfg job` prints the composed config before marin fills each
group's `name`, so every name shows `???`. `read` refuses the first kind in one line (exit 2,
nothing written) and turns `--cfg job` into a normal run that `show` answers, so the config
shown is the one a run gets. No JAX.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hydra._internal.utils import get_args_parser  # Hydra's own parser: the argv forms it accepts

from marin.cli import fail
from marin.config.store import override_key

# Hydra would make these folders, but marin writes nothing there: a run's directory is
# <run.out_dir>/<run.name>, and Hydra's sweep folder only holds its private multirun.yaml.
HYDRA_OUTPUT_DIRS = ("hydra.run.dir", "hydra.sweep.dir")


@dataclass(frozen=True)
class Show:
    """`--cfg job [--resolve] [--package P]`: print the config instead of running it."""
    resolve: bool
    package: Optional[str]


def read(argv: list[str]) -> tuple[list[str], Optional[Show]]:
    """The argv to give Hydra, and what to show instead of running (None: run). Refuses, in one
    line with exit status 2, what Hydra would answer badly."""
    args = get_args_parser().parse_args(argv[1:])
    for override in args.overrides:
        if override_key(override) in HYDRA_OUTPUT_DIRS:
            fail(f"{override_key(override)}: marin writes nothing there; use run.out_dir=<folder> "
                 "(a run's directory is <run.out_dir>/<run.name>)")
    if args.cfg != "job" or _other_command(args):
        return argv, None  # Hydra's own --cfg hydra|all, and its refusal of two commands at once
    # The same command line without --cfg: Hydra composes it as for a run and calls the task.
    kept = [argv[0]]
    for flag, value in (("--config-path", args.config_path), ("--config-name", args.config_name),
                        ("--config-dir", args.config_dir)):
        if value is not None:
            kept += [flag, value]
    return kept + args.overrides, Show(resolve=args.resolve, package=args.package)


def _other_command(args) -> bool:
    return bool(args.help or args.hydra_help or args.run or args.multirun or args.shell_completion
                or args.info or args.experimental_rerun)
