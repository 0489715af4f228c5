"""What launch.py, its Hydra launcher and the run tools (`marin.status`, `marin.diff`,
`marin.forecast`, `marin.report`, `marin.generate`, `marin.launch.verify`) share on the command
line: logging to stderr, `--help` from argparse, an error as `error: ...` on stderr (secrets
masked) with exit status 2, a config error as lines, and launch.py's exit."""
from __future__ import annotations

import argparse
import atexit
import gc
import importlib.machinery
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from marin.config.validate import ConfigError
from marin.track.secrets import guard_output, mask


def fail(message, code: int = 2) -> NoReturn:
    """Print `error: <message>` (secrets masked) on stderr and exit with `code` (2: bad input)."""
    print(f"error: {mask(str(message).strip())}", file=sys.stderr)
    sys.exit(code)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`error: ...`), not the usage block and a line."""

    def error(self, message: str) -> NoReturn:  # noqa: D102 (argparse's hook)
        fail(f"{self.prog}: {message} (see {self.prog} --help)")


def output_file(path, name: str):
    """A tool's `--out`: None when not given (the tool's default place), `<folder>/<name>` for a
    folder; refused (one line, exit 2) when it names something other than a file (a device, a
    pipe), which the tool's write-then-rename would replace: `--out /dev/full` as root was."""
    if path is None:
        return None
    path = Path(path).expanduser()
    if path.is_dir():
        return path / name
    if path.exists() and not path.is_file():
        fail(f"--out: {path} is not a file (a device or a pipe); give a file's path or a folder")
    return path


def setup_logging() -> None:
    """Logs go to stderr, so `dry_run=json` keeps stdout for its one JSON object; stdout, stderr
    and the log handlers mask secrets (values of secret-named variables and overrides)."""
    guard_output(sys.argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    guard_output()  # the handler just made gets the masking filter too
    # JAX's INFO lines are for its developers: one per platform it could not start ("Unable to
    # initialize backend 'tpu': … libtpu.so") on every machine without that hardware
    logging.getLogger("jax").setLevel(logging.WARNING)


def interrupt_safely() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual, except where raising it loses it or crashes:
    inside a garbage-collection callback (JAX runs one at every collection, `_xla_gc_callback`:
    Python printed "Exception ignored in" and dropped it, and a Ctrl-C pressed while JAX loaded let
    the run go on to its end), or while a C extension module is made (jaxlib's crashed the
    interpreter with a segmentation fault or an abort). There the signal is sent again 50 ms later. A
    SIGINT inherited as ignored (nohup, a background job) stays ignored; the trainer installs
    its own handler."""
    def unsafe(frame, callbacks: set) -> bool:
        return frame.f_code in callbacks or (
            frame.f_code.co_name in ("create_module", "exec_module")
            and isinstance(frame.f_locals.get("self"), importlib.machinery.ExtensionFileLoader))

    def on_sigint(signum, frame):
        callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
        while frame is not None:
            if unsafe(frame, callbacks):
                threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
                return
            frame = frame.f_back
        _interrupted.set()
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)


_interrupted = threading.Event()


def raise_if_interrupted() -> None:
    """Before a run's first write: a Ctrl-C whose KeyboardInterrupt some library swallowed (one
    raised inside OmegaConf while Hydra loaded a config was, now and then) still stops it here."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def config_errors(err: ConfigError, prefix: str = "") -> str:
    """One line for one bad field; a header and one line per field for several."""
    if len(err.problems) == 1:
        return f"{prefix}invalid config: {err.problems[0][0]}: {err.problems[0][1]}"
    return f"{prefix}invalid config\n" + "\n".join(f"  {n}: {m}" for n, m in err.problems)


def exit_now(code) -> None:
    """`sys.exit(code)` without the interpreter's teardown. Python's teardown of a JAX process
    (every module and XLA object freed one by one) adds about 0.1–0.3 s to every command and has
    nothing left to write; `_skip_teardown` ends the process once the exit handlers have run."""
    global _exit_code
    _exit_code = code if isinstance(code, int) else (0 if code is None else 1)
    sys.exit(code)


_exit_code: int | None = None


def _skip_teardown() -> None:
    # Registered when launch.py imports this module, before JAX, orbax or the tracking worker
    # register theirs, so it runs after them (exit handlers run last-registered first; non-daemon
    # threads were joined before any). Only for an exit through `exit_now`.
    if _exit_code is None:
        return
    logging.shutdown()  # registered before this one: it would not run otherwise
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more to say
            pass
    os._exit(_exit_code)


atexit.register(_skip_teardown)
