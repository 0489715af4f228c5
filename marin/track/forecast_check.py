"""A run against its pre-registered forecast (`forecast.registered=outputs/forecasts/<experiment>.yaml`).

The file is written by ``python -m marin.forecast <ladder> --target <experiment> --register``
before the run starts; it holds, at each 5% of training, the ladder's predicted evaluation loss
and its 95% band, the fit behind it and the ladder's run ids. Three parts, each used once:

- `check_config(cfg)`: validation (pure Python, no JAX): the file must forecast this run, its
  experiment and its training FLOPs without the head (`accounting.train_flops(cfg, with_head=False)`).
- `Check(cfg, tracker)`: called by the loop at each evaluation; where the evaluation lands on a
  registered point it logs ``forecast/{predicted,residual,z,lower,upper}``; outside the band it
  prints one line and tags the run ``forecast.alert`` (the step of the first departure), and
  training goes on — a forecast is evidence, not a stop condition.
- `write(path, doc)` / `read(path)`: the file format (version `FORMAT`).
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import yaml

from marin.config.paths import project_path
from marin.model import accounting
from marin.track.errors import first_line

FORMAT = 1
METRICS = ("predicted", "residual", "z", "lower", "upper")
log = logging.getLogger("marin.forecast")
POINT_KEYS = ("fraction", "C", "predicted", "lower", "upper", "sigma", "fit")


class BadForecast(ValueError):
    """The registered file cannot be read, or it does not forecast this run."""


def read(path: str | Path) -> dict:
    """The registered forecast at `path` (relative: the project root); BadForecast if unusable."""

    full = project_path(path)
    try:
        doc = yaml.safe_load(full.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise BadForecast(f"cannot read {path}: {type(err).__name__}: {first_line(err)}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("points"), list) \
            or not all(isinstance(p, dict) and all(k in p for k in POINT_KEYS) for p in doc["points"]) \
            or "target" not in doc or "target_C" not in doc:
        raise BadForecast(f"{path} is not a registered forecast (format {FORMAT}: target, target_C, points "
                          "with fraction, C, predicted, lower, upper, sigma, fit); write one with "
                          "python -m marin.forecast <ladder> --target <experiment> --register")
    return doc


def write(path: str | Path, doc: dict) -> Path:
    """Write `doc` (with `format` set) as YAML, atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    header = (f"# Pre-registered loss forecast for experiment {doc['target']} (marin.forecast --register).\n"
              "# A run with forecast.registered=<this file> logs forecast/* at each point and tags\n"
              "# forecast.alert where its eval loss leaves [lower, upper]. Do not edit: re-register.\n")
    tmp.write_text(header + yaml.safe_dump({"format": FORMAT, **doc}, sort_keys=False, width=120))
    tmp.replace(path)
    return path


def check_config(cfg) -> list[tuple[str, str]]:
    """Validation problems of `forecast.registered` for the resolved `cfg` (none when unset)."""

    name = getattr(getattr(cfg, "forecast", None), "registered", None)
    if not name:
        return []
    field = "forecast.registered"
    try:
        doc = read(name)
    except BadForecast as err:
        return [(field, str(err))]
    if doc["target"] != cfg.run.experiment:
        return [(field, f"{name} forecasts experiment {doc['target']!r}, but this run is experiment "
                 f"{cfg.run.experiment!r}: register a forecast for it, or drop forecast.registered")]
    C = accounting.forecast_flops(cfg, steps=cfg.train.steps)
    if not math.isclose(float(doc["target_C"]), C, rel_tol=1e-9):
        return [(field, f"{name} forecasts a run of C = {float(doc['target_C']):.6g} training FLOPs (without the "
                 f"head); this run's config gives C = {C:.6g}: steps, batch or model size differ from the "
                 "registered target (pass the same --set overrides to --register)")]
    return []


def horizon(cfg) -> int:
    return int(cfg.schedule.horizon_steps or cfg.train.steps)


class Check:
    """What the loop calls at each evaluation: `check(step, losses, write)`. A no-op without a
    registered forecast; the file is read once, at the start of the run."""

    def __init__(self, cfg, tracker, metric: str = "eval/macro_loss"):
        self.tracker, self.metric, self.alerted = tracker, metric, False
        self.points: dict[int, dict] = {}
        if getattr(cfg.forecast, "registered", None):
            try:
                doc = read(cfg.forecast.registered)
            except BadForecast as err:  # validated at launch, gone since: monitoring is no reason to stop
                log.warning("forecast.registered: %s; training without the forecast check", err)
                return
            self.metric = doc.get("metric", metric)
            H = horizon(cfg)
            # an evaluation lands on a point when its step is within half a step of fraction × horizon
            self.points = {math.floor(p["fraction"] * H + 0.5): p for p in doc["points"]}

    def __call__(self, step: int, losses: dict, write=None) -> dict:
        point = self.points.get(int(step))
        if point is None or self.metric not in losses:
            return {}
        actual, predicted = float(losses[self.metric]), float(point["predicted"])
        lower, upper, sigma = float(point["lower"]), float(point["upper"]), float(point["sigma"])
        residual = actual - predicted
        z = residual / sigma if sigma > 0 else (0.0 if residual == 0 else math.copysign(math.inf, residual))
        row = {"forecast/predicted": predicted, "forecast/residual": residual, "forecast/z": z,
               "forecast/lower": lower, "forecast/upper": upper}
        self.tracker.log_metrics({k: v for k, v in row.items() if math.isfinite(v)}, step)
        if not lower <= actual <= upper:
            line = (f"forecast alert: step {step} ({round(point['fraction'] * 100)}% of training): {self.metric} "
                    f"{actual:.4f} is outside the registered band [{lower:.4f}, {upper:.4f}] (predicted "
                    f"{predicted:.4f}, z = {row['forecast/z']:+.2f}); training continues")
            (write or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
            if not self.alerted:
                self.tracker.set_tags({"forecast.alert": str(step)})
                self.alerted = True
        return row
