#!/usr/bin/env python
"""Run a composed config: `python launch.py [group=option ...] [key=value ...]`.

Hydra composes conf/ (plus the `sweep` group from sweeps/); marin validates before anything is
imported or written, then dry-runs, reproduces, trains in-process or submits to Slurm, as the
config says. See README.md.
"""
import sys

import hydra
from omegaconf import DictConfig

from marin.cli import exit_now
from marin.config.store import register
from marin.launch.entry import dispatch, quote_run_references
from marin.track.secrets import guard_output

guard_output(sys.argv)  # from here on, what is printed (Hydra's errors included) has its secrets masked
register()


_composed = False  # whether Hydra got as far as calling main


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _composed
    _composed = True
    try:
        dispatch(cfg)
    except KeyboardInterrupt:  # Ctrl-C before training started (training handles its own)
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.argv = quote_run_references(sys.argv)
    try:
        main()
    except SystemExit as done:
        # Hydra reports a composition error (unknown option or key, wrong type) and exits 1;
        # it is bad input like any other, so it gets bad input's status.
        code = 2 if done.code == 1 and not _composed else done.code
        if not isinstance(code, (int, type(None))):  # sys.exit("message"): Python prints it
            raise
        exit_now(code)
    exit_now(0)
