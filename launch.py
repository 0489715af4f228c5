#!/usr/bin/env python
"""Run a composed config: `python launch.py [group=option ...] [key=value ...]`.

Hydra composes conf/ (plus the `sweep` group from sweeps/); marin validates before anything is
imported or written, then dry-runs, reproduces, trains in-process or submits to Slurm, as the
config says. See README.md.
"""
import sys

import hydra
from omegaconf import DictConfig

from marin.cli import exit_now, interrupt_safely
from marin.config.store import register
from marin.launch import command_line
from marin.launch.entry import dispatch, quote_run_references, show
from marin.track.secrets import guard_output

guard_output(sys.argv)  # from here on, what is printed (Hydra's errors included) has its secrets masked
interrupt_safely()  # a Ctrl-C while JAX loads is not lost
register()


_composed = False  # whether Hydra got as far as calling main
_show = None  # `--cfg job`: what to print instead of running (marin.launch.command_line.Show)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _composed
    _composed = True
    if _show is not None:
        show(cfg, _show.resolve, _show.package)
        return
    command_line.refuse_sweep_without_multirun()
    try:
        dispatch(cfg)
    except KeyboardInterrupt:  # Ctrl-C before training started (training handles its own)
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.argv = quote_run_references(sys.argv)  # a run's name with "=" pastes as printed
    sys.argv, _show = command_line.read(sys.argv)  # refuses (one line, exit 2) what Hydra answers badly
    command_line.report_in_one_line()
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while Hydra composed or modules loaded: nothing was written yet
        print("interrupted", file=sys.stderr)
        exit_now(130)
    except SystemExit as done:
        # Hydra reports a composition error (unknown option or key, wrong type) and exits 1;
        # it is bad input like any other, so it gets bad input's status.
        code = 2 if done.code == 1 and not _composed else done.code
        if not isinstance(code, (int, type(None))):  # sys.exit("message"): Python prints it
            raise
        exit_now(code)
    exit_now(0)
