"""`python -m marin.forecast <ladder sweep> --target <experiment>`: the ladder's loss forecast.

At each 5% of training, fit L(C) = E + A·C^−α across the ladder's runs (spec §4): L is the
evaluation loss at that point (``eval/macro_loss`` by default, interpolated between evaluations
when none falls exactly there), C the training FLOPs so far without the output head
(3 × `accounting.flops_per_token(cfg, with_head=False)` × tokens seen, from each run's resolved
config). E is fixed (1.5, as in the spec) and the fit is the linear regression of log(L − E) on
log C; ``--fit-E`` fits E as well (least squares on L). The target's C at the same point comes
from its config alone (compose ``experiment=<target>``, as its dry run does). Prints a table,
saves a plot and logs both to the sweep's parent run.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from marin.config.schema import Config
from marin.model import accounting
from marin.track import backend, sweep

log = logging.getLogger("marin.forecast")

FRACTIONS = tuple(round(0.05 * k, 2) for k in range(1, 21))
DEFAULT_E = 1.5


@dataclass
class Rung:
    name: str
    run_id: str
    steps: int                     # the run's training horizon
    flops_per_step: float          # 3 × forward FLOPs/token without the head × tokens per step
    history: list[tuple[int, float]]  # (step, loss), sorted

    def loss_at(self, step: float) -> float | None:
        """The loss at `step`, linearly interpolated between evaluations; None outside them."""
        steps = [s for s, _ in self.history]
        if not steps or step < steps[0] or step > steps[-1]:
            return None
        return float(np.interp(step, steps, [v for _, v in self.history]))


@dataclass
class Fit:
    fraction: float
    E: float
    A: float
    alpha: float
    r2: float
    points: list[tuple[float, float]]  # (C, L) of the rungs
    target_C: float | None = None

    def predict(self, C: float) -> float:
        return self.E + self.A * C ** -self.alpha


def training_flops_per_step(cfg: Config) -> float:
    return 3.0 * accounting.flops_per_token(cfg, with_head=False) * cfg.train.seq_len * cfg.train.global_batch


def horizon(cfg: Config) -> int:
    return int(cfg.schedule.horizon_steps or cfg.train.steps)


def load_resolved(run_dir: str | Path) -> Config:
    from marin.track.record import RESOLVED

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(Path(run_dir) / RESOLVED)))


def rungs_of(client, parent, metric: str) -> list[Rung]:
    rungs = []
    for kid in sweep.children(client, parent):
        run_dir = kid.data.tags.get("run_dir")
        history = sorted((m.step, m.value) for m in client.get_metric_history(kid.info.run_id, metric))
        if not run_dir or not history:
            log.warning("run %s has no %s: left out of the fit", kid.info.run_id, metric)
            continue
        cfg = load_resolved(run_dir)
        rungs.append(Rung(kid.info.run_name or kid.info.run_id, kid.info.run_id, horizon(cfg),
                          training_flops_per_step(cfg), history))
    return rungs


def fit_fixed_E(C: np.ndarray, L: np.ndarray, E: float) -> tuple[float, float]:
    """(A, α) from the regression of log(L − E) on log C."""
    slope, intercept = np.polyfit(np.log(C), np.log(L - E), 1)
    return float(math.exp(intercept)), float(-slope)


def fit_with_E(C: np.ndarray, L: np.ndarray) -> tuple[float, float, float]:
    """(E, A, α) by least squares on L, started from the best fixed-E fit on a grid of E."""
    from scipy.optimize import least_squares

    grid = np.linspace(0.0, L.min(), 200, endpoint=False)
    sse = []
    for E in grid:
        A, alpha = fit_fixed_E(C, L, E)
        sse.append(np.sum((E + A * C ** -alpha - L) ** 2))
    E0 = grid[int(np.argmin(sse))]
    A0, alpha0 = fit_fixed_E(C, L, E0)
    logC0 = float(np.log(C).mean())  # fit log A at the data's centre: well conditioned

    def residual(p):
        E, logA, alpha = p
        return E + np.exp(logA - alpha * (np.log(C) - logC0)) - L
    p0 = [E0, math.log(A0) - alpha0 * logC0, alpha0]
    E, logA, alpha = least_squares(residual, p0, bounds=([0, -np.inf, 0], [L.min(), np.inf, 10])).x
    return float(E), float(math.exp(logA + alpha * logC0)), float(alpha)


def fit_at(rungs: list[Rung], fraction: float, E: float | None) -> Fit | None:
    """The fit across rungs at `fraction` of each run's training; None with fewer than 2 points
    (3 when E is fitted) or a loss at or below a fixed E."""
    points = []
    for r in rungs:
        step = fraction * r.steps
        loss = r.loss_at(step)
        if loss is not None:
            points.append((r.flops_per_step * step, loss))
    if len(points) < (3 if E is None else 2):
        return None
    C, L = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    if E is None:
        E_fit, A, alpha = fit_with_E(C, L)
    else:
        if (L <= E).any():
            log.warning("at %d%% a loss is at or below E=%.3f: no fit", round(fraction * 100), E)
            return None
        E_fit, (A, alpha) = E, fit_fixed_E(C, L, E)
    predicted = E_fit + A * C ** -alpha
    total = np.sum((L - L.mean()) ** 2)
    r2 = 1.0 - np.sum((L - predicted) ** 2) / total if total > 0 else 1.0
    return Fit(fraction, E_fit, A, alpha, float(r2), points)


def target_config(target: str, overrides: list[str]) -> Config:
    """The resolved config of experiment `target` (plus overrides), composed as its dry run is
    (without its site-specific data files)."""
    from hydra import compose, initialize_config_dir

    from marin.config.store import CONF_DIR, register
    from marin.config.validate import load

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return load(compose("config", overrides=[f"experiment={target}", "dry_run=true", *overrides]))[1]


def plot(fits: list[Fit], target: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    cmap = plt.get_cmap("viridis")
    for fit in fits:
        color = cmap(fit.fraction)
        C = np.array([c for c, _ in fit.points])
        ax.scatter(C, [l for _, l in fit.points], color=color, s=14)
        hi = max(C.max(), fit.target_C or 0)
        grid = np.geomspace(C.min(), hi, 100)
        ax.plot(grid, fit.predict(grid), color=color, lw=0.8,
                label=f"{round(fit.fraction * 100)}%" if fit.fraction in (0.25, 0.5, 0.75, 1.0) else None)
        if fit.target_C:
            ax.scatter([fit.target_C], [fit.predict(fit.target_C)], color=color, marker="*", s=60)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs without the output head (C)")
    ax.set_ylabel("evaluation loss")
    ax.set_title(f"L(C) = E + A·C^−α at each 5% of training; ★ = {target}")
    ax.legend(title="of training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def forecast(client, parent, target: str, metric: str = "eval/macro_loss", E: float | None = DEFAULT_E,
             target_overrides: list[str] = ()) -> tuple[list[Fit], Config]:
    rungs = rungs_of(client, parent, metric)
    if len(rungs) < (3 if E is None else 2):
        raise ValueError(f"{len(rungs)} ladder run(s) with {metric}: too few to fit")
    cfg = target_config(target, list(target_overrides))
    fits = [f for f in (fit_at(rungs, frac, E) for frac in FRACTIONS) if f is not None]
    for fit in fits:
        fit.target_C = training_flops_per_step(cfg) * fit.fraction * horizon(cfg)
    return fits, cfg


def table(fits: list[Fit], target: str) -> str:
    lines = [f"{'at':>4}  {'rungs':>5}  {'E':>6}  {'A':>10}  {'alpha':>7}  {'R²':>6}  {'target C':>10}  {target} loss"]
    for f in fits:
        lines.append(f"{round(f.fraction * 100):>3}%  {len(f.points):>5}  {f.E:>6.3f}  {f.A:>10.4g}  {f.alpha:>7.4f}  "
                     f"{f.r2:>6.3f}  {f.target_C:>10.3e}  {f.predict(f.target_C):.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m marin.forecast", description=__doc__.split("\n")[0])
    parser.add_argument("sweep", help="the ladder's sweep directory or its parent MLflow run id")
    parser.add_argument("--target", required=True, help="experiment whose loss to predict (conf/experiment/<name>)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override of the target's config (repeatable)")
    parser.add_argument("--metric", default="eval/macro_loss")
    parser.add_argument("--E", type=float, default=DEFAULT_E, help="the fixed asymptote (default 1.5)")
    parser.add_argument("--fit-E", action="store_true", help="fit E too instead of fixing it")
    parser.add_argument("--out", type=Path, help="the plot's path (default: the sweep directory)")
    parser.add_argument("--tracking-uri")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        client, parent = sweep.open_parent(args.sweep, args.tracking_uri)
        fits, _ = forecast(client, parent, args.target, args.metric, None if args.fit_E else args.E, args.set)
    except (sweep.SweepNotFound, backend.TrackingUnavailable, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not fits:
        print("error: no point of training has enough rungs to fit", file=sys.stderr)
        return 2
    text = table(fits, args.target)
    print(text)
    final = fits[-1]
    print(f"forecast for {args.target} at {round(final.fraction * 100)}% of training: "
          f"{final.predict(final.target_C):.4f}")
    folder = Path(parent.data.tags.get("sweep_dir") or ".")
    path = args.out or folder / f"forecast-{args.target}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(fits, args.target, path)
    rows = [{"fraction": f.fraction, "E": f.E, "A": f.A, "alpha": f.alpha, "r2": f.r2, "points": f.points,
             "target_C": f.target_C, "target_loss": f.predict(f.target_C)} for f in fits]
    run_id = parent.info.run_id
    client.log_artifact(run_id, str(path), "forecast")
    client.log_text(run_id, text + "\n", f"forecast/forecast-{args.target}.txt")
    client.log_dict(run_id, {"target": args.target, "metric": args.metric, "fits": rows},
                    f"forecast/forecast-{args.target}.json")
    client.log_metric(run_id, f"forecast/{args.target}", final.predict(final.target_C))
    print(f"plot: {path} (logged to MLflow run {run_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
