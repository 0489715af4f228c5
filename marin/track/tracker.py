"""Logging a running job to its MLflow run, robust to the tracking server going away.

Metrics are buffered and sent in batches (`MlflowClient.log_batch`, no fluent global state, so
several runs can live in one process). If the store does not answer, training goes on: the
metrics stay in memory, one warning is printed, and sending is retried with a growing pause;
`finish` tries once more and, failing that, leaves them in ``unsent_metrics.jsonl`` in the run
directory (`python -m marin.track.tracker <run dir>` sends them later, and the run's final
status with them). Every logged metric also goes to ``metrics.jsonl`` in the run directory, so a
copied run directory carries its own history (`verify=true` compares against it where the MLflow
run cannot be reached). Only process 0 logs.

Every run ends FINISHED, FAILED or KILLED, never left RUNNING: `finish` at the loop's end,
`end_if_running` when set-up crashes before the loop. A status the store did not take is kept in
record.json as ``status_unsent`` and sent with the unsent metrics.
"""
from __future__ import annotations

import io
import json
import logging
import sys
import time
from pathlib import Path

from marin.track import backend, record as run_record, secrets, sweep

log = logging.getLogger("marin.track")

UNSENT = "unsent_metrics.jsonl"
METRICS = "metrics.jsonl"  # every logged metric, one JSON object a line (key, value, step, timestamp)
STATUSES = ("FINISHED", "FAILED", "KILLED")


