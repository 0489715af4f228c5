"""`python -m marin.forecast <ladder sweep> --target <experiment>`: the ladder's loss forecast.

At each 5% of training, fit L(C) = E + A·C^−α across the ladder's runs (spec §4, §9): L is the
evaluation loss at that point (by default the rungs' own headline, `eval.headline`: the dropless
Paloma macro loss, `METRIC`, where their data names a Paloma set, as the published ladder's; each evaluation
snapped to the nearest 5% of its run, the later one winning, as Marin's plot_scaling_ladder.py;
interpolated between points where none snaps), C the training FLOPs so far without the output head
(`accounting.forecast_flops`, from each run's resolved config; `forecast.c_last_layer_global`
false counts the global layers as Marin's ladder FLOPs did, 5 of d2048's 6). E is fixed (1.5, as
in the spec) and the fit is the linear regression of log(L − E) on log C; ``--fit-E`` fits E as
well (least squares on L). The target's C at the same point comes from its config alone (compose
``experiment=<target>``, as its dry run does). Prints a table, saves a plot and logs both to the
sweep's parent run.

``--register [PATH]`` also pre-registers the forecast (default ``outputs/forecasts/<target>.yaml``,
git-ignored, so registering does not make every later run "dirty"; a path in the project's tracked
tree prints that the file must be committed before the run): at each 5% point the predicted loss,
its 95% band and the fit, with the ladder's run ids; a run with ``forecast.registered=<that file>``
checks itself against it (marin/track/forecast_check.py). A ladder or fit refused above, or a point
without a band, writes nothing.

Caveats (`caveats`): a target more than FAR (100×) beyond the largest rung's compute, a target whose
steps and tokens per active parameter both differ from the rungs' (a 100-step ladder for a 200-step
target), or an unbounded final band (`unbounded`) are printed as `warning:` lines under the table
and in the headline; ``--register`` refuses them unless ``--force`` (the file then lists them).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from marin.cli import Parser, fail, output_file
from marin.config.paths import PROJECT_ROOT, project_path
from marin.config.schema import Config
from marin.config.store import compose
from marin.launch.checks import load
from marin.model import accounting
from marin.track import backend, forecast_check, refs, sweep
from marin.track.errors import first_line
from marin.track.record import COMPOSED, RESOLVED, flatten

log = logging.getLogger("marin.forecast")

FRACTIONS = tuple(round(0.05 * k, 2) for k in range(1, 21))
METRIC = "eval/paloma/macro_loss"  # published eval_dropless/paloma/macro_loss (spec §9): Evaluator's dropless name
DEFAULT_E = 1.5
MIN_RUNGS = 3
# Composed-config leaves a ladder's rungs may differ in: size, batch, where it runs, step counts
# (and bookkeeping). Any other difference (a learning rate, a router) is not a ladder.
LADDER_FREE = ("model.name", "model.d_model", "model.num_layers", "model.expert_width", "model.latent_dim",
               "model.shared_width", "model.init_std", "attention.num_heads", "attention.kv_heads_local",
               "attention.kv_heads_global", "train.steps", "train.stop_after", "train.eval_every",
               "train.global_batch", "train.micro_batch", "train.log_every", "train.checkpoint.",
               "schedule.horizon_steps", "hardware.", "run.", "tracking.", "data.root", "data.cache_dir",
               "dry_run", "wait", "reproduce", "resume", "forecast.")


# A rung that stopped early (a crash) is completed linearly from its evaluations in this window of
# its run, as the published ladder did for d2048 (stopped at 81%, spec §8), plus the rung's
# `forecast.extrapolation_offset` (d2048: 0.005, spec §9); one that stopped before
# EXTRAPOLATE_FROM is refused.
EXTRAPOLATE_FROM, EXTRAPOLATE_TO = 0.6, 0.8
FAR = 100.0          # a target more than this many times the largest rung's compute is flagged
SAME_RECIPE = 0.05   # rungs and target "train alike" when their tokens per active parameter are this close
REGISTER_DIR = "outputs/forecasts"  # git-ignored: a registration does not make later runs dirty


class NotALadder(ValueError):
    """The sweep's runs cannot give a scaling law, or the fit is not to be trusted."""


