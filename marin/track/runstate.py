"""A run's state and last step as every view shows them (`marin.status`, the report), from its
MLflow run: one reading, so they cannot disagree.

MLflow has no "stopped" status: a run that `train.stop_after` or `train.stop_at` (a lineage's
cutover) stopped ends FINISHED (its invocation went well) with the tag `ended` "stopped at step N of
M (…)" (marin.train.ending). It is shown
STOPPED until a resume finishes it. Its last step M is the run's horizon, never
`train.stop_after`: that param is the first invocation's and MLflow params cannot change, so a
resume with another stop_after (or none) would show N/stop_after.
"""
from __future__ import annotations


def state(status: str, tags: dict) -> str:
    """MLflow's status, or STOPPED for a FINISHED run whose last invocation stopped short."""
    if status == "FINISHED" and str(tags.get("ended", "")).startswith("stopped"):
        return "STOPPED"
    return status


def last_step(params: dict, tags: dict) -> int | None:
    """The run's last step M: the horizon a resume set (tag `horizon_steps`, marin.launch.resume),
    else its logged `schedule.horizon_steps` or `train.steps`; None if none is known."""
    for value in (tags.get("horizon_steps"), params.get("schedule.horizon_steps"), params.get("train.steps")):
        if str(value).isdigit():
            return int(value)
    return None
