"""Logging a running job to its MLflow run, without ever making the training loop wait on it.

Every call is cheap for the caller: metrics go to ``metrics.jsonl`` in the run directory at once
(the run's own record, which survives any tracking outage; `verify=true` compares against it where
the MLflow run cannot be reached) and onto a queue. ONE daemon thread sends them in batches every
`flush_every_s` and makes the other calls, in order, through the tracking process
(marin.track.worker), where MLflow is imported and its store opened, off this process's CPU. If
the store does not answer (or the tracking process dies), training goes on: the metrics stay
queued, one warning is printed, and sending is retried with a growing pause (on a fresh tracking
process); a frozen store blocks only that thread. `finish` waits a bounded time for it and leaves
what was not sent in ``unsent_metrics.jsonl`` (`python -m marin.track.tracker <run dir>` sends them
later, and the run's final status with them). Only process 0 logs.

Every run ends FINISHED, FAILED or KILLED, never left RUNNING: `finish(status)`, and if the
process is killed outright, the tracking process ends it FAILED. A status the store did not take
is kept in record.json as ``status_unsent``.
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from marin.config.store import shell_join
from marin.track import backend, runlock, secrets, worker
from marin.track import record as run_record
from marin.track.errors import first_line

log = logging.getLogger("marin.track")

SYSTEM_METRICS_S = 10.0   # seconds between samples of the machine's CPU/GPU/memory (tracking.system_metrics)
UNSENT = "unsent_metrics.jsonl"
METRICS = "metrics.jsonl"  # every logged metric, one JSON object a line (key, value, step, timestamp)
STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow's UI draws a run's charts in sections (a metric's name up to its last "/") sorted by code
# point: bookkeeping (time spent, data read, checkpoint markers) is filed under usage/ so that the
# train/ and eval/ sections come first. Loggers use the short names; the run records these.
BOOKKEEPING, BOOKKEEPING_PREFIX = ("time/", "data/", "checkpoint/"), "usage/"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, in order ([] if it has none)."""
    return metric_rows(Path(run_dir) / METRICS)