@dataclass
class Rung:
    name: str
    run_id: str
    steps: int                     # the run's training horizon
    flops_per_step: float          # 3 × forward FLOPs/token without the head × tokens per step
    history: list[tuple[int, float]]  # (step, loss), sorted
    leaves: dict | None = None     # its composed config, flattened (what a ladder check compares)
    line: tuple[float, float] | None = None  # (slope, intercept) past its last evaluation (`extrapolated`)
    tokens_per_param: float | None = None    # tokens trained per active parameter over its horizon
    offset: float = 0.0            # added past its last evaluation (its forecast.extrapolation_offset)

    @property
    def stopped_at(self) -> int | None:
        """The last evaluated step of a rung completed by extrapolation; None for a whole run."""
        return self.history[-1][0] if self.line is not None else None

    def extrapolated_at(self, step: float) -> bool:
        return self.line is not None and step > self.history[-1][0]

    def loss_at(self, step: float) -> float | None:
        """The loss at `step`, linearly interpolated between evaluations (past the last one, on
        `line` up to the horizon); None outside them."""
        steps = [s for s, _ in self.history]
        if self.extrapolated_at(step) and step <= self.steps:
            slope, intercept = self.line
            return float(intercept + slope * step + self.offset)
        if not steps or step < steps[0] or step > steps[-1]:
            return None
        return float(np.interp(step, steps, [v for _, v in self.history]))


def snapped(history: list[tuple[int, float]], steps: int) -> list[tuple[float, float]]:
    """Each evaluation moved to the nearest 5% of the run (step = fraction × steps), a later one
    replacing an earlier one at the same point: the published forecast's points (Marin's
    plot_scaling_ladder.py), so an evaluation a step or two off its 5% point still lands there."""
    points = {}
    for step, value in sorted(history):
        points[round(round(step / steps * 20) / 20, 2)] = value
    return [(fraction * steps, value) for fraction, value in sorted(points.items())]


def extrapolated(rung: Rung) -> Rung:
    """`rung` itself if its evaluations reach its horizon; else completed by the line fitted to
    its evaluations in [60%, 80%] of its run (up to where it stopped). Raises NotALadder for a
    rung that stopped before 60%, or without two evaluations in that window."""
    last = rung.history[-1][0] if rung.history else 0
    if last >= rung.steps:
        return rung
    done = last / rung.steps
    where = f"rung {rung.name} ({rung.run_id}) stopped at {done:.0%} of its run (step {last:,.0f} of {rung.steps:,})"
    if done < EXTRAPOLATE_FROM:
        raise NotALadder(f"{where}: a rung is extrapolated only from {EXTRAPOLATE_FROM:.0%} on; "
                         "finish or resume it, or leave it out of the sweep")
    lo, hi = EXTRAPOLATE_FROM * rung.steps, EXTRAPOLATE_TO * rung.steps
    window = [(s, v) for s, v in rung.history if lo <= s <= hi]
    if len(window) < 2:
        raise NotALadder(f"{where}: its {EXTRAPOLATE_FROM:.0%}–{EXTRAPOLATE_TO:.0%} window has "
                         f"{len(window)} evaluation(s); extrapolating needs 2")
    slope, intercept = np.polyfit([s for s, _ in window], [v for _, v in window], 1)
    log.warning("%s: extrapolated linearly from its %d evaluations in %.0f%%–%.0f%%", where, len(window),
                EXTRAPOLATE_FROM * 100, EXTRAPOLATE_TO * 100)
    return dataclasses.replace(rung, line=(float(slope), float(intercept)))


