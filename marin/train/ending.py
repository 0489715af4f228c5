"""How a run's invocation ended, said once: the last line it prints on stdout (and into run.log),
and the MLflow tag `ended`.

    finished at step 40 of 40: train loss 5.3184, eval loss 5.4604; run directory …; mlflow run 1f…
        (sqlite:///…); report …/report.html
    stopped at step 12 of 30 (train.stop_after): …; continue with: python launch.py resume=…

(one line each). Every ending but `finished` names the `resume=` command that goes on from the
newest checkpoint; a requeued Slurm job goes on by itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from marin.config.store import override, shell_join

HOW = ("finished", "stopped", "killed", "failed", "requeued")


@dataclass(frozen=True)
class Ending:
    how: str                  # one of HOW
    step: int | None          # the last step taken (None: none known, set-up failed)
    total: int                # the run's last step (its horizon)
    why: str = ""             # what stopped it: "train.stop_after", "SIGINT, checkpoint saved", an error's type

    @property
    def unfinished(self) -> bool:
        return self.how != "finished"

    def describe(self) -> str:
        """E.g. `stopped at step 12 of 30 (train.stop_after)`: the summary's start and the `ended` tag."""
        where = f" at step {self.step} of {self.total}" if self.step is not None else f" in set-up (of {self.total} steps)"
        return f"{self.how}{where}" + (f" ({self.why})" if self.why else "")


def resume_command(run_dir: Path) -> str:
    return shell_join(["python", "launch.py", override("resume", run_dir)])


def summary_line(ending: Ending, train_loss: float | None, eval_loss: float | None, run_dir: Path,
                 run_id: str | None, link: str | None, report: Path | None) -> str:
    """The run's last line: how it ended, its final losses, where it is (`link`: the MLflow run's
    page or store, record.mlflow_link), and how to go on."""
    parts = [f"{ending.describe()}: train loss {_num(train_loss)}, eval loss {_num(eval_loss)}",
             f"run directory {run_dir}",
             f"mlflow run {run_id} ({link})" if run_id else "mlflow run –",
             f"report {report}" if report is not None else "report –"]
    if ending.unfinished and ending.how != "requeued":
        parts.append(f"continue with: {resume_command(run_dir)}")
    return "; ".join(parts)


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"