def metric_rows(path: Path) -> list[dict]:
    """The metric rows of a metrics.jsonl file, in order. A line that is not one (a dict with a str
    `key`, an int `step` and a number `value`) is left out: the last one silently (a write cut short
    by a crash), others with one warning naming the file, not a traceback in the tool reading it."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    rows, bad = [], []
    for number, line in enumerate(lines, 1):
        if line.strip():
            row = _metric_row(line)
            if row is None:
                bad.append(number)
            else:
                rows.append(row)
    if bad and bad != [len(lines)]:
        log.warning("%s: %d line(s) left out, not a metric row (a JSON object with key, step, value): line %s",
                    path, len(bad), ", ".join(map(str, bad[:5])))
    return rows


def forget_after(run_dir: str | Path, step: int) -> int:
    """Drop the rows past `step` from metrics.jsonl and from the rows kept for MLflow's catch-up
    (unsent_metrics.jsonl): a resume from checkpoint `step` logs the later steps again, and a run
    killed after that checkpoint had logged them once already. Returns how many metrics.jsonl rows
    went. The files are rewritten whole and renamed into place (a kill meanwhile leaves the old one)."""
    dropped = 0
    for name in (METRICS, UNSENT):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        text, rows = path.read_text(errors="replace"), metric_rows(path)
        kept = [r for r in rows if r["step"] <= step]
        if not text or (len(kept) == len(text.splitlines()) and text.endswith("\n")):
            continue   # nothing past `step`, no line cut short (the next row would be appended to it)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)
        dropped += (len(rows) - len(kept)) if name == METRICS else 0
    return dropped


def _metric_row(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if (isinstance(row, dict) and isinstance(row.get("key"), str) and number(row.get("value"))
            and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)):
        return row
    return None


def catch_up_command(run_dir: str | Path) -> str:
    """The command that sends what a run kept (`python -m marin.track.tracker <run dir>`), quoted
    for the shell: it is printed to be pasted, and a run directory comes from `run.out_dir` and
    `run.name`, which may hold `$(…)`, spaces or quotes."""
    return shell_join(["python", "-m", "marin.track.tracker", str(run_dir)])


def tracked_name(key: str) -> str:
    """The name a metric is recorded under: `time/eval_s` → `usage/time/eval_s`; others as given."""
    return BOOKKEEPING_PREFIX + key if key.startswith(BOOKKEEPING) else key


_STOP = object()  # the sender thread's last job


class Tracker:
    """`log_metrics`, `log_text`, `log_artifact`, `set_tags`, `update_info`, `finish`, `report`
    for one run; no-ops on processes other than 0. `finish` (always: the trainer's one ending)
    must come last; until it does, the tracking process watches the run."""

    end_timeout_s = 30.0      # how long `finish` waits for the sender (a frozen store) before spilling
    report_timeout_s = 300.0

    def __init__(self, record, process_index: int = 0, flush_every_s: float = 5.0, run_dir: Path | None = None,
                 system_metrics_s: float | None = None, report: bool = True):
        # `record`: a RunRecord, or the Future of one (a new local run's MLflow run, being made by the
        # tracking process while JAX starts; `run_dir` is its directory, there already): calls are
        # taken at once and sent once it exists. If it cannot be made, they are dropped.
        # `system_metrics_s`: the tracking process samples this machine's use every that many
        # seconds into the run (`system/…`, MLflow's monitor); None: not at all. `report`: whether
        # `report` draws the run's page (tracking.report).
        self._record = record
        self.draws_report = report
        self.system_metrics_s = system_metrics_s
        self._watching = False            # the tracking process watches the run (a fresh one is told again)
        self.enabled = process_index == 0 and record is not None
        self.run_dir = Path(run_dir) if run_dir is not None else getattr(record, "run_dir", None)
        self.flush_every_s = max(flush_every_s, 0.05)
        self.finished = False
        if not self.enabled:
            return
        self._lock = threading.Lock()     # _metrics, _tags, _abandoned: shared with the sender
        self._metrics: list[tuple] = []   # (key, value, timestamp, step) not yet sent
        self._tags: dict = {}
        self._abandoned = False           # finish gave up on a frozen sender: it must touch nothing
        self._retry_at, self._pause = 0.0, max(flush_every_s, 5.0)
        self._first_pause, self._outage, self._warned_values = self._pause, False, False
        self._worker = None
        self._local = None                # metrics.jsonl, opened at the first metric (appended on resume)
        self._jobs: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._serve, name="marin-tracker", daemon=True)
        self._sender.start()
        self._jobs.put(self._reopen)
        if report:
            self._jobs.put(lambda: self._attempt_quietly(worker.warm_report))  # the report's imports, early

    # ------------------------------------------------------------------ the caller's side
    def log_metrics(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        now = int(time.time() * 1000)
        rows = []
        for key, value in metrics.items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                if not self._warned_values:
                    log.warning("metric %s=%r is not a number: not logged", key, value)
                    self._warned_values = True
                continue
            rows.append((tracked_name(str(key)), value, now, int(step)))
        self._keep_local(rows)
        with self._lock:
            self._metrics.extend(rows)
            many = len(self._metrics) >= 1000
        if many:
            self._jobs.put(self._send)

    def _keep_local(self, rows) -> None:
        if self._local is None:
            try:
                self._local = (self.run_dir / METRICS).open("a")
            except OSError as err:  # no run directory here: MLflow still has them
                log.warning("cannot keep metrics in %s (%s)", self.run_dir / METRICS, err)
                self._local = False
        if self._local:
            self._local.writelines(json.dumps({"key": k, "value": v, "step": s, "timestamp": t}) + "\n"
                                   for k, v, t, s in rows)
            self._local.flush()  # one write a call: a SIGKILL loses no step the store may lack

    def set_tags(self, tags: dict) -> None:
        if not self.enabled:
            return
        for k, v in tags.items():  # a secret-named tag is remembered, so its value is masked everywhere
            if secrets.looks_secret(str(k)):
                secrets.remember(v)
        with self._lock:
            self._tags.update({str(k): secrets.REDACTED if secrets.looks_secret(str(k)) else secrets.mask(str(v))
                               for k, v in tags.items()})
        self._jobs.put(self._send)

    def log_text(self, name: str, text: str) -> None:
        """A text artifact (e.g. the plan, a summary); kept in the run directory if MLflow fails."""
        if not self.enabled:
            return
        text = secrets.mask(text)

        def keep() -> None:  # mode 0600, as every run file that can hold what masking missed
            path = self.run_dir / "unsent_artifacts" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            secrets.write_private(path, text)

        self._jobs.put(lambda: self._attempt(worker.log_text, text, name) or keep())

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._jobs.put(lambda: self._attempt(worker.log_artifact, str(path), artifact_path))

    def log_device_info(self) -> dict:
        """JAX version and devices, into record.json and the run's tags (call after JAX is up)."""
        info = device_info()
        if self.enabled:
            self.update_info(devices=info)
            self.set_tags({f"jax.{k}": v for k, v in info.items()})
        return info

    def update_info(self, **fields) -> None:
        """Merge fields into the run's record.json (a local file: written at once, or once the
        run's record exists)."""
        if not self.enabled:
            return
        if isinstance(self._record, Future) and not self._record.done():
            self._jobs.put(lambda: self.update_info(**fields))
            return
        if self.not_made:  # no record to write into: the trainer stops at its first step (RunNotMade)
            return
        with _INFO_LOCK:
            run_record.update_info(self.record, **fields)

    @property
    def record(self) -> run_record.RunRecord:
        """The run's record (waits for a pending one; raises what making it raised)."""
        if isinstance(self._record, Future):
            self._record = self._record.result()
        return self._record

    @property
    def not_made(self) -> bool:
        """A pending record that could not be made: nothing is sent, the caller stops."""
        return isinstance(self._record, Future) and self._record.done() and self._record.exception() is not None

    def flush(self, timeout: float | None = None) -> bool:
        """Have the sender send what is queued now (past any outage pause); with `timeout`, wait
        that long for it. True when nothing is left unsent."""
        if not self.enabled:
            return True
        if self._local:
            self._local.flush()
        done = threading.Event()
        self._jobs.put(lambda: (self._send(force=True), done.set()))
        if timeout is not None:
            done.wait(timeout)
        with self._lock:
            return not (self._metrics or self._tags)

    def finish(self, status: str | None = "FINISHED") -> None:
        """Send what is left, end the run with `status` (None: leave it RUNNING for a requeued
        job), close the sweep's parent if this was its last job, and stop watching the run.
        What cannot be sent within `end_timeout_s` is left in the run directory."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
        if not self.enabled or self.finished:
            return
        self.finished = True
        if isinstance(self._record, Future):
            try:
                self._record.result(timeout=self.end_timeout_s)
            except Exception:  # noqa: BLE001 — no run was made (or none in time): nothing to end
                if self._local:
                    self._local.close()
                self._local = None
                return
        ended, done = [], threading.Event()

        def end() -> None:
            if self._send(force=True) and status is not None:
                if self._attempt(worker.end, status):
                    ended.append(True)
            done.set()

        self._jobs.put(end)
        if not done.wait(self.end_timeout_s):
            log.warning("tracking store %s did not answer within %.0f s", secrets.safe_uri(self.record.tracking_uri),
                        self.end_timeout_s)
        with self._lock:
            self._abandoned, left, self._metrics = not done.is_set(), self._metrics, []
        if left:
            self._spill(left)
        if self._local:
            self._local.close()
        self._local = None
        if status is not None:
            self.update_info(status=status, ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             status_unsent=None if ended else status)
            if not ended:
                log.warning("MLflow run %s still shows RUNNING: the store did not take its status %s; "
                            "send it later with: %s", self.record.run_id, status, catch_up_command(self.run_dir))
        if done.is_set():  # ended, left open on purpose, or its status kept unsent: no longer watched
            self._watching = False
            self._attempt_quietly(worker.release)
        elif self._worker is not None:
            self._worker.kill()  # stuck on the store: what it did not send is in the run directory

    def report(self) -> None:
        """The run's HTML report (marin/report.py) into its directory and MLflow, drawn by the
        sender after `finish` (unless tracking.report is off); never fails the run, and skipped when
        the store did not answer."""
        if not self.enabled or self._abandoned or self.not_made:
            return
        done = threading.Event()
        self._jobs.put(lambda: (self.draws_report and self._report(), done.set()))
        self._jobs.put(_STOP)
        done.wait(self.report_timeout_s)

    def _spill(self, rows) -> None:
        path = self.run_dir / UNSENT
        with path.open("a") as out:
            out.writelines(json.dumps({"key": k, "value": v, "timestamp": t, "step": s}) + "\n" for k, v, t, s in rows)
        log.warning("%d metrics could not be sent; kept in %s; send them later with: %s",
                    len(rows), path, catch_up_command(self.run_dir))

    # ------------------------------------------------------------------ the sender thread
    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.flush_every_s)
            except queue.Empty:
                job = self._send
            if job is _STOP:
                return
            if self.not_made:
                continue  # the trainer stops at its next step
            try:
                job()
            except Exception as err:  # noqa: BLE001 — the sender must outlive any one call
                log.warning("tracking call failed (%s); continuing", secrets.mask(first_line(err)))

    def _reopen(self) -> None:
        """A resumed run is RUNNING again; a status an earlier attempt left unsent is superseded."""
        self._watching = self._attempt(worker.watch, self.system_metrics_s)
        if self._attempt(worker.reopen):
            with _INFO_LOCK:
                if self.record.info().get("status_unsent"):
                    run_record.update_info(self.record, status_unsent=None)

    def _send(self, force: bool = False) -> bool:
        """Send the queued tags and metrics; True when nothing is left. Skipped during an outage's pause."""
        if not force and time.monotonic() < self._retry_at:
            return False
        try:
            self._connect()
            with self._lock:
                tags, self._tags = self._tags, {}
                metrics = [] if self._abandoned else self._metrics[:10_000]
            try:
                self._call(worker.log_batch, metrics, tags)
            except BaseException:
                with self._lock:
                    self._tags = tags | self._tags
                raise
            with self._lock:
                if not self._abandoned:
                    del self._metrics[:len(metrics)]  # only what was sent
                left = bool(self._metrics)
            if left:
                return self._send(force=True)
        except Exception as err:  # the store is away: keep everything, warn once, retry later
            self._away(err)
            return False
        if self._outage:
            log.info("tracking store answers again; queued metrics sent")
        self._outage, self._pause = False, self._first_pause
        return True

    def _connect(self) -> None:
        if self.record.tracking_uri.startswith(("http://", "https://")):
            backend.check_reachable(self.record.tracking_uri, timeout=2.0)  # fail fast, not after retries
        current = worker.Worker.get()  # a fresh one if the last one died
        if current is not self._worker and self._watching:
            # the one that died was watching the run: its successor must, or a trainer killed
            # from now on would leave the run RUNNING
            current.call(worker.watch, self.record.tracking_uri, self.record.run_id, self.system_metrics_s)
        self._worker = current

    def _attempt(self, fn, *args) -> bool:
        """One call `fn(uri, run_id, *args)` in the tracking process (text, artifact, status); a
        failure is warned about, never raised."""
        try:
            self._connect()
            self._call(fn, *args)
            return True
        except backend.TrackingUnavailable as err:
            self._away(err)
        except Exception as err:
            log.warning("tracking call failed (%s); continuing", secrets.mask(first_line(err)))
        return False

    def _call(self, fn, *args) -> None:
        """`fn(uri, run_id, *args)` in the tracking process; once more on a fresh one if it had died
        (killed with the job's processes, say): that is no outage of the store."""
        try:
            self._worker.call(fn, self.record.tracking_uri, self.record.run_id, *args)
        except worker.WorkerGone:
            log.warning("the tracking process ended; starting another")
            self._connect()
            self._worker.call(fn, self.record.tracking_uri, self.record.run_id, *args)

    def _attempt_quietly(self, fn) -> None:
        try:
            if self._worker is not None and self._worker.alive:
                self._worker.call(fn)
        except worker.WorkerError:
            pass

    def _report(self) -> None:
        """The run's HTML report, drawn in the tracking process; never fails the run."""
        try:
            self._connect()
            self._worker.call(worker.write_report, self.record)
        except Exception as err:  # a report is a convenience: the run's outcome stands without it
            log.warning("run report not written (%s); once the store answers: %s",
                        secrets.mask(first_line(err)), catch_up_command(self.run_dir))

    def _away(self, err: Exception) -> None:
        if not self._outage:
            log.warning("tracking store %s does not answer (%s); training goes on, metrics are kept "
                        "and sent when it answers", secrets.safe_uri(self.record.tracking_uri),
                        secrets.mask(first_line(err)))
        self._outage = True
        self._retry_at = time.monotonic() + self._pause
        self._pause = min(self._pause * 2, 300.0)


_INFO_LOCK = threading.Lock()  # record.json is read, merged and rewritten by both threads


def device_info() -> dict:
    import jax

    devices = jax.devices()
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device_count": len(devices),
            "local_device_count": jax.local_device_count(), "device_kind": devices[0].device_kind,
            "process_count": jax.process_count()}