@dataclass
class Fit:
    fraction: float
    E: float
    A: float
    alpha: float
    r2: float
    points: list[tuple[float, float]]  # (C, L) of the rungs
    target_C: float | None = None
    extrapolated: tuple = ()           # names of the rungs whose point here is extrapolated (`extrapolated`)
    band_fn: object = None             # C -> (low, high), the 95% band; None when it cannot be had
    t95: float | None = None           # Student t quantile of that band (its half-width in standard errors)

    def predict(self, C: float) -> float:
        return self.E + self.A * C ** -self.alpha

    def band(self, C: float) -> tuple[float, float] | None:
        return self.band_fn(C) if self.band_fn is not None else None


def training_flops_per_step(cfg: Config) -> float:
    """C per step: `accounting.forecast_flops` of one step (no head; the rung's count of global layers)."""
    return float(accounting.forecast_flops(cfg, steps=1))


def horizon(cfg: Config) -> int:
    return int(cfg.schedule.horizon_steps or cfg.train.steps)


def tokens_per_param(cfg: Config) -> float:
    """Tokens over the run's horizon per active parameter (the token-budget rule's quantity)."""
    return horizon(cfg) * cfg.train.seq_len * cfg.train.global_batch / accounting.active_params(cfg)


def load_resolved(run_dir: str | Path) -> Config:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(Path(run_dir) / RESOLVED)))


def last_per_step(points) -> list[tuple[int, float]]:
    """(step, value) of a metric's MLflow history, the value logged last at each step: a run
    resumed after a kill logged the steps past its checkpoint twice, and MLflow keeps both."""
    by_step = {m.step: m.value for m in sorted(points, key=lambda m: (m.step, m.timestamp))}
    return sorted(by_step.items())


def ladder_metric(client, parent) -> str:
    """What `--metric` defaults to: the rungs' headline (`eval.headline` of their resolved configs),
    one for all of them; NotALadder when they differ."""
    heads = set()
    for kid in sweep.children(client, parent):
        run_dir = kid.data.tags.get("run_dir")
        if run_dir and (Path(run_dir) / RESOLVED).is_file():
            heads.add(load_resolved(run_dir).eval.headline)
    if len(heads) > 1:
        raise NotALadder(f"the rungs' headline metrics differ ({', '.join(sorted(heads))}): pick one with --metric")
    return heads.pop() if heads else METRIC


def rungs_of(client, parent, metric: str) -> list[Rung]:
    rungs = []
    for kid in sweep.children(client, parent):
        run_dir = kid.data.tags.get("run_dir")
        history = last_per_step(client.get_metric_history(kid.info.run_id, metric))
        if not run_dir or not history:
            log.warning("run %s has no %s: left out of the fit", kid.info.run_id, metric)
            continue
        cfg = load_resolved(run_dir)
        rungs.append(extrapolated(Rung(kid.info.run_name or kid.info.run_id, kid.info.run_id, horizon(cfg),
                                       training_flops_per_step(cfg), snapped(history, horizon(cfg)),
                                       _composed_leaves(run_dir), tokens_per_param=tokens_per_param(cfg),
                                       offset=cfg.forecast.extrapolation_offset)))
    return rungs


def _composed_leaves(run_dir: str | Path) -> dict:
    return flatten(OmegaConf.to_container(OmegaConf.load(Path(run_dir) / COMPOSED), resolve=True))


def check_ladder(rungs: list[Rung]) -> None:
    """Raise NotALadder unless the rungs are ≥ 3 compute scales of one recipe."""
    scales = sorted({r.flops_per_step for r in rungs})
    if len(scales) < MIN_RUNGS:
        raise NotALadder(f"not a ladder: {len(rungs)} run(s) at {len(scales)} distinct compute scale(s); "
                         f"a fit needs at least {MIN_RUNGS} (rungs of different model size)")
    known = [r for r in rungs if r.leaves is not None]
    differing = sorted({k for r in known for k in r.leaves if not k.startswith(LADDER_FREE)
                        and len({repr(q.leaves.get(k)) for q in known}) > 1})
    if differing:
        values = ", ".join(f"{k} = {sorted({str(q.leaves.get(k)) for q in known})}" for k in differing[:3])
        raise NotALadder(f"not a ladder: the runs differ in more than size and steps ({values}"
                         f"{' …' if len(differing) > 3 else ''})")


