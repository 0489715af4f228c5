"""What every launch path shares for talking to the user: logging to stderr, the one-line error
with exit status 2, and a config error as lines. Its own module so that `entry` (which dispatches
to `resume`, `slurm`, `compile_plan`, the train loop) and those modules all import it, and none
of them imports `entry` back (no import circle; tests/test_import_graph.py checks).
`marin/cli.py` is the argparse side of the run tools (`marin.status`, ...), not of launch.py.
"""
from __future__ import annotations

import logging
import sys

from marin.config.validate import ConfigError


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


def config_errors(err: ConfigError, prefix: str = "") -> str:
    """One line for one bad field; a header and one line per field for several."""
    if len(err.problems) == 1:
        return f"{prefix}invalid config: {err.problems[0][0]}: {err.problems[0][1]}"
    return f"{prefix}invalid config\n" + "\n".join(f"  {n}: {m}" for n, m in err.problems)
