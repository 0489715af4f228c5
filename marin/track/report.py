"""A run's or a sweep's report: its figures drawn and one self-contained HTML page written
(`python -m marin.report` is the command; the run's tracker writes a run's page at its end).

A run's page: a summary (state, steps, final losses, throughput, provenance, overrides), then
plots of the training and evaluation losses (against the registered forecast when the run has
one, see FORECAST), the learning rate of each parameter group, the gradient norm, the dropped
fraction of each layer, the expert load over time (a heatmap per layer, from the run's
`expert_load.npz`, see marin/track/expert_load.py), tokens/s and MFU. A sweep's page: its jobs
side by side (overrides, state, losses, tokens/s) and their loss curves overlaid. Metrics are
read back from MLflow. Plots are PNGs embedded as `data:` URIs and the style is inline: the file
opens offline and can be mailed as it is.
"""
from __future__ import annotations

import base64
import functools
import html
import io
import json
import re
import time
from pathlib import Path

import numpy as np

from marin.config.store import shell_join
from marin.track import backend, expert_load, record, runstate, secrets, sweep

REPORT = "report.html"
# The forecast hook: a run that has these metrics (logged by whoever registers a forecast for it,
# at the steps it predicts) gets them drawn on its loss plot, the band shaded between lower/upper.
FORECAST = {"predicted": "forecast/predicted", "lower": "forecast/lower", "upper": "forecast/upper"}
LAYER = re.compile(r"^train/dropped_frac/layer_(\d+)$")
HEATMAP_LAYERS = 4   # expert-load heatmaps drawn (layers evenly spaced from first to last)
LINES_UP_TO = 8      # per-layer series drawn as lines up to this many layers, as a heatmap beyond

Series = tuple[np.ndarray, np.ndarray]  # (steps, values), sorted by step


# ---------------------------------------------------------------------------- reading

def history(client, run_id: str, key: str) -> Series | None:
    """A metric's (steps, values), the last value logged at each step; None if never logged."""
    points = client.get_metric_history(run_id, key)
    if not points:
        return None
    by_step = {}
    for m in sorted(points, key=lambda m: (m.step, m.timestamp)):
        by_step[m.step] = m.value
    steps = np.fromiter(by_step, dtype=np.int64)
    return steps, np.fromiter(by_step.values(), dtype=np.float64)


def _histories(client, run_id: str, keys) -> dict[str, Series]:
    found = {k: history(client, run_id, k) for k in keys}
    return {k: v for k, v in found.items() if v is not None}


def stitched(client, run_id: str, tags: dict, key: str = "train/loss") -> tuple[Series | None, list[str]]:
    """`key` across a fork's lineage (its `forked_from` tags, marin/launch/fork.py): each step from
    the run in force at that step; and the lineage, oldest first, as `<run id>: steps a–b` lines.
    (None, []) for a run that is no fork."""
    parts, lines, upto, seen = [], [], None, {run_id}
    while True:
        s = history(client, run_id, key)
        fork = tags.get("forked_from")
        start = int(fork.rsplit("@", 1)[1]) if fork and fork.rsplit("@", 1)[-1].isdigit() else 0
        if s is not None:
            keep = (s[0] > start) & (s[0] <= upto if upto is not None else True)
            parts.append((s[0][keep], s[1][keep]))
        lines.append(f"{run_id}: steps {start}–{'' if upto is None else upto}")
        if not start or fork.rsplit("@", 1)[0] in seen:
            break
        run_id, upto = fork.rsplit("@", 1)[0], start
        seen.add(run_id)
        try:
            tags = client.get_run(run_id).data.tags
        except Exception:  # noqa: BLE001 — a parent in another store: the lineage stops here
            lines.append(f"{run_id}: not in this store")
            break
    if len(lines) < 2 or not parts:
        return None, []
    parts.reverse()
    return (np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])), lines[::-1]


def _final(series: Series | None) -> float | None:
    return None if series is None else float(series[1][-1])