def check_fit(fit: Fit, min_r2: float) -> None:
    """Raise NotALadder for a fit whose prediction would mean nothing."""
    at = f"the fit at {round(fit.fraction * 100)}% of training"
    if fit.alpha <= 0:
        raise NotALadder(f"{at} has alpha = {fit.alpha:.4f} ≤ 0: the loss does not fall with compute")
    if fit.r2 < min_r2:
        raise NotALadder(f"{at} has R² = {fit.r2:.3f} < --min-r2 {min_r2}: the law does not describe the rungs")


def caveats(fits: list[Fit], rungs: list[Rung], cfg: Config) -> list[str]:
    """Why the forecast of target `cfg` may not be worth much, one sentence each (none: nothing to
    say): a target far beyond the ladder's compute, a target trained unlike the rungs, an
    unbounded final band."""
    out = []
    final = fits[-1] if fits else None
    largest = max((r.flops_per_step * r.steps for r in rungs), default=0.0)
    if final is not None and final.target_C and largest and final.target_C > FAR * largest:
        out.append(f"the target's compute C = {final.target_C:.3g} is {final.target_C / largest:.3g}× the largest "
                   f"rung's ({largest:.3g}), more than {FAR:g}×: the law is extrapolated far beyond its data")
    steps, tpp = horizon(cfg), tokens_per_param(cfg)
    same_steps = all(r.steps == steps for r in rungs)
    same_tpp = all(r.tokens_per_param is not None and math.isclose(r.tokens_per_param, tpp, rel_tol=SAME_RECIPE)
                   for r in rungs)
    if rungs and not (same_steps or same_tpp):
        rung_steps = ", ".join(f"{s:,}" for s in sorted({r.steps for r in rungs}))
        known = [r.tokens_per_param for r in rungs if r.tokens_per_param is not None]
        rung_tpp = f"{min(known):.3g}–{max(known):.3g}" if known else "unknown"
        out.append(f"the rungs train {rung_steps} steps ({rung_tpp} tokens per active parameter), the target "
                   f"{steps:,} ({tpp:.3g}): its loss at each 5% point is not the ladder's (same steps or same "
                   "tokens per parameter needed)")
    if final is not None and unbounded(final.band(final.target_C), final.predict(final.target_C)):
        out.append(f"the 95% band at {round(final.fraction * 100)}% of training is unbounded "
                   f"({_band_text(final, raw=True)}): the ladder does not pin the target's loss")
    return out


def unbounded(band: tuple[float, float] | None, predicted: float) -> bool:
    """A band that says nothing: wider than the predicted loss itself (e.g. 1.5000–853565.7)."""
    return band is not None and not (math.isfinite(band[0]) and math.isfinite(band[1])
                                     and band[1] - band[0] <= abs(predicted))


def _t95(dof: int) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.975, dof))


def band_fixed_E(C: np.ndarray, L: np.ndarray, E: float, A: float, alpha: float):
    """95% band of E + exp(a + b·log C) from the regression's standard errors (n − 2 dof)."""
    x, y = np.log(C), np.log(L - E)
    n = len(x)
    if n < 3:
        return None
    resid = y - (math.log(A) - alpha * x)
    s = math.sqrt(float(resid @ resid) / (n - 2))
    sxx = float(((x - x.mean()) ** 2).sum())
    t = _t95(n - 2)

    def band(c: float) -> tuple[float, float]:
        x0 = math.log(c)
        se = s * math.sqrt(1.0 / n + (x0 - x.mean()) ** 2 / sxx)
        mid = math.log(A) - alpha * x0
        return E + math.exp(mid - t * se), E + math.exp(mid + t * se)
    return band


