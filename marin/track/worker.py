"""The tracking process: where MLflow runs, for every kind of run (local runs, Slurm process 0,
resume, verify, sweeps).

Importing MLflow and opening its store take seconds of CPU (here 1.5 s and, for a sqlite store,
another 1.4 s), which in the training process would compete with JAX's tracing for the
interpreter lock. So the process that trains starts this worker first and calls MLflow through
it: `Worker.get().call(fn, *args)` runs the module-level function `fn` here and returns its value
(or raises WorkerError); `submit` does the same from a thread and returns a Future. Calls run
one at a time, in order. The Tracker's sender thread (marin.track.tracker) is the only caller
while a run trains, so a store that freezes or a worker that dies holds up that thread alone:
the Tracker keeps its metrics and retries on a fresh worker.

While a run is watched (`watch`, which `register_watched` and the Tracker call), the worker ends
it FAILED if the training process dies without `release` (SIGKILL, the OOM killer): its end of
the pipe closes. The worker ignores the signals that stop or preempt a job (the trainer handles
them and says how the run ended) and exits when that pipe closes.

    python -m marin.track.worker     (started by Worker.get; pickled calls on stdin, replies on stdout)
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future

from marin.config.paths import PROJECT_ROOT
from marin.track import backend, record, secrets, sweep
from marin.track.errors import address_limits, first_line

log = logging.getLogger("marin.track")

_HEADER = struct.Struct("!Q")  # each message: its length, then its pickle
# Ctrl-C, Slurm's preemption and time-limit warnings (SIGTERM, SIGUSR1/2 via --signal), a hang-up
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


class WorkerError(RuntimeError):
    """A call that failed in the worker; the message is its error's first line."""


class WorkerGone(WorkerError):
    """The worker exited (or its pipe broke) before answering."""


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


