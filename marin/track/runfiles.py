"""A run's state, step and latest metrics read from its directory alone (record.json,
metrics.jsonl, the saved resolved configs): what `marin.status`, `marin.diff` and `marin.lineage`
list without importing MLflow (about 2 s of start-up) or opening the store.

The directory is the run's own record (marin.track.tracker: every metric goes to metrics.jsonl
before the store; `finish` writes the final status into record.json), so these agree with the
MLflow run once it has been sent. A run still running has no status in record.json: RUNNING;
one whose trainer was killed before `finish` (marin.track.runlock.trainer_gone: a local run
whose process is gone; a Slurm run's job is judged by Slurm, in marin.status) is FAILED, as the
tracking process ends its MLflow run, or the catch-up when that process died too. A FINISHED run whose last step is short of its horizon was stopped
(`train.stop_after`): STOPPED, as marin.track.runstate shows it from the store.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from marin.track import runlock

INFO, RESOLVED, METRICS = "record.json", "resolved.yaml", "metrics.jsonl"  # as record / tracker name them
LOSS = "train/loss"


# record.json's fields that tools read, and the type each must have when present (None: not set)
INFO_TYPES = {"run_id": str, "tracking_uri": str, "experiment": str, "experiment_id": str, "name": str,
              "status": str, "status_unsent": str, "resumes": list, "slurm_jobs": list, "overrides": list,
              "restarts": int, "git": dict, "seeds": dict, "init_from": dict, "parent_run_id": str}


def info_problem(info) -> str | None:
    """What is wrong with a record.json's content, in a few words (None: nothing)."""
    if not isinstance(info, dict):
        return f"a {type(info).__name__}, not a JSON object"
    for key, kind in INFO_TYPES.items():
        value = info.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return f"{key} must be a {kind.__name__}, not {value!r:.60}"
    if any(not isinstance(entry, dict) for entry in info.get("resumes") or []):
        return "resumes must be a list of objects"
    return None


def _well_typed(info) -> dict:
    """The fields of a record.json that have their type (a list shows a damaged run's other fields;
    opening the run names what is wrong)."""
    if not isinstance(info, dict):
        return {}
    return {k: v for k, v in info.items() if not info_problem({k: v})}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}


def json_lines(path: Path) -> list:
    """The values of a JSON-lines file that parse (a line cut short by a crash, or damaged, is
    skipped); [] when the file is missing or unreadable."""
    try:
        lines = path.read_text().splitlines() if path.is_file() else []
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except (ValueError, RecursionError):
            continue
    return out


def latest(run_dir: Path, keys=None) -> dict[str, tuple[int, float]]:
    """{key: (step, value)} of each metric's highest step in metrics.jsonl (a cut line skipped)."""
    out: dict = {}
    for row in json_lines(Path(run_dir) / METRICS):
        try:
            key, step = row["key"], int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if (keys is None or key in keys) and step >= out.get(key, (-1, None))[0]:
            out[key] = (step, row["value"])
    return out


def horizon(run_dir: Path, info: dict | None = None) -> int | None:
    """The run's last step: of its newest resolved config (a resume's resolved.resume-N.yaml, where
    it may have moved the horizon; else resolved.yaml): `schedule.horizon_steps` or `train.steps`."""
    info = read_json(Path(run_dir) / INFO) if info is None else info
    names = [entry.get("resolved") for entry in info.get("resumes") or [] if isinstance(entry, dict)]
    for name in [*reversed([n for n in names if n]), RESOLVED]:
        try:
            cfg = yaml.safe_load((Path(run_dir) / name).read_text()) or {}
        except (OSError, yaml.YAMLError, RecursionError):
            continue
        for group, key in (("schedule", "horizon_steps"), ("train", "steps")):
            value = (cfg.get(group) or {}).get(key)
            if isinstance(value, int):
                return value
        return None
    return None


@dataclass
class RunFiles:
    """One run as its directory tells it."""
    run_dir: Path
    run_id: str
    state: str                  # RUNNING, FINISHED, STOPPED, FAILED, KILLED
    step: int | None            # the last logged train/loss step
    total: int | None           # the horizon
    info: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)  # {key: (step, value)}

    def value(self, key: str) -> float | None:
        return self.metrics[key][1] if key in self.metrics else None

    @property
    def slurm_jobs(self) -> list[str]:
        return [str(j) for j in self.info.get("slurm_jobs") or []]


def read(run_dir: str | Path) -> RunFiles:
    run_dir = Path(run_dir)
    info = _well_typed(read_json(run_dir / INFO))
    metrics = latest(run_dir)
    step = metrics[LOSS][0] if LOSS in metrics else None
    total = horizon(run_dir, info)
    status = info.get("status") or ("FAILED" if not info.get("slurm_jobs") and runlock.trainer_gone(run_dir)
                                    else "RUNNING")
    if status == "FINISHED" and step is not None and total is not None and step < total:
        status = "STOPPED"
    return RunFiles(run_dir, info.get("run_id", "?"), status, step, total, info, metrics)