def send_unsent(record: run_record.RunRecord) -> int:
    """Send what a run left in its directory when the store was away: its metrics, then its
    final status (the run shows RUNNING until then). Returns how many metrics were sent."""
    from mlflow.entities import Metric
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH

    client = backend.client(record.tracking_uri)
    path = record.run_dir / UNSENT
    sent = 0
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        metrics = [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in rows]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            client.log_batch(record.run_id, metrics=metrics[start:start + MAX_METRICS_PER_BATCH])
        path.rename(path.with_suffix(".sent"))
        sent = len(metrics)
    status = record.info().get("status_unsent")
    if status in STATUSES:
        client.set_terminated(record.run_id, status)
        run_record.update_info(record, status_unsent=None)
    return sent


def end_abandoned(record: run_record.RunRecord) -> int | None:
    """A run whose trainer was killed outright (SIGKILL, the OOM killer) while its tracking
    process could not end it (killed with it, or the store away then): send the metrics its
    MLflow run lacks (metrics.jsonl's rows past the last step the store has of each), then end it
    FAILED in MLflow and record.json. Returns how many were sent; None, with nothing done, for a
    run that ended or may still train (marin.track.runlock.trainer_gone)."""
    info = record.info()
    jobs = info.get("slurm_jobs") or []
    if info.get("status") or not runlock.trainer_gone(record.run_dir, jobs[-1] if jobs else None):
        return None
    from mlflow.entities import Metric
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH

    client = backend.client(record.tracking_uri)
    rows = read_metrics(record.run_dir)
    have = {key: max((m.step for m in client.get_metric_history(record.run_id, key)), default=-1)
            for key in {r["key"] for r in rows}}
    missing = [Metric(r["key"], r["value"], r.get("timestamp", 0), r["step"]) for r in rows if r["step"] > have[r["key"]]]
    for start in range(0, len(missing), MAX_METRICS_PER_BATCH):
        client.log_batch(record.run_id, metrics=missing[start:start + MAX_METRICS_PER_BATCH])
    if client.get_run(record.run_id).info.status == "RUNNING":
        client.set_terminated(record.run_id, "FAILED")
    run_record.update_info(record, status="FAILED", ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"), status_unsent=None)
    return len(missing)


def catch_up(record: run_record.RunRecord) -> tuple[int, Path | None, bool]:
    """Once the store is back: `send_unsent`, `end_abandoned`, then the report the run's end could
    not draw (it reads the metrics back from MLflow), unless the run had tracking.report=false.
    Returns (metrics sent, the report written or None, whether the run was ended FAILED)."""
    sent = send_unsent(record)
    abandoned = end_abandoned(record)
    sent += abandoned or 0
    if not record.resolved().tracking.report:
        return sent, None, abandoned is not None
    from marin.track import report  # matplotlib: only when a report is drawn

    if (record.run_dir / report.REPORT).is_file():
        return sent, None, abandoned is not None
    return sent, report.write_run_report(record), abandoned is not None


def main(argv: list[str] | None = None) -> int:
    """`python -m marin.track.tracker <run>`: send what a run kept while its store was away."""
    import argparse  # marin.cli's Parser is a tool's (a layer above): its one-line errors by hand

    parser = argparse.ArgumentParser(
        prog="python -m marin.track.tracker",
        description="Send what a run kept while its MLflow store did not answer (unsent_metrics.jsonl, its "
                    "final status; for a run whose trainer was killed outright, the metrics the store lacks and FAILED), "
                    "then draw the report its end could not. Exit 0 when sent; 1 when the store "
                    "still does not answer; 2 for a run that is not found.")
    parser.add_argument("run", help="the run: its directory, name, a unique prefix or MLflow run id")
    parser.add_argument("--tracking-uri", help="where to look an MLflow run id up (default: $MLFLOW_TRACKING_URI "
                        "or the project's)")
    parser.add_argument("--out-dir", help="where run names are looked up (default: the project's outputs/)")
    parser.error = lambda message: _fail(f"python -m marin.track.tracker: {message} (see --help)", 2)  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        rec = run_record.open(args.run, tracking_uri=args.tracking_uri, out_dir=args.out_dir)
    except run_record.RecordError as err:
        _fail(first_line(err), 2)
    try:
        backend.check_reachable(rec.tracking_uri)
        sent, drawn, abandoned = catch_up(rec)
    except Exception as err:  # noqa: BLE001 — the store away or refusing: one line, kept for next time
        _fail(f"{secrets.safe_uri(rec.tracking_uri)}: {first_line(err)}; nothing lost, run this again later", 1)
    print(f"sent {sent} metrics" + ("; the run's trainer was killed before it ended: FAILED" if abandoned else "")
          + (f"; report {drawn}" if drawn else ""))
    return 0


def _fail(message: str, code: int):
    print(f"error: {secrets.mask(message)}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
