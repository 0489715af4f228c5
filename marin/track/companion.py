"""MLflow off the training process: a companion process that makes and logs the run.

Importing MLflow, opening its store, creating the run and, at the end, drawing the run's report
take seconds of CPU (about 2.5 s for a `model=tiny` run, plus 0.4 s of MLflow's own shutdown),
which a thread in the training process would spend fighting JAX's tracing for the interpreter
lock. A local run (`marin.train.loop.run_local`) therefore starts this companion first: while
the training process traces and compiles, the companion imports MLflow and then makes the run;
metrics go to it through a pipe and are logged there, in order.

    companion = Companion.start()                # `python -m marin.track.companion`
    future = companion.call(fn, *args)            # fn(*args) runs there, calls in order
    future.result()                               # its value, or CompanionError
    companion.close()                             # the companion finishes what it was sent

Calls are pickled (a function is pickled by its module and name, so it must be a module-level
function of the project). Nothing is lost if the companion dies: the caller sees
`CompanionError` from every unanswered call and takes over itself (marin.track.tracker's
`RemoteTracker` replays what was not yet confirmed sent).

The companion ignores Ctrl-C (the terminal sends it to the whole process group; the training
process handles it and tells the companion how the run ended). When the training process is
gone without saying so (killed), the companion reads the end of its pipe and ends the run FAILED.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future

log = logging.getLogger("marin.track")

_HEADER = struct.Struct("!Q")  # each message: its length, then its pickle


class CompanionError(RuntimeError):
    """A call that failed in the companion; the message names the error."""


class CompanionGone(CompanionError):
    """The companion exited (or its pipe broke) before answering."""


def _send(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream):
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return pickle.loads(data) if len(data) == size else None


class Companion:
    """The training process's end: starts the companion and sends it calls."""

    def __init__(self, process: subprocess.Popen):
        self._process = process
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, Future] = {}
        self.alive = True
        self._reader = threading.Thread(target=self._read_replies, name="marin-companion", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @classmethod
    def start(cls, warm: str = "marin.track.companion:warm_mlflow") -> "Companion":
        """Start the companion; it imports what `warm` (`module:function`) does while it waits."""
        from marin.config.store import PROJECT_ROOT

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
        process = subprocess.Popen([sys.executable, "-m", "marin.track.companion", warm],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return cls(process)

    def call(self, fn, *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) in the companion after every earlier call; a Future of its value."""
        future: Future = Future()
        with self._lock:
            if not self.alive:
                future.set_exception(CompanionGone("the tracking companion process is gone"))
                return future
            seq, self._next = self._next, self._next + 1
            self._waiting[seq] = future
            try:
                _send(self._process.stdin, (seq, fn, args, kwargs))
            except (BrokenPipeError, OSError, ValueError):
                self._gone()
        return future

    def close(self, timeout: float = 120.0) -> None:
        """No more calls: the companion finishes the ones it has, then exits."""
        with self._lock:
            if self._process.stdin and not self._process.stdin.closed:
                try:
                    self._process.stdin.close()
                except OSError:
                    pass
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("tracking companion did not exit in %.0f s; stopping it", timeout)
            self._process.kill()
        self._reader.join(timeout=5)

    def _read_replies(self) -> None:
        while (reply := _receive(self._process.stdout)) is not None:
            seq, ok, value = reply
            with self._lock:
                future = self._waiting.pop(seq, None)
            if future is not None:
                (future.set_result if ok else future.set_exception)(value if ok else CompanionError(value))
        with self._lock:
            self._gone()

    def _gone(self) -> None:
        """The companion exited or its pipe broke: every unanswered call fails (lock held)."""
        self.alive = False
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(CompanionGone("the tracking companion process ended before answering"))


# ---------------------------------------------------------------------------- the companion's side

_on_orphaned = []  # what to do when the training process ends without closing (tracker: end the run)


def when_orphaned(fn) -> None:
    """Call fn() in the companion if the training process goes away without closing the pipe."""
    _on_orphaned.append(fn)


def warm_mlflow() -> None:
    """Import what making and logging a run needs (most of the companion's start-up)."""
    import mlflow  # noqa: F401
    from mlflow.store.tracking import sqlalchemy_store  # noqa: F401 (the sqlite store: 0.7 s)


def serve(warm: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    try:
        os.nice(5)  # background work: where cores are short, the training process goes first (mostly)
    except OSError:
        pass
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the replies
    requests = sys.stdin.buffer

    from marin.track.secrets import guard_output

    guard_output()  # what it prints is masked like the training process's output
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s",
                        datefmt="%H:%M:%S")
    guard_output()  # the handler just made gets the masking filter too
    if warm:
        module, _, name = warm.partition(":")
        try:
            getattr(__import__(module, fromlist=[name]), name)()
        except Exception as err:  # noqa: BLE001 — a failed warm-up shows again at the first real call
            log.debug("companion warm-up failed: %s", err)
    while True:
        try:
            message = _receive(requests)
        except Exception as err:  # noqa: BLE001 — an unpicklable request: the sender sees the pipe close
            log.warning("tracking companion: unreadable request (%s)", err)
            break
        if message is None:
            break
        seq, fn, args, kwargs = message
        try:
            reply = (seq, True, fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 — reported to the caller, one line
            from marin.track import secrets

            reply = (seq, False, secrets.mask(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
        try:
            try:
                _send(replies, reply)
            except (pickle.PicklingError, TypeError, AttributeError) as err:  # a value that cannot travel
                _send(replies, (seq, False, f"{type(err).__name__}: the call's value cannot be sent back ({err})"))
        except (BrokenPipeError, OSError):
            break
    # The pipe's end: after a run's last call it is the training process's goodbye; the callbacks
    # decide from their own state whether the run was ended (they end it FAILED if not).
    for fn in _on_orphaned:
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            log.warning("tracking companion: %s", err)
    # Everything is in the store (each MLflow call commits); its exit handlers would only cost
    # the training process's caller another 0.4 s of waiting on our shared stderr.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # Through the imported module, not this `__main__` copy: its state (`when_orphaned`) is the
    # one the calls it serves (which import marin.track.companion) see.
    from marin.track import companion

    companion.serve(sys.argv[1] if len(sys.argv) > 1 else None)