class Worker:
    """The training process's end of the tracking process."""

    _current: "Worker | None" = None

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
        self._process = subprocess.Popen([sys.executable, "-m", "marin.track.worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env)
        self._lock = threading.Lock()
        self.alive = True
        self._told: frozenset = frozenset()  # the secrets this worker has been told to mask

    @classmethod
    def get(cls) -> "Worker":
        """This process's worker, started at the first call (and again after one died)."""
        if cls._current is None or not cls._current.alive:
            cls._current = cls()
        return cls._current

    def call(self, fn, *args):
        with self._lock:
            if not self.alive:
                raise WorkerGone("the tracking process has ended")
            # secrets learnt since the last call (a config's, an override's) ride along: the worker
            # prints to the job's stderr itself and must mask what this process masks
            known = secrets.known()
            new, self._told = known - self._told, known
            try:
                _send(self._process.stdin, (fn.__module__, fn.__qualname__, args, sorted(new)))
                reply = _receive(self._process.stdout)
            except (OSError, ValueError):  # a broken pipe, or a stream closed by `kill`
                reply = None
            if reply is None:
                self.alive = False
                raise WorkerGone("the tracking process ended before answering")
        ok, value = reply
        if not ok:
            raise WorkerError(value)
        return value

    def submit(self, fn, *args) -> Future:
        """`call` in a thread: the caller goes on while the worker works."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self.call(fn, *args))
            except BaseException as err:  # noqa: BLE001 — handed to whoever waits on the future
                future.set_exception(err)

        threading.Thread(target=run, name="marin-tracking-call", daemon=True).start()
        return future

    def kill(self) -> None:
        """Stop a worker stuck on a store that does not answer (what it had not sent stays in the
        run directory: marin.track.tracker)."""
        self.alive = False
        self._process.kill()


# ---------------------------------------------------------------------------- in the worker

_watched: dict = {}        # {"uri", "run_id"}: the run to end FAILED if the trainer dies
_monitor: dict = {}        # {"run_id", "monitor"}: MLflow's system-metrics monitor of the watched run
_clients: dict = {}


def client(uri: str):
    if uri not in _clients:
        _clients[uri] = backend.client(uri)
    return _clients[uri]


def watch(uri: str, run_id: str, system_metrics_s: float | None = None) -> None:
    """Watch the run (see the module docstring); with `system_metrics_s`, also log this machine's
    CPU, memory, disk, network and GPU use to it every that many seconds (MLflow's own monitor,
    metrics `system/…`, continuing the steps of an earlier attempt). Here, not in the trainer: a
    thread sampling psutil and NVML would take the training process's interpreter lock."""
    _watched.update(uri=uri, run_id=run_id)
    if system_metrics_s and _monitor.get("run_id") != run_id:
        _stop_monitor()
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # needs psutil
            # its "Started/Stopping/Successfully terminated monitoring" INFO lines are noise on the console
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)

            monitor = SystemMetricsMonitor(run_id, sampling_interval=system_metrics_s, resume_logging=True,
                                           tracking_uri=uri)
            monitor.start()
            _monitor.update(run_id=run_id, monitor=monitor)
        except Exception as err:  # noqa: BLE001 — no psutil, say: the run goes on without them
            log.warning("system metrics not logged (%s)", secrets.mask(first_line(err)))


def _stop_monitor(wait_s: float = 5.0) -> None:
    """Stop the monitor and send its last samples, waiting at most `wait_s`: against a store that
    went away its thread sits in MLflow's retries for minutes, and the trainer's `finish` waits
    on this call."""
    monitor = _monitor.pop("monitor", None)
    _monitor.clear()
    if monitor is not None:
        stopping = threading.Thread(target=monitor.finish, name="marin-system-metrics-stop", daemon=True)
        stopping.start()
        stopping.join(wait_s)


def release() -> None:
    _stop_monitor()
    _watched.clear()


def register_watched(draft: record.Draft) -> record.RunRecord:
    """Make the MLflow run of a prepared run directory, and watch it from the moment it exists."""
    rec = record.register(draft)
    watch(rec.tracking_uri, rec.run_id)
    return rec


def log_batch(uri: str, run_id: str, metrics: list[tuple], tags: dict) -> None:
    from mlflow.entities import Metric, RunTag
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

    # cut with a note here: MLflow cuts silently, or refuses the whole batch, metrics too, on every
    # retry (MLFLOW_TRUNCATE_LONG_VALUES=false, an MLflow 2 server)
    items = [RunTag(k, record.tag_value(str(v))) for k, v in tags.items()]
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        client(uri).log_batch(run_id, tags=items[start:start + MAX_PARAMS_TAGS_PER_BATCH])
    for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client(uri).log_batch(run_id, metrics=[Metric(*row) for row in metrics[start:start + MAX_METRICS_PER_BATCH]])


def log_text(uri: str, run_id: str, text: str, name: str) -> None:
    client(uri).log_text(run_id, text, name)


def log_artifact(uri: str, run_id: str, path: str, artifact_path: str | None) -> None:
    client(uri).log_artifact(run_id, path, artifact_path)


def reopen(uri: str, run_id: str) -> None:
    """A resumed or requeued run is RUNNING again."""
    client(uri).update_run(run_id, status="RUNNING")


def end(uri: str, run_id: str, status: str) -> None:
    """End the run, and close its sweep's parent run if this was the sweep's last job."""
    if _monitor.get("run_id") == run_id:
        _stop_monitor()
    client(uri).set_terminated(run_id, status)
    parent_id = client(uri).get_run(run_id).data.tags.get("mlflow.parentRunId")
    if parent_id:
        sweep.close_if_done(client(uri), parent_id)


def warm_report() -> None:
    """Ready the report's plotting while the run trains, not at its end: matplotlib's imports,
    fonts and text caches (a throwaway figure drawn: about half a second the run's end skips)."""
    from marin.track import report  # matplotlib: only in this process

    report.warm()


def write_report(rec: record.RunRecord) -> None:
    from marin.track import report  # matplotlib: only here, and only when a report is drawn

    report.write_run_report(rec, log_to_mlflow=True)


def _end_if_running() -> None:
    """The trainer is gone without releasing its run: the run ends FAILED."""
    _stop_monitor(wait_s=0.0)  # its thread ends with this process
    if not _watched:
        return
    uri, run_id = _watched["uri"], _watched["run_id"]
    if uri.startswith(("http://", "https://")):  # MLflow's own client would retry for minutes
        try:
            backend.check_reachable(uri, timeout=5.0)
        except backend.TrackingUnavailable as err:
            log.warning("trainer gone; %s: MLflow run %s stays RUNNING", first_line(err), run_id)
            return
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "1"
    if client(uri).get_run(run_id).info.status == "RUNNING":
        client(uri).set_terminated(run_id, "FAILED")
        log.warning("the training process ended without ending MLflow run %s: it ends FAILED%s", run_id, _limit_hint())


def _limit_hint() -> str:
    """Under `ulimit -v` / `-d` (inherited from the trainer), the likely cause of a trainer that
    vanished: XLA aborts the process when a native allocation or a thread fails there."""
    limits = address_limits()
    if not limits:
        return ""
    name, gib = limits[0]
    return (f" (it ran under {name} = {gib:.2f} GiB, where XLA aborts the process when an "
            "allocation fails: raise the limit or choose a smaller model or batch)")


def main() -> None:
    for signum in STOP_SIGNALS:  # Slurm signals every process of a job: the trainer answers them
        signal.signal(signum, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "wb")   # the pipe to the trainer; stdout itself becomes stderr,
    os.dup2(2, 1)                           # so nothing MLflow prints can corrupt a reply
    requests = sys.stdin.buffer
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="[%(name)s] %(message)s")
    # what MLflow prints here ("View run … at: <uri with password>") reaches the job's output
    # without passing through the trainer's masking: mask it here the same way
    secrets.guard_output()
    while (message := _receive(requests)) is not None:
        module, name, args, new_secrets = message
        secrets.remember(new_secrets)
        try:
            reply = (True, getattr(importlib.import_module(module), name)(*args))
        except Exception as err:  # noqa: BLE001 — every error is the caller's to handle
            reply = (False, secrets.mask(f"{type(err).__name__}: {first_line(err)}"))
        try:
            _send(replies, reply)
        except OSError:  # the trainer is gone (it does not wait for every reply)
            break
    _end_if_running()
    sys.stderr.flush()
    os._exit(0)  # MLflow's teardown takes most of a second, and whoever reads our stderr waits for it


if __name__ == "__main__":  # run the imported module's main: calls find their functions (and `_watched`) there
    importlib.import_module("marin.track.worker").main()