class Tracker:
    """`log_metrics`, `log_text`, `log_artifact`, `set_tags`, `finish` for one run; no-ops on
    processes other than 0. Usable as a context manager (an exception finishes it FAILED)."""

    def __init__(self, record: run_record.RunRecord, process_index: int = 0, flush_every_s: float = 5.0):
        self.record = record
        self.enabled = process_index == 0 and record is not None
        self.flush_every_s = flush_every_s
        self.finished = False
        if not self.enabled:
            return
        self._client = backend.client(record.tracking_uri)
        self._pending: list = []          # mlflow Metric objects not yet sent
        self._pending_tags: dict = {}
        self._last_flush = time.monotonic()
        self._retry_at = 0.0
        self._pause = self._first_pause = max(flush_every_s, 5.0)  # seconds before a retry; doubles
        self._outage = False
        self._warned_values = False
        self._local = None                # metrics.jsonl, opened at the first metric (appended on resume)
        if self._call(lambda: self._client.update_run(record.run_id, status="RUNNING")):  # resumed runs reopen
            if record.info().get("status_unsent"):  # an earlier attempt's status, superseded
                run_record.update_info(record, status_unsent=None)

    # ------------------------------------------------------------------ logging
    def log_metrics(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in metrics.items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                if not self._warned_values:
                    log.warning("metric %s=%r is not a number: not logged", key, value)
                    self._warned_values = True
                continue
            self._pending.append(Metric(str(key), value, now, int(step)))
            self._keep_local(str(key), value, now, int(step))
        if len(self._pending) >= 1000 or time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def _keep_local(self, key: str, value: float, timestamp: int, step: int) -> None:
        if self._local is None:
            try:
                self._local = (self.record.run_dir / METRICS).open("a")
            except OSError as err:  # no run directory here: MLflow still has them
                log.warning("cannot keep metrics in %s (%s)", self.record.run_dir / METRICS, err)
                self._local = False
        if self._local:
            self._local.write(json.dumps({"key": key, "value": value, "step": step, "timestamp": timestamp}) + "\n")

    def set_tags(self, tags: dict) -> None:
        if not self.enabled:
            return
        for k, v in tags.items():  # a secret-named tag is remembered, so its value is masked everywhere
            if secrets.looks_secret(str(k)):
                secrets.remember(v)
        self._pending_tags.update({str(k): secrets.REDACTED if secrets.looks_secret(str(k)) else secrets.mask(str(v))
                                   for k, v in tags.items()})
        self.flush()

    def log_text(self, name: str, text: str) -> None:
        """A text artifact (e.g. the plan, a summary); kept in the run directory if MLflow fails."""
        if not self.enabled:
            return
        text = secrets.mask(text)
        if not self._call(lambda: self._client.log_text(self.record.run_id, text, name)):
            path = self.record.run_dir / "unsent_artifacts" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        self._call(lambda: self._client.log_artifact(self.record.run_id, str(path), artifact_path))

    def log_device_info(self) -> dict:
        """JAX version and devices, into record.json and the run's tags (call after JAX is up)."""
        info = device_info()
        self.record_devices(info)
        return info

    def record_devices(self, info: dict) -> None:
        if self.enabled:
            run_record.update_info(self.record, devices=info)
            self.set_tags({f"jax.{k}": v for k, v in info.items()})

    def update_info(self, **fields) -> None:
        """Merge fields into the run's record.json (one writer: the tracker's process)."""
        if self.enabled:
            run_record.update_info(self.record, **fields)

    def report(self) -> None:
        """The run's HTML report (marin/report.py) into its directory and MLflow; never fails the run."""
        if self.enabled:
            write_report(self.record)

    def draw_report(self) -> None:
        """Draw the report's figures ahead of `report`: nothing to gain in this process (the
        companion's tracker does it while the training process runs the final eval)."""

    # ------------------------------------------------------------------ sending
    def flush(self, force: bool = False) -> bool:
        """Send what is pending; True when nothing is left. Skipped during an outage's pause."""
        if not self.enabled:
            return True
        if self._local:
            self._local.flush()
        if not (self._pending or self._pending_tags):
            return True
        if not force and time.monotonic() < self._retry_at:
            return False
        self._last_flush = time.monotonic()
        try:
            if self.record.tracking_uri.startswith(("http://", "https://")):
                backend.check_reachable(self.record.tracking_uri, timeout=2.0)  # fail fast, not after retries
            self._send()
        except Exception as err:  # the store is away: keep everything, warn once, retry later
            self._away(err)
            return False
        if self._outage:
            log.info("tracking store answers again; buffered metrics sent")
        self._outage, self._pause = False, self._first_pause
        return True

    def _send(self) -> None:
        from mlflow.entities import RunTag
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

        if self._pending_tags:
            tags = [RunTag(k, v) for k, v in self._pending_tags.items()]
            for start in range(0, len(tags), MAX_PARAMS_TAGS_PER_BATCH):
                self._client.log_batch(self.record.run_id, tags=tags[start:start + MAX_PARAMS_TAGS_PER_BATCH])
            self._pending_tags = {}
        while self._pending:
            chunk = self._pending[:MAX_METRICS_PER_BATCH]
            self._client.log_batch(self.record.run_id, metrics=chunk)
            del self._pending[:len(chunk)]  # only what was sent

    def _away(self, err: Exception) -> None:
        if not self._outage:
            log.warning("tracking store %s does not answer (%s); training goes on, metrics are kept "
                        "and sent when it answers", backend.safe_uri(self.record.tracking_uri),
                        secrets.mask(_first_line(err)))
        self._outage = True
        self._retry_at = time.monotonic() + self._pause
        self._pause = min(self._pause * 2, 300.0)

    def _call(self, fn) -> bool:
        """One immediate call (text, artifact, status); a failure is warned about, never raised."""
        try:
            if self.record.tracking_uri.startswith(("http://", "https://")):
                backend.check_reachable(self.record.tracking_uri, timeout=2.0)
            fn()
            return True
        except backend.TrackingUnavailable as err:
            self._away(err)
        except Exception as err:
            log.warning("tracking call failed (%s); continuing", secrets.mask(_first_line(err)))
        return False

    # ------------------------------------------------------------------ end
    def finish(self, status: str = "FINISHED") -> None:
        """Send what is left, end the run with `status`, and close the sweep's parent if this was
        its last job. Metrics that cannot be sent are left in the run directory."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
        if not self.enabled or self.finished:
            return
        self.finished = True
        if not self.flush(force=True):
            self._spill()
        if self._local:
            self._local.close()
        self._local = None
        ended = self._call(lambda: self._client.set_terminated(self.record.run_id, status))
        run_record.update_info(self.record, status=status, ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               status_unsent=None if ended else status)
        if ended:
            self._call(self._close_parent)
        else:
            log.warning("MLflow run %s still shows RUNNING: the store did not take its status %s; "
                        "send it later with: python -m marin.track.tracker %s", self.record.run_id, status,
                        self.record.run_dir)

    def _close_parent(self) -> None:
        parent_id = self._client.get_run(self.record.run_id).data.tags.get("mlflow.parentRunId")
        if parent_id:
            sweep.close_if_done(self._client, parent_id)

    def _spill(self) -> None:
        path = self.record.run_dir / UNSENT
        with path.open("a") as out:
            for m in self._pending:
                out.write(json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}) + "\n")
        log.warning("%d metrics could not be sent; kept in %s (send later: python -m marin.track.tracker %s)",
                    len(self._pending), path, self.record.run_dir)
        self._pending = []

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(kind, KeyboardInterrupt) else "FAILED")


def device_info() -> dict:
    import jax

    devices = jax.devices()
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device_count": len(devices),
            "local_device_count": jax.local_device_count(), "device_kind": devices[0].device_kind,
            "process_count": jax.process_count()}


def write_report(rec) -> None:
    try:
        from marin import report

        report.write_run_report(rec, log_to_mlflow=True)
    except Exception as err:  # a report is a convenience: the run's outcome stands without it
        log.warning("run report not written (%s: %s)", type(err).__name__, secrets.mask(_first_line(err)))


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


# ---------------------------------------------------------------------------- through the companion

class RemoteTracker:
    """The Tracker of a local run whose MLflow run the tracking companion makes and logs
    (marin.track.companion): the same calls, sent down a pipe, so MLflow never runs in the
    training process. Nothing is lost if the companion dies: the calls it has not confirmed sent
    to the store are kept (`_journal`) and replayed into an in-process Tracker, which takes over."""

    def __init__(self, companion, pending: run_record.PendingRecord, flush_every_s: float = 5.0):
        self.record, self.enabled, self.finished = pending, True, False
        self._companion = companion
        self._journal: list = []      # (method, args, kwargs) not yet confirmed sent
        self._sent_before = 0         # calls before the journal's first, all confirmed
        self._flushes: list = []      # (calls up to here, future of the companion's flush)
        self._flush_every_s, self._last_flush = flush_every_s, time.monotonic()
        self._local: Tracker | None = None
        companion.call(warm_report)  # after making the run, while this process compiles

    def _do(self, method: str, *args, **kwargs):
        if self._local is None and not self._companion.alive:
            self._take_over()
        if self._local is not None:
            return getattr(self._local, method)(*args, **kwargs)
        self._journal.append((method, args, kwargs))
        return self._companion.call(serve, method, *args, **kwargs)

    def log_metrics(self, metrics: dict, step: int) -> None:
        self._do("log_metrics", {str(k): _plain(v) for k, v in metrics.items()}, int(step))
        if time.monotonic() - self._last_flush >= self._flush_every_s:
            self.flush()

    def set_tags(self, tags: dict) -> None:
        self._do("set_tags", {str(k): str(v) for k, v in tags.items()})

    def log_text(self, name: str, text: str) -> None:
        self._do("log_text", name, text)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self._do("log_artifact", str(path), artifact_path)

    def log_device_info(self) -> dict:
        info = device_info()
        self._do("record_devices", info)
        return info

    def update_info(self, **fields) -> None:
        self._do("update_info", **fields)

    def flush(self, force: bool = False) -> bool:
        """Ask the companion to send what it holds; what it confirms leaves the journal."""
        self._last_flush = time.monotonic()
        self._forget_confirmed()
        result = self._do("flush", force)
        if self._local is not None:
            return result
        self._flushes.append((self._sent_before + len(self._journal), result))
        return True

    def _forget_confirmed(self) -> None:
        while self._flushes and self._flushes[0][1].done():
            upto, future = self._flushes.pop(0)
            if future.exception() is None and future.result():
                del self._journal[:upto - self._sent_before]
                self._sent_before = upto

    def finish(self, status: str = "FINISHED") -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
        if self.finished:
            return
        self.finished = True
        try:
            self.record.ready()
        except run_record.RunNotMade:
            return  # no run to end (and no directory left)
        if self._local is None:
            from marin.track.companion import CompanionError

            try:
                self._companion.call(serve, "finish", status).result()
                return
            except CompanionError as err:
                if self._companion.alive:  # it answered: its own warning said what went wrong
                    log.warning("tracking companion could not end the run (%s)", err)
                    return
                self._take_over()
        self._local.finish(status)

    def report(self) -> None:
        """The run's report, drawn in the companion (it has MLflow and matplotlib loaded)."""
        if not self.record.is_made:
            return
        if self._local is not None:
            return self._local.report()
        from marin.track.companion import CompanionError

        try:
            self._companion.call(serve, "report").result()
        except CompanionError as err:
            log.warning("run report not written (%s)", err)

    def draw_report(self) -> None:
        """The companion draws the report's figures now, while this process runs the final eval."""
        if self._local is None and self.record.is_made:
            self._companion.call(draw_served_report)

    def close(self) -> None:
        self._companion.close()

    def _take_over(self) -> None:
        """The companion is gone: an in-process Tracker replays what it did not confirm sent."""
        log.warning("the tracking companion process ended; tracking goes on in the training process")
        rec = self.record.ready()  # made here if the companion died before making it
        self._local = Tracker(rec)
        journal, self._journal, self._flushes = self._journal, [], []
        for method, args, kwargs in journal:
            getattr(self._local, method)(*args, **kwargs)


def _plain(value):
    """A float where it is a number (a device scalar would need JAX to unpickle); else as it is,
    for the companion's Tracker to refuse with its warning."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def create_in(companion, composed, resolved, overrides: list[str]) -> run_record.PendingRecord:
    """`record.create`, with the MLflow run made by the tracking companion (marin.track.companion)
    while this process goes on; `PendingRecord.ready()` waits for it, and the companion keeps a
    Tracker for the run (`RemoteTracker` talks to it)."""
    draft = run_record.prepare(composed, resolved, overrides)
    return run_record.PendingRecord(draft, companion.call(open_served_run, draft), companion)


# In the companion process: the run it makes for the training process, and that run's Tracker.
_served: dict = {}


def open_served_run(draft) -> run_record.RunRecord:
    """(In the companion) make the run of a prepared directory and keep a Tracker for it."""
    from marin.track import companion

    run_record.attach_log(draft)  # the companion's lines go to the run's run.log too
    rec = run_record.register(draft)
    _served["tracker"] = Tracker(rec)
    companion.when_orphaned(_orphaned)
    return rec


def warm_report() -> None:
    """(In the companion) load matplotlib and its fonts before the run's end needs them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(1, 1))
    FigureCanvasAgg(figure)
    figure.subplots().plot([0, 1], [0, 1], label="warm")
    figure.savefig(io.BytesIO(), format="png")
    import marin.report  # noqa: F401


def serve(method: str, *args, **kwargs):
    """(In the companion) one Tracker call of the training process."""
    tracker = _served.get("tracker")
    if tracker is None:
        raise RuntimeError("the run was not made (see the error of its creation)")
    return getattr(tracker, method)(*args, **kwargs)


def draw_served_report() -> None:
    """(In the companion) draw the run's figures as the metrics stand; `report` then redraws only
    the ones whose data changed (marin.report keeps drawn figures). Never fails the run."""
    tracker = _served["tracker"]
    try:
        from marin import report

        tracker.flush(force=True)
        report.run_page(tracker.record, tracker._client)
    except Exception as err:  # noqa: BLE001 — `report` draws it all again
        log.debug("report figures not drawn ahead (%s)", err)


def _orphaned() -> None:
    tracker = _served.get("tracker")
    if tracker is not None and not tracker.finished:
        log.warning("the training process ended without ending MLflow run %s: it ends FAILED", tracker.record.run_id)
        tracker.finish("FAILED")


def end_if_running(record: run_record.RunRecord, status: str) -> None:
    """End a run that is still RUNNING with `status` (FAILED, KILLED): the loop's set-up (mesh,
    restore, compilation) crashed before its tracker could. Never raises; a store that does not
    answer gets the status later with the unsent metrics."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
    try:
        if record.tracking_uri.startswith(("http://", "https://")):
            backend.check_reachable(record.tracking_uri, timeout=2.0)
        client = backend.client(record.tracking_uri)
        if client.get_run(record.run_id).info.status != "RUNNING":
            return  # already ended (the loop's tracker did)
        client.set_terminated(record.run_id, status)
        sent = True
    except Exception as err:  # noqa: BLE001 — a crash is already being reported; do not mask it
        log.warning("could not end MLflow run %s as %s (%s); kept in record.json", record.run_id, status,
                    _first_line(err))
        sent = False
    try:
        run_record.update_info(record, status=status, ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               status_unsent=None if sent else status)
    except OSError as err:
        log.warning("could not update %s (%s)", record.path(run_record.INFO), _first_line(err))


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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m marin.track.tracker <run directory or MLflow run id>")
    print(f"sent {send_unsent(run_record.open(sys.argv[1]))} metrics")
