"""The run report: written at the end of a run into its directory and MLflow, self-contained
(plots as data: PNGs, nothing fetched), with the forecast hook; a sweep's page; bad input."""
import base64
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
from mlflow import MlflowClient

from marin import report
from marin.track import expert_load
from marin.track import report as track_report
from tests.trained import tiny_run

RUN_SECTIONS = {"summary", "losses", "learning-rate", "grad-norm", "dropped", "expert-load", "throughput"}
PNG = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """Section ids, <img> sources and every src/href of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.sections, self.images, self.links, self.text = [], [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append(attrs.get("id"))
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        self.links += [v for k, v in attrs.items() if k in ("src", "href") and v]

    def handle_data(self, data):
        self.text.append(data)


def check_self_contained(page: Page) -> None:
    assert page.images
    for src in page.images:
        head, _, data = src.partition(",")
        assert head == "data:image/png;base64", head
        assert base64.b64decode(data, validate=True).startswith(PNG)
    assert not [link for link in page.links if link.lower().startswith(("http://", "https://", "//"))]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory)


def test_a_run_ends_with_its_report_in_the_directory_and_mlflow(run, tmp_path):
    rec, cfg = run
    path = rec.run_dir / track_report.REPORT
    page = Page(path.read_text())
    assert RUN_SECTIONS <= set(page.sections)
    # every section but the forecast note has a plot: 6 sections with data + the throughput plot
    assert len(page.images) >= len(RUN_SECTIONS) - 1
    check_self_contained(page)
    assert "FINISHED" in "".join(page.text)
    artifacts = {a.path for a in MlflowClient(rec.tracking_uri).list_artifacts(rec.run_id)}
    assert {track_report.REPORT, expert_load.FILE} <= artifacts
    downloaded = MlflowClient(rec.tracking_uri).download_artifacts(rec.run_id, track_report.REPORT, str(tmp_path))
    assert Page(open(downloaded).read()).sections == page.sections


def test_the_report_renders_offline_in_a_real_browser(run, tmp_path):
    """Headless Chromium with every host name unresolvable: the page has its sections, and its
    screenshot is a page of plots (many colours), not text with broken-image icons."""
    from matplotlib.image import imread

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        message = "no headless chromium here (scripts/browser_install.sh installs it)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    rec, _ = run
    url = (rec.run_dir / track_report.REPORT).as_uri()
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND",
              f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert RUN_SECTIONS <= set(Page(dom.stdout).sections)
    shot = tmp_path / "report.png"
    done = subprocess.run([*common, "--window-size=1200,2400", f"--screenshot={shot}", url],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = (imread(shot)[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours = len(np.unique(pixels, axis=0))
    inked = float(np.mean(pixels.min(axis=1) < 250))   # share of pixels that are not (near) white
    assert colours > 1000 and inked > 0.05, (colours, inked)   # text with broken images: ~300 and 3%


def test_expert_load_snapshots_are_fractions_per_layer(run):
    rec, cfg = run
    steps, load = expert_load.read(rec.run_dir)
    assert list(steps) == list(range(1, cfg.train.steps + 1))  # log_every 1, a short run: every step (1…N)
    assert load.shape == (cfg.train.steps, cfg.model.num_layers, cfg.model.num_experts)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-5)


def test_snapshot_cadence_is_bounded_and_on_logged_steps():
    assert expert_load.cadence(1, 100) == 1
    every = expert_load.cadence(10, 390_251)  # the hero run's horizon
    assert every % 10 == 0 and 390_251 / every <= expert_load.MAX_SNAPSHOTS


def test_a_resumed_run_keeps_the_snapshots_before_its_start(tmp_path):
    first = expert_load.ExpertLoadLog(tmp_path, start=0, total_steps=10, log_every=1)
    for step in range(1, 5):
        first.add(step, np.full((2, 4), 0.25 + step))
    first.save()
    resumed = expert_load.ExpertLoadLog(tmp_path, start=2, total_steps=10, log_every=1)  # from checkpoint 2
    resumed.add(3, np.full((2, 4), 9.0))
    resumed.save()
    steps, load = expert_load.read(tmp_path)
    assert list(steps) == [1, 2, 3] and load[:, 0, 0].tolist() == [1.25, 2.25, 9.0]
    assert not expert_load.ExpertLoadLog(tmp_path / "x", 0, 10, 1, enabled=False).wants(0)


def test_forecast_band_is_drawn_when_the_run_has_one(run, tmp_path):
    rec, _ = run
    client = MlflowClient(rec.tracking_uri)
    before = Page((rec.run_dir / track_report.REPORT).read_text())
    assert "no registered forecast" in "".join(before.text)
    for step in (0, 2, 4):
        client.log_metric(rec.run_id, track_report.FORECAST["predicted"], 6.0 - 0.1 * step, step=step)
        client.log_metric(rec.run_id, track_report.FORECAST["lower"], 5.8 - 0.1 * step, step=step)
        client.log_metric(rec.run_id, track_report.FORECAST["upper"], 6.2 - 0.1 * step, step=step)
    out = tmp_path / "with_forecast.html"
    assert report.main([str(rec.run_dir), "--out", str(out), "--no-log"]) == 0
    after = Page(out.read_text())
    assert "no registered forecast" not in "".join(after.text)
    assert "within the band at all 3 registered points so far" in "".join(after.text)   # the summary's verdict
    check_self_contained(after)
    assert after.images[0] != before.images[0]  # the loss plot (the first) changed


def test_the_summary_links_the_mlflow_run(run):
    rec, _ = run
    text = "".join(Page((rec.run_dir / track_report.REPORT).read_text()).text)
    assert f"python -m marin.ui {rec.run_dir} (or marin-ui: MLflow's UI for {rec.tracking_uri}" in text  # sqlite
    # a server's: the run's page in the training view, as the trainer links it (no credentials in it)
    link = track_report.mlflow_link("http://user:pw@host:5000/", "3", "abc")
    url = "http://host:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert link == f'<a href="{url}">{url}</a>'
    from marin.track import backend
    assert backend.ui_url("http://user:pw@host:5000/", "3", "abc") == url


def test_the_forecast_verdict_names_the_first_departure():
    steps = np.array([10, 20, 30])
    series = {"forecast/predicted": (steps, np.array([4.0, 3.5, 3.2])), "forecast/lower": (steps, np.array([3.8, 3.3, 3.0])),
              "forecast/upper": (steps, np.array([4.2, 3.7, 3.4])), "forecast/residual": (steps, np.array([0.1, 0.4, -0.3])),
              "forecast/z": (steps, np.array([1.0, 4.0, -3.0]))}
    assert track_report.forecast_verdict(series, {"forecast.alert": "20"}) == \
        "ALERT: outside the band from step 20 (2 of 3 points outside; last z = -3.00)"
    assert track_report.forecast_verdict({}, {}) == "no registered forecast"


def test_a_process_warms_the_plotting_once(monkeypatch):
    """The tracking process warms matplotlib for each run it tracks; a process that tracks many
    (an in-process sweep) draws the throwaway figure once, not once a run."""
    drawn = []
    monkeypatch.setattr(track_report, "_png", lambda fig: drawn.append(fig) or "")
    track_report.warm()
    track_report.warm()
    assert len(drawn) <= 1


def test_loss_plot_is_log_scale_full_width_with_every_curve_visible():
    from matplotlib.colors import to_rgba

    steps = np.arange(1, 101)
    ce = 6.0 * steps ** -0.3
    fig = track_report.loss_axes({"train/loss": (steps, ce + 1e-3), "train/ce": (steps, ce),
                                  "eval/macro_loss": (steps[::20], ce[::20] + 0.1)})
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    total, ce_line = lines["train/loss"], lines["train/ce"]
    # the one drawn on top (later) is thin and dashed, the one under it wide: both show
    assert ax.get_lines().index(ce_line) > ax.get_lines().index(total)
    assert ce_line.get_linestyle() == "--" and total.get_linewidth() > 2 * ce_line.get_linewidth()
    assert to_rgba(total.get_color())[:3] != to_rgba(ce_line.get_color())[:3]
    png = base64.b64decode(track_report._png(fig).split(",", 1)[1].split('"')[0])  # noqa: SLF001
    assert int.from_bytes(png[16:20], "big") == 1200          # as wide as the page (max-width 1240px)
    assert "img{width:100%" in track_report.STYLE


def test_a_sweeps_jobs_side_by_side(run, tmp_path, capsys):
    rec, _ = run
    client = MlflowClient(rec.tracking_uri)
    exp = client.get_run(rec.run_id).info.experiment_id
    parent = client.create_run(exp, tags={"sweep": "lr_grid", "sweep_id": "abc", "sweep_role": "parent",
                                          "sweep_dir": str(tmp_path / "lr_grid-abc"),
                                          "sweep_params": json.dumps({"optim.lr": ["1e-3", "3e-3"]})}).info.run_id
    for lr in ("1e-3", "3e-3"):
        kid = client.create_run(exp, tags={"mlflow.parentRunId": parent, "sweep_role": "child",
                                           "sweep_overrides": json.dumps([f"optim.lr={lr}"])}).info.run_id
        for step in range(3):
            client.log_metric(kid, "train/loss", 5 - step * float(lr) * 100, step=step)
        client.log_metric(kid, "eval/macro_loss", 4.5, step=3)
        if lr == "3e-3":  # stopped by train.stop_after at 2 of 6: STOPPED 2 / 6, as marin.status says
            client.log_param(kid, "train.steps", "6")
            client.set_tag(kid, "ended", "stopped at step 2 of 6 (train.stop_after)")
        client.set_terminated(kid, "FINISHED")
    out_dir = rec.run_dir.parent.parent
    assert report.main([parent, "--tracking-uri", rec.tracking_uri, "--out-dir", str(out_dir)]) == 0
    path = capsys.readouterr().out.split("report: ", 1)[1].strip()
    assert path == str(tmp_path / "lr_grid-abc" / track_report.REPORT)
    page = Page(open(path).read())
    assert {"summary", "jobs", "losses", "eval-losses"} <= set(page.sections)
    text = "".join(page.text)
    assert "lr=1e-3" in text and "lr=3e-3" in text and "optim.lr=3e-3" in text
    rows = re.findall(r"<tr><td>(lr=[^<]*)</td><td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td>", open(path).read())
    assert sorted(rows) == [("lr=1e-3", "FINISHED", "2"), ("lr=3e-3", "STOPPED", "2 / 6")], rows
    check_self_contained(page)
    assert track_report.REPORT in {a.path for a in client.list_artifacts(parent)}


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        report.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(SystemExit) as done:
        report.main(["--help"])
    assert done.value.code == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        report.main([])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1


def test_mlflow_prints_no_view_run_line_of_its_own(capsys, monkeypatch):
    """MLflow's client prints `🏃 View run … at: <url>` when a server's run ends: a link without the
    training view, beside the one marin prints. Every client marin opens keeps it quiet."""
    from mlflow.store.tracking.rest_store import RestStore
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    from marin.track import backend

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    backend.client("http://127.0.0.1:9/")  # no server there: made, not used
    fake = TrackingServiceClient.__new__(TrackingServiceClient)
    monkeypatch.setattr(TrackingServiceClient, "store", property(lambda self: RestStore.__new__(RestStore)))
    fake._log_url("abc")  # would ask the store for the run (and fail) if it meant to print
    assert "View run" not in capsys.readouterr().out


@pytest.mark.parametrize("tool", ["report", "forecast"])
def test_out_naming_a_device_or_pipe_is_refused_and_left_as_it_was(tool, tmp_path, capsys):
    """`--out /dev/full` as root: the write-then-rename replaced the device with a file. A pipe
    stands in for the device here; a folder gets the tool's file inside it."""
    import stat

    from marin import forecast
    from marin.cli import output_file

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    main = report.main if tool == "report" else forecast.main
    args = ["anything", "--out", str(pipe)] + (["--target", "d768"] if tool == "forecast" else [])
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    assert capsys.readouterr().err == f"error: --out: {pipe} is not a file (a device or a pipe); give a file's path or a folder\n"
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    assert output_file(tmp_path, "report.html") == tmp_path / "report.html"
    assert output_file(None, "report.html") is None and output_file(tmp_path / "r.html", "x") == tmp_path / "r.html"