def band_with_E(C: np.ndarray, L: np.ndarray, E: float, A: float, alpha: float):
    """95% band of E + A·C^−α with E fitted: the delta method on least squares (n − 3 dof)."""
    n = len(C)
    if n < 4:
        return None
    resid = E + A * C ** -alpha - L
    J = np.stack([np.ones_like(C), C ** -alpha, -A * C ** -alpha * np.log(C)], axis=1)
    s2 = float(resid @ resid) / (n - 3)
    try:
        cov = s2 * np.linalg.inv(J.T @ J)
    except np.linalg.LinAlgError:
        return None
    t = _t95(n - 3)

    def band(c: float) -> tuple[float, float]:
        g = np.array([1.0, c ** -alpha, -A * c ** -alpha * math.log(c)])
        se = math.sqrt(max(float(g @ cov @ g), 0.0))
        mid = E + A * c ** -alpha
        return mid - t * se, mid + t * se
    return band


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
    points, guessed = [], []
    for r in rungs:
        step = fraction * r.steps
        loss = r.loss_at(step)
        if loss is not None:
            points.append((r.flops_per_step * step, loss))
            if r.extrapolated_at(step):
                guessed.append(r.name)
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
    r2 = 1.0 - np.sum((L - predicted) ** 2) / total if total > 0 else 0.0  # flat losses explain nothing
    band = band_with_E(C, L, E_fit, A, alpha) if E is None else band_fixed_E(C, L, E_fit, A, alpha)
    dof = len(points) - (3 if E is None else 2)
    return Fit(fraction, E_fit, A, alpha, float(r2), points, band_fn=band, t95=_t95(dof) if band else None,
               extrapolated=tuple(guessed))


def target_config(target: str, overrides: list[str]) -> Config:
    """The resolved config of experiment `target` (plus overrides), composed as its dry run is
    (without its site-specific data files)."""
    return load(compose([f"experiment={target}", "dry_run=true", *overrides]))[1]


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


def forecast(client, parent, target: str, metric: str | None = None, E: float | None = DEFAULT_E,
             target_overrides: list[str] = (), rungs: list[Rung] | None = None) -> tuple[list[Fit], Config]:
    """The fits at every 5% of training. Raises NotALadder for runs that are not a ladder.
    `rungs`, if given, is filled with the ladder's runs (for a registration). `metric`: the rungs'
    headline unless given (`ladder_metric`)."""
    found = rungs_of(client, parent, metric or ladder_metric(client, parent))
    check_ladder(found)
    if rungs is not None:
        rungs[:] = found
    cfg = target_config(target, list(target_overrides))
    fits = [f for f in (fit_at(found, frac, E) for frac in FRACTIONS) if f is not None]
    for fit in fits:
        fit.target_C = accounting.forecast_flops(cfg) * fit.fraction
    return fits, cfg


def registration(fits: list[Fit], rungs: list[Rung], cfg: Config, target: str, metric: str,
                 E: float | None, parent, overrides: list[str], forced: list[str] = ()) -> dict:
    """The pre-registered forecast of `target` (the document `forecast_check.write` saves).
    Raises NotALadder when a point has no band: a forecast without one cannot raise an alert."""
    from datetime import datetime, timezone

    points = []
    for fit in fits:
        band = fit.band(fit.target_C)
        if band is None:
            raise NotALadder(f"--register: the fit at {round(fit.fraction * 100)}% of training has no band "
                             f"({len(fit.points)} rungs; a band needs 3 with E fixed, 4 with --fit-E)")
        lower, upper = band
        points.append({"fraction": fit.fraction, "C": float(fit.target_C),
                       "predicted": float(fit.predict(fit.target_C)), "lower": float(lower), "upper": float(upper),
                       "sigma": float((upper - lower) / (2 * fit.t95)),  # z = residual / sigma
                       "fit": {"E": float(fit.E), "A": float(fit.A), "alpha": float(fit.alpha), "r2": float(fit.r2),
                               "rungs": len(fit.points)}})
    return {"target": target,
            "target_C": int(accounting.forecast_flops(cfg, steps=cfg.train.steps)),
            "target_overrides": list(overrides),
            "horizon_steps": horizon(cfg),
            "metric": metric,
            "E": "fitted" if E is None else float(E),
            "band": "95%: the regression's standard errors, Student t (rungs - 2 dof; - 3 with E fitted); "
                    "sigma = band width / 2t",
            "sweep": {"parent_run_id": parent.info.run_id, "name": parent.data.tags.get("sweep"),
                      "dir": parent.data.tags.get("sweep_dir")},
            "ladder": [{"name": r.name, "run_id": r.run_id, "steps": r.steps, "flops_per_step": float(r.flops_per_step),
                        **({"stopped_at": r.stopped_at} if r.stopped_at is not None else {}),
                        **({"extrapolation_offset": r.offset} if r.stopped_at is not None and r.offset else {})}
                       for r in rungs],
            "registered_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **({"caveats": list(forced)} if forced else {}),  # registered anyway (--force)
            "points": points}


