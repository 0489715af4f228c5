"""What every launch path shares for talking to the user: logging to stderr, the one-line error
with exit status 2, a config error as lines, and launch.py's exit. Its own module so that
`entry` (which dispatches to `resume`, `slurm`, `compile_plan`, the train loop) and those
modules all import it, and none of them imports `entry` back (no import circle; tests/test_import_graph.py checks).
`marin/cli.py` is the argparse side of the run tools (`marin.status`, ...), not of launch.py.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

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


def exit_now(code) -> None:
    """Exit without tearing the interpreter down: atexit handlers run (logging's flush, JAX's own
    clean-up), standard streams are flushed, then the process ends. Python's teardown of a JAX
    process (every module and XLA object freed one by one) adds a third of a second to every
    command and has nothing left to write. A non-daemon thread still running gets Python's
    normal exit, which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more to say
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))