def _median_late(series: Series | None) -> float | None:
    """The median over the second half of the points (the first steps include compilation)."""
    if series is None:
        return None
    values = series[1][len(series[1]) // 2:]
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else None


# ---------------------------------------------------------------------------- plotting

WIDTH_IN, DPI = 12.0, 100  # 1,200 px: the page's full width (STYLE), text at its natural size


def _figure(rows: int = 1, cols: int = 1, height: float = 3.6):
    # The object API with its own Agg canvas: no pyplot, no global backend switch in the caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width, tall = WIDTH_IN, height * rows
    fig = Figure(figsize=(width, tall))
    FigureCanvasAgg(fig)
    # Margins in inches, fixed: tight_layout would draw every figure an extra time to measure
    # its labels (a third of the report's time, which the end of every run waits for).
    fig.subplots_adjust(left=0.95 / width, right=1 - 0.2 / width, bottom=0.5 / tall, top=1 - 0.3 / tall,
                        hspace=0.6, wspace=0.35)
    return fig, fig.subplots(rows, cols, squeeze=False)


def _png(fig) -> str:
    """The figure as an <img> whose source is a base64 data: URI (nothing fetched to show it)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


@functools.cache
def warm() -> None:
    """Draw a throwaway figure the way the run's page draws its own: matplotlib's imports, its
    fonts, the mathtext parser (a log axis's 10ⁿ labels) and its text caches are then ready, so
    the page drawn at the run's end (which the run waits for) skips that first-time work. Once a
    process: the caches stay warm for every later run it tracks."""
    from matplotlib.ticker import FormatStrFormatter

    steps = np.arange(1, 6)
    fig, axes = _figure(3, 1)
    _line(axes[0, 0], (steps, 6.0 - steps / 10), "train/loss", **TRAIN_STYLE["train/loss"])
    axes[0, 0].plot(steps, 6.0 - steps / 8, marker="s", markersize=4, label="eval/macro_loss")
    _finish(axes[0, 0], "loss (log scale)", log=True)
    axes[0, 0].yaxis.set_major_formatter(FormatStrFormatter("%g"))
    _line(axes[1, 0], (steps, 10.0 ** steps), "train/tokens_per_s", linewidth=1)
    _finish(axes[1, 0], "tokens/s", log=True)
    image = axes[2, 0].imshow(np.ones((2, 2)), aspect="auto", origin="lower", interpolation="nearest")
    fig.colorbar(image, ax=axes[2, 0], label="load × E")
    axes[2, 0].set_title("layer 0", fontsize=9)
    _png(fig)


def _line(ax, series: Series, label: str, **kw) -> None:
    steps, values = series
    ax.plot(steps, values, label=label, marker="o" if len(steps) < 3 else None, markersize=3, **kw)


def _steps_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))  # steps are whole
    ax.set_xlabel("step")


def _finish(ax, ylabel: str, legend: bool = True, log: bool = False) -> None:
    _steps_axis(ax)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if log:
        ax.set_yscale("log")
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


# train/loss = train/ce + the z and aux losses: nearly the same curve. The total is drawn wide and
# pale, the cross-entropy thin and dashed on top, so neither hides the other.
TRAIN_STYLE = {"train/loss": {"linewidth": 2.6, "alpha": 0.45}, "train/ce": {"linewidth": 1.0, "linestyle": "--"}}


def loss_axes(series: dict[str, Series]):
    """The loss figure (training, evaluation, the forecast), on a log axis when every loss is
    positive (a loss falls by decades early and by hundredths late); None with nothing to draw."""
    train = {k: series[k] for k in TRAIN_STYLE if k in series}
    evals = {k: v for k, v in series.items() if k.startswith("eval/") and k.endswith("loss")}
    if not train and not evals:
        return None
    fig, axes = _figure()
    ax = axes[0, 0]
    for key, s in train.items():
        _line(ax, s, key, **TRAIN_STYLE[key])
    for key, s in evals.items():
        steps, values = s
        ax.plot(steps, values, marker="s", markersize=4, linewidth=2 if key == "eval/macro_loss" else 1, label=key)
    _forecast(ax, series)
    positive = all((s[1][np.isfinite(s[1])] > 0).all() for s in (*train.values(), *evals.values()))
    _finish(ax, "loss (log scale)" if positive else "loss", log=positive)
    if positive:  # plain numbers (2, 3, 4) on the log axis, not 2×10⁰: a loss spans about a decade
        from matplotlib.ticker import FormatStrFormatter

        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    return fig


def plot_losses(series: dict[str, Series]) -> str | None:
    fig = loss_axes(series)
    return None if fig is None else _png(fig)


def _forecast(ax, series: dict[str, Series]) -> None:
    """The registered forecast (FORECAST metrics), if the run has one: a line (or a point) and
    its band."""
    predicted = series.get(FORECAST["predicted"])
    if predicted is None:
        return
    lower, upper = series.get(FORECAST["lower"]), series.get(FORECAST["upper"])
    steps, values = predicted
    band = lower is not None and upper is not None and len(lower[0]) == len(upper[0])
    if len(steps) == 1:  # one prediction (the final loss): a point with its band as error bar
        err = [[values[0] - lower[1][0]], [upper[1][0] - values[0]]] if band else None
        ax.errorbar(steps, values, yerr=err, fmt="*", color="black", markersize=10, capsize=4,
                    label="forecast" + (" (band)" if band else ""))
        return
    ax.plot(steps, values, "--", color="black", linewidth=1, label="forecast")
    if band:
        ax.fill_between(lower[0], lower[1], np.interp(lower[0], *upper), color="gray", alpha=0.25,
                        label="forecast band")


def plot_lines(series: dict[str, Series], ylabel: str, log: bool = False) -> str | None:
    if not series:
        return None
    fig, axes = _figure()
    for key, s in series.items():
        _line(axes[0, 0], s, key, linewidth=1)
    log = log and all((s[1] > 0).all() for s in series.values())
    _finish(axes[0, 0], ylabel, log=log)
    return _png(fig)


def plot_per_layer(series: dict[int, Series], ylabel: str) -> str | None:
    """One line per layer, or, with many layers, a heatmap (layer × step)."""
    if not series:
        return None
    fig, axes = _figure()
    ax = axes[0, 0]
    layers = sorted(series)
    if len(layers) <= LINES_UP_TO:
        for i in layers:
            _line(ax, series[i], f"layer {i}", linewidth=1)
        _finish(ax, ylabel)
        return _png(fig)
    steps = np.unique(np.concatenate([series[i][0] for i in layers]))
    grid = np.stack([np.interp(steps, *series[i]) for i in layers])
    image = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                      extent=(steps[0], steps[-1] + 1, layers[0] - 0.5, layers[-1] + 0.5))
    fig.colorbar(image, ax=ax, label=ylabel)
    ax.set_ylabel("layer")
    _steps_axis(ax)
    return _png(fig)


def plot_expert_load(steps: np.ndarray, load: np.ndarray) -> str:
    """Heatmaps expert × step of each chosen layer's load, relative to balanced (1 = 1/E)."""
    n_layers, n_experts = load.shape[1], load.shape[2]
    chosen = sorted(set(np.linspace(0, n_layers - 1, min(n_layers, HEATMAP_LAYERS)).round().astype(int)))
    fig, axes = _figure(len(chosen), 1, height=2.4)
    relative = load * n_experts
    top = max(2.0, float(np.nanpercentile(relative, 99)))  # a few hot cells do not wash the rest out
    width = steps[-1] - steps[-2] if len(steps) > 1 else 1
    for ax, layer in zip(axes[:, 0], chosen):
        image = ax.imshow(relative[:, layer, :].T, aspect="auto", origin="lower", interpolation="nearest",
                          cmap="viridis", vmin=0, vmax=top,
                          extent=(steps[0], steps[-1] + width, -0.5, n_experts - 0.5))
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_ylabel("expert")
        fig.colorbar(image, ax=ax, label="load × E")
    _steps_axis(axes[-1, 0])
    return _png(fig)


# ---------------------------------------------------------------------------- HTML

STYLE = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;
max-width:1240px;color:#222;padding:0 1em}h1{font-size:1.5em}h2{font-size:1.15em;border-bottom:1px solid #ddd;
padding-bottom:.2em;margin-top:1.8em}table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;
padding:.25em .6em;text-align:left;vertical-align:top}th{background:#f4f4f4}code{font-size:.9em}
.none{color:#888;font-style:italic}img{width:100%;height:auto}"""


def _esc(value) -> str:
    """Text for the page: secrets this process knows of masked (marin.track.secrets), then escaped."""
    return html.escape(secrets.mask("" if value is None else str(value)))


def _num(value, fmt: str = ".4f") -> str:
    return "–" if value is None else format(value, fmt)


class Html(str):
    """A table cell that is already HTML (built from escaped parts): not escaped again."""


def _table(rows: list[tuple], head: tuple | None = None) -> str:
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{c if isinstance(c, Html) else _esc(c)}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _section(ident: str, title: str, body: str | None, missing: str = "nothing logged") -> str:
    body = body if body else f'<p class="none">{_esc(missing)}</p>'
    return f'<section id="{ident}">\n<h2>{_esc(title)}</h2>\n{body}\n</section>'


def _page(title: str, sections: list[str]) -> str:
    made = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_esc(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n<h1>{_esc(title)}</h1>\n<p>made {_esc(made)} by "
            f"<code>python -m marin.report</code></p>\n" + "\n".join(sections) + "\n</body>\n</html>\n")


def _when(ms) -> str | None:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else None


# ---------------------------------------------------------------------------- a run

def forecast_verdict(series: dict[str, Series], tags: dict) -> str:
    """One line on the run against its registered forecast (forecast_check's metrics and tag)."""
    predicted, lower, upper = (series.get(FORECAST[k]) for k in ("predicted", "lower", "upper"))
    residual = series.get("forecast/residual")
    if predicted is None:
        return "no registered forecast"
    n = len(predicted[0])
    outside = 0
    if residual is not None and lower is not None and upper is not None and len(lower[0]) == len(residual[0]):
        actual = np.interp(residual[0], *predicted) + residual[1]
        outside = int(np.sum((actual < lower[1]) | (actual > upper[1])))
    z = series.get("forecast/z")
    last = f"; last z = {z[1][-1]:+.2f}" if z is not None and len(z[1]) else ""
    if tags.get("forecast.alert"):
        return f"ALERT: outside the band from step {tags['forecast.alert']} ({outside} of {n} points outside{last})"
    return f"within the band at all {n} registered points so far{last}"


def mlflow_link(tracking_uri: str, experiment_id: str, run_id: str, run_dir: Path | None = None) -> Html:
    """The run in MLflow's UI: for a server, a link to its page in the model-training view (the
    link the trainer prints: backend.ui_url); for a sqlite store, the command that serves it and
    prints that link (marin.ui). Credentials in the URI are left out."""
    url = backend.ui_url(tracking_uri, experiment_id, run_id)
    if url is not None:
        return Html(f'<a href="{_esc(url)}">{_esc(url)}</a>')
    target = shell_join([str(run_dir)]) if run_dir is not None else run_id
    return Html(f"<code>python -m marin.ui {_esc(target)}</code> (or <code>marin-ui</code>: MLflow's UI for "
                f"{_esc(secrets.safe_uri(tracking_uri))}, and the run's link)")


def run_html(client, run, run_dir: Path | None) -> str:
    """The HTML page of one run (`run`: an MLflow Run; `run_dir`: its directory, if here)."""
    run_id, tags, params = run.info.run_id, run.data.tags, run.data.params
    keys = set(run.data.metrics)
    plain = ["train/loss", "train/ce", "train/grad_norm", "train/tokens_per_s", "train/mfu", "train/lr",
             *FORECAST.values(), "forecast/residual", "forecast/z", *(k for k in keys if k.startswith("eval/") or k.startswith("train/lr/"))]
    series = _histories(client, run_id, [k for k in dict.fromkeys(plain) if k in keys])
    dropped = {int(m.group(1)): history(client, run_id, k) for k in keys if (m := LAYER.match(k))}
    dropped = {i: s for i, s in dropped.items() if s is not None}
    if not dropped and "train/dropped_frac" in keys:
        dropped = {-1: history(client, run_id, "train/dropped_frac")}  # only the mean was logged

    loss = series.get("train/loss")
    total = runstate.last_step(params, tags) or "?"  # N / M: stop_after stops short of M
    overrides = _json_list(tags.get("overrides"))
    headline = params.get("eval.headline") or "eval/macro_loss"   # runs from before the field: the mean
    summary = [
        ("run", f"{run.info.run_name} ({run_id})"),
        ("state", runstate.state(run.info.status, tags) + (f" ({tags['ended']})" if tags.get("ended") else "")),  # how it ended (trainer)
        ("started / ended", f"{_when(run.info.start_time) or '–'} / {_when(run.info.end_time) or '–'}"),
        ("steps", f"{int(loss[0][-1]) if loss is not None else '–'} / {total}"),
        ("final train loss", _num(_final(loss))),
        (f"final {headline}", _num(_final(series.get(headline)))),   # eval.headline, logged as a param
        ("forecast", forecast_verdict(series, tags)),
        ("MLflow", mlflow_link(client.tracking_uri, run.info.experiment_id, run_id, run_dir)),
        ("tokens/s (median, 2nd half)", _num(_median_late(series.get("train/tokens_per_s")), ",.0f")),
        ("MFU (median, 2nd half)", _num(_median_late(series.get("train/mfu")), ".2%")),
        ("model / router / hardware", f"{tags.get('model', '?')} / {tags.get('router', '?')} / {tags.get('hardware', '?')}"),
        ("git commit", f"{tags.get('git_commit', '?')}{' (dirty)' if tags.get('git_dirty') == 'true' else ''}"),
        ("config hash", tags.get("config_hash")),
        ("run directory", str(run_dir) if run_dir else tags.get("run_dir")),
        ("overrides", " ".join(overrides) or "(none)"),
    ]
    if tags.get("sweep"):
        summary.append(("sweep", f"{tags['sweep']} ({tags.get('sweep_id')})"))

    lrs = {k: v for k, v in series.items() if k == "train/lr" or k.startswith("train/lr/")}
    throughput = {k: series[k] for k in ("train/tokens_per_s",) if k in series}
    mfu = {k: series[k] for k in ("train/mfu",) if k in series}
    loads = expert_load.read(run_dir) if run_dir else None
    forecast_note = ("" if FORECAST["predicted"] in series else
                     f'<p class="none">no registered forecast ({FORECAST["predicted"]} not logged)</p>')
    sections = [
        _section("summary", "Summary", _table(summary)),
        _section("losses", "Losses", (plot_losses(series) or "") + forecast_note),
        _section("learning-rate", "Learning rate per parameter group", plot_lines(lrs, "learning rate")),
        _section("grad-norm", "Gradient norm", plot_lines({k: series[k] for k in ("train/grad_norm",) if k in series},
                                                          "global gradient norm", log=True)),
        _section("dropped", "Dropped fraction per layer",
                 plot_per_layer(dropped, "dropped fraction of assignments")),
        _section("expert-load", "Expert load over time",
                 plot_expert_load(*loads) if loads is not None else None,
                 missing=f"no {expert_load.FILE} in the run directory"),
        _section("throughput", "Throughput", "".join(filter(None, (plot_lines(throughput, "tokens/s", log=True),
                                                                   plot_lines(mfu, "MFU"))))),
    ]
    whole, chain = stitched(client, run_id, tags) if tags.get("forked_from") else (None, [])
    if whole is not None:  # a fork: the loss of its lineage, each step from the run in force then
        sections.insert(2, _section("lineage", "Lineage (train/loss stitched across forks)",
                                    _table([(line,) for line in chain]) + (plot_lines({"train/loss": whole}, "loss") or "")))
    return _page(f"run {run.info.run_name}", sections)


def run_page(rec: record.RunRecord, client=None) -> str:
    """A run's page as it stands (its figures stay drawn for the next page of this process)."""
    if client is None:
        backend.check_reachable(rec.tracking_uri, create=False)   # seconds, not MLflow's minutes of retries
        client = backend.client(rec.tracking_uri, create=False)
    return run_html(client, client.get_run(rec.run_id), rec.run_dir)


def write_run_report(rec: record.RunRecord, out: Path | None = None, log_to_mlflow: bool = True) -> Path:
    """Write a run's page (default `<run dir>/report.html`) and log it (and the expert-load file)
    to the run's MLflow artifacts."""
    backend.check_reachable(rec.tracking_uri, create=False)   # seconds, not MLflow's minutes of retries
    client = backend.client(rec.tracking_uri, create=False)   # the run's store exists, or nothing is made
    page = run_page(rec, client)
    path = Path(out) if out else rec.run_dir / REPORT
    _write(path, page)
    if log_to_mlflow:
        client.log_artifact(rec.run_id, str(path))
        if (rec.run_dir / expert_load.FILE).is_file():
            client.log_artifact(rec.run_id, str(rec.run_dir / expert_load.FILE))
    return path


# ---------------------------------------------------------------------------- a sweep

def sweep_html(client, parent) -> str:
    tags = parent.data.tags
    kids = sweep.children(client, parent)
    rows, losses, evals = [], {}, {}
    for kid in kids:
        overrides = _json_list(kid.data.tags.get("sweep_overrides"))
        label = sweep.child_name(overrides) or kid.info.run_name
        loss = history(client, kid.info.run_id, "train/loss")
        macro = history(client, kid.info.run_id, "eval/macro_loss")
        tps = history(client, kid.info.run_id, "train/tokens_per_s")
        if loss is not None:
            losses[label] = loss
        if macro is not None:
            evals[label] = macro
        last = runstate.last_step(kid.data.params, kid.data.tags)  # N / M, as marin.status shows a job
        steps = int(loss[0][-1]) if loss is not None else "–"
        rows.append((label, " ".join(overrides) or "–", runstate.state(kid.info.status, kid.data.tags),
                     f"{steps} / {last}" if last else steps, _num(_final(loss)), _num(_final(macro)),
                     _num(_median_late(tps), ",.0f"), kid.info.run_id))
    jobs = _table(rows, ("job", "overrides", "state", "steps", "train loss", "eval/macro_loss", "tokens/s", "run id"))
    summary = [("sweep", f"{tags.get('sweep')} ({tags.get('sweep_id')})"),
               ("parent run", f"{parent.info.run_id} ({parent.info.status})"),
               ("jobs", f"{len(kids)}{' of ' + tags['expected_jobs'] if tags.get('expected_jobs') else ''}"),
               ("swept", tags.get("sweep_params") or "–"),
               ("directory", tags.get("sweep_dir"))]
    sections = [
        _section("summary", "Summary", _table(summary)),
        _section("jobs", "Jobs side by side", jobs if rows else None, missing="no jobs yet"),
        _section("losses", "Training loss", plot_lines(losses, "train/loss (log scale)", log=True)),
        _section("eval-losses", "Evaluation loss", plot_lines(evals, "eval/macro_loss (log scale)", log=True)),
    ]
    return _page(f"sweep {tags.get('sweep')} ({tags.get('sweep_id')})", sections)


def write_sweep_report(client, parent, out: Path | None = None, log_to_mlflow: bool = True) -> Path:
    """Write a sweep's page (default `<sweep dir>/report.html`) and log it to the parent run."""
    page = sweep_html(client, parent)
    folder = parent.data.tags.get("sweep_dir")
    path = Path(out) if out else (Path(folder) if folder else Path.cwd()) / REPORT
    _write(path, page)
    if log_to_mlflow:
        client.log_artifact(parent.info.run_id, str(path))
    return path


def _write(path: Path, page: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)


def _json_list(tag: str | None) -> list[str]:
    """A JSON-list tag (overrides); a run made before such tags were shortened item by item may
    hold one cut short past MLflow's limit: its text, as one item, not a failed report."""
    try:
        value = json.loads(tag or "[]")
    except ValueError:
        return [str(tag)]
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]