def _band_text(fit: Fit, raw: bool = False) -> str:
    band = fit.band(fit.target_C)
    if band is None:
        return "n/a"
    if not raw and unbounded(band, fit.predict(fit.target_C)):
        return "unbounded"
    return f"{band[0]:.4f}–{band[1]:.4g}" if raw else f"{band[0]:.4f}–{band[1]:.4f}"


def _offsets(rungs: list[Rung]) -> str:
    """The rungs' forecast.extrapolation_offset, as the table's footnote shows them."""
    added = [f"{r.name} {r.offset:+.3f}" for r in rungs if r.line is not None and r.offset]
    return f", plus its forecast.extrapolation_offset ({', '.join(added)})" if added else ""


def table(fits: list[Fit], target: str, warnings: list[str] = (), rungs: list[Rung] = ()) -> str:
    lines = [f"{'at':>4}  {'rungs':>5}  {'E':>6}  {'A':>10}  {'alpha':>7}  {'R²':>6}  {'target C':>10}  "
             f"{target + ' loss':>14}  95% band"]
    for f in fits:
        flag = f"  * extrapolated: {', '.join(f.extrapolated)}" if f.extrapolated else ""
        lines.append(f"{round(f.fraction * 100):>3}%  {len(f.points):>5}  {f.E:>6.3f}  {f.A:>10.4g}  {f.alpha:>7.4f}  "
                     f"{f.r2:>6.3f}  {f.target_C:>10.3e}  {f.predict(f.target_C):>14.4f}  {_band_text(f)}{flag}")
    if any(f.extrapolated for f in fits):
        lines.append(f"* a rung that stopped early, its loss extended linearly from its "
                     f"{EXTRAPOLATE_FROM:.0%}–{EXTRAPOLATE_TO:.0%} evaluations" + _offsets(rungs))
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)


def default_register_path(target: str) -> Path:
    return project_path(f"{REGISTER_DIR}/{target}.yaml")


def commit_note(path: Path) -> str | None:
    """What to do with a registration written inside the project's tracked tree: commit it before
    the run (uncommitted, every later run is recorded "dirty"); None for a git-ignored path."""
    import subprocess

    try:
        inside = path.resolve().relative_to(PROJECT_ROOT)
    except ValueError:
        return None  # outside the project: the user's own file
    ignored = subprocess.run(["git", "check-ignore", "-q", str(inside)], cwd=PROJECT_ROOT, capture_output=True)
    if ignored.returncode == 0:
        return None
    return (f"{inside} is in the project's tracked tree: commit it before the run "
            f"(git add {inside} && git commit), or every later run is recorded dirty")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.forecast", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="the ladder sweep: its name, directory or parent MLflow run id")
    parser.add_argument("--target", required=True, help="experiment whose loss to predict (conf/experiment/<name>)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override of the target's config (repeatable)")
    parser.add_argument("--metric", help="the loss to fit (default: the rungs' headline, eval.headline: "
                        f"{METRIC} where their data names a Paloma set, else eval/macro_loss)")
    parser.add_argument("--E", type=float, default=DEFAULT_E, help="the fixed asymptote (default 1.5)")
    parser.add_argument("--fit-E", action="store_true", help="fit E too instead of fixing it")
    parser.add_argument("--min-r2", type=float, default=0.9, help="refuse a final fit with a lower R² (default 0.9)")
    parser.add_argument("--out", type=Path, help="the plot's path (default: the sweep directory)")
    parser.add_argument("--register", nargs="?", const="", metavar="PATH",
                        help=f"pre-register the forecast (default: {REGISTER_DIR}/<target>.yaml) for a run "
                             "with forecast.registered=<that file> to check itself against")
    parser.add_argument("--force", action="store_true",
                        help="register despite the caveats (a target far beyond the ladder, trained unlike "
                             "its rungs, or an unbounded band); the file lists them")
    parser.add_argument("--tracking-uri")
    parser.add_argument("--out-dir", help="where sweep names are looked up (default: the project's outputs/)")
    args = parser.parse_args(argv)
    args.out = output_file(args.out, f"forecast-{args.target}.png")
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        client, parent = refs.open_sweep(args.sweep, args.tracking_uri, args.out_dir)
        args.metric = args.metric or ladder_metric(client, parent)
        E, rungs = None if args.fit_E else args.E, []
        fits, cfg = forecast(client, parent, args.target, args.metric, E, args.set, rungs)
        if not fits:
            raise NotALadder("no point of training has enough rungs with a loss above E to fit")
        check_fit(fits[-1], args.min_r2)
        warnings = caveats(fits, rungs, cfg)
        registered = None
        if args.register is not None:
            if warnings and not args.force:
                raise NotALadder(f"--register refused: {warnings[0]}"
                                 f"{f' (and {len(warnings) - 1} more caveat(s))' if len(warnings) > 1 else ''}; "
                                 "--force registers anyway")
            doc = registration(fits, rungs, cfg, args.target, args.metric, E, parent, args.set, warnings)
            path = project_path(args.register) if args.register else default_register_path(args.target)
            registered = forecast_check.write(path, doc)
    except (sweep.SweepNotFound, backend.TrackingUnavailable, ValueError) as err:
        fail(first_line(err))
    except Exception as err:  # the target does not compose, the store answers with an error
        fail(f"{type(err).__name__}: {first_line(err)}")
    text = table(fits, args.target, warnings, rungs)
    print(text)
    final = fits[-1]
    print(f"forecast for {args.target} at {round(final.fraction * 100)}% of training: "
          f"{final.predict(final.target_C):.4f} (95% band {_band_text(final)}; "
          f"alpha {final.alpha:.4f}, R² {final.r2:.3f}, {len(final.points)} rungs)"
          + (f" — {len(warnings)} caveat(s), see the warning: lines above" if warnings else ""))
    folder = Path(parent.data.tags.get("sweep_dir") or ".")
    path = args.out or folder / f"forecast-{args.target}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(fits, args.target, path)
    rows = [{"fraction": f.fraction, "E": f.E, "A": f.A, "alpha": f.alpha, "r2": f.r2, "points": f.points,
             "target_C": f.target_C, "target_loss": f.predict(f.target_C), "band95": f.band(f.target_C)}
            for f in fits]
    run_id = parent.info.run_id
    client.log_artifact(run_id, str(path), "forecast")
    client.log_text(run_id, text + "\n", f"forecast/forecast-{args.target}.txt")
    client.log_dict(run_id, {"target": args.target, "metric": args.metric, "fits": rows},
                    f"forecast/forecast-{args.target}.json")
    client.log_metric(run_id, f"forecast/{args.target}", final.predict(final.target_C))
    if registered is not None:
        client.log_artifact(run_id, str(registered), "forecast")
        print(f"registered: {registered} (run with forecast.registered={registered})")
        if (note := commit_note(registered)) is not None:
            print(f"note: {note}")
    print(f"plot: {path} (logged to MLflow run {run_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
