"""Bad input: one clear message naming the field, a non-zero exit, no traceback, nothing written.

Hydra's own refusals (an unknown option or key) and a few of marin's run `launch.py` as a user
would, in an empty working directory with the output folder pointed inside it, and then check
that the directory is still empty (Hydra's own output folder included) and that no MLflow store
was created. The rest of marin's refusals check the same in this process (`launch_here`: launch.py's
composition and dispatch, without a new interpreter for each).
"""
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from marin.config.schema import ModelConfig
from tests.helpers import launch_here

ROOT = Path(__file__).resolve().parents[2]

# (overrides, text that must appear in the message)
HYDRA = [  # refused while Hydra composes: launch.py turns Hydra's exit 1 into bad input's 2
    (["model=nope"], "model=nope: no such option of model"),
    (["hardware=nope"], "hardware=nope: no such option of hardware"),
    (["experiment=nope"], "experiment=nope: no such option of experiment"),
    (["model.hiden=3"], "hiden"),
]

def _options(group: str) -> str:
    folder = ROOT / ("sweeps" if group == "sweep" else f"conf/{group}")
    return ", ".join(sorted(path.stem for path in folder.glob("*.yaml")))


# Refused by marin itself: exactly one line on stderr, `error: ...`, exit status 2 (every numeric
# leaf is walked in-process by test_numeric_leaves.py; these prove the command-line behaviour).
# Each is tiny and one step, or a dry run, so that code which wrongly accepts it fails fast.
ONE_LINE = [
    (["model.capacity_factor=nan"], "model.capacity_factor"),
    (["model.num_experts=1000000000", "router=softmax_aux", "dry_run=true"], "model.num_experts"),
    (["+train.stepz=5"], "train.stepz: not a field of the schema (TrainConfig); did you mean train.steps?"),
    (["resume="], "resume"),
    # an empty fork= or init_from= ran a fresh run of the defaults (200 steps), silently
    (["fork="], "fork: give a run directory or an MLflow run id@<step> (got an empty value)"),
    (["train.init_from=''"], "train.init_from: give a run directory or an MLflow run id (got an empty value)"),
    (["train.init_from=/nonexistent/run"], "train.init_from"),
    # a store MLflow takes no run in: its paragraph came when the run was being made
    (["tracking.uri=file:///tmp/x/mlruns"], "tracking.uri: MLflow's file store (a folder, file://) takes no new runs"),
    (["tracking.uri=ftp://h/x"], "tracking.uri: ftp: is not a store MLflow takes: use sqlite:///"),
    # a dry run checks the data as a launch does (the files when data.root is here; the tokenizer)
    (["data.sources.0.kind=text", "data.sources.0.paths=[nope/*.txt]", "dry_run=true"], "data.sources[0].paths"),
    (["model.vocab_size=256", "dry_run=json"], "data.tokenizer"),
    # run.name: a safe set of characters (it names a folder, a Slurm job and printed commands)
    (["run.name='q$(touch x)'"], "run.name: must be a plain folder name"),
    (["run.name=."], "run.name: must be a plain folder name"),
    (["run.name=../../escaped"], "run.name: must be a plain folder name"),
    (["train.steps=abc"], "train.steps"),
    # one token a row has no next-token target: it trained with a loss of exactly 0
    (["train.seq_len=1"], "train.seq_len: must be an integer in [2, 2147483647]; got 1"),
    (["attention.num_heads=7"], "attention.num_heads"),
    (["attention.impl=flash"], "attention.impl"),
    (["attention.impl=cudnn"], "attention.impl: cudnn needs hardware.platform=gpu"),
    (["attention.cudnn_max_documents=0"], "attention.cudnn_max_documents"),
    (["model.grouped_matmul=triton"], "model.grouped_matmul"),
    (["model.grouped_matmul=mosaic"], "model.grouped_matmul: mosaic needs hardware.platform=gpu"),
    (["router.top_k=9"], "router.top_k"),
    (["hardware=local_cpu8", "train.eval_batch_size=12", "dry_run=true"], "train.eval_batch_size: must be divisible"),
    (["model.ep_transport=ragged", "eval.with_drops=true", "dry_run=true"], "eval.with_drops: must be false"),
    (["data.loss_targets=boundary"], "data.loss_targets"),
    (["model.num_experts=0"], "model.num_experts"),
    (["optim.lr=-0.1"], "optim.lr"),
    (["optim.decay=[{pattern: attn/gate, value: 0.1}, {pattern: nope, value: 0.1}]"], "optim.decay[1].pattern"),
    (["optim.ns_dtype=float16"], "optim.ns_dtype"),
    (["optim=muonh", "optim.offload=true", "optim.grad_clip=1.0"], "optim.grad_clip"),
    (["data.sources.0.weights=[0]", "data.sources.1.weights=[0]"], "all zero"),
    (["data.sources.0.kind=text", "data.sources.0.paths=[/nonexistent/corpus.txt]"], "data.sources[0]"),
]
# these also as a user's process: the status the shell sees, Hydra's output folder never made
IN_A_PROCESS = {"model.capacity_factor=nan", "run.name='q$(touch x)'", "optim.lr=-0.1"}


def _launch(tmp_path, *overrides, **kwargs):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["HYDRA_FULL_ERROR"] = "0"
    streams = kwargs or {"capture_output": True}
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides], cwd=tmp_path, env=env,
                          text=True, timeout=120, **streams)


def _one_line(code: int, err: str, needle: str) -> None:
    """Status 2 and exactly one line on stderr: `error: ...` naming the field (no traceback, no log)."""
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


@pytest.mark.parametrize("overrides,needle", ONE_LINE, ids=[" ".join(c[0]) for c in ONE_LINE])
def test_bad_value_is_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capsys, overrides, needle):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    code = launch_here("model=tiny", "train.steps=1", *overrides, f"run.out_dir={tmp_path / 'out'}")
    _one_line(code, capsys.readouterr().err, needle)
    assert list(tmp_path.iterdir()) == [], "something was written before validation failed"
    if " ".join(overrides) in IN_A_PROCESS:
        proc = _launch(tmp_path, "model=tiny", "train.steps=1", *overrides, f"run.out_dir={tmp_path / 'out'}")
        _one_line(proc.returncode, proc.stderr, needle)
        assert list(tmp_path.iterdir()) == [], "something was written before validation failed"


@pytest.mark.parametrize("overrides,needle", HYDRA, ids=[" ".join(c[0]) for c in HYDRA])
def test_unknown_option_or_key_is_refused_before_anything_is_written(tmp_path, overrides, needle):
    proc = _launch(tmp_path, *overrides, f"run.out_dir={tmp_path / 'out'}")
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "something was written before validation failed"


def test_unwritable_out_dir_and_unreachable_store_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    _one_line(launch_here("model=tiny", f"run.out_dir={tmp_path / 'afile' / 'out'}"), capsys.readouterr().err,
              "run.out_dir")
    _one_line(launch_here("model=tiny", f"run.out_dir={tmp_path / 'out'}", "tracking.uri=http://127.0.0.1:9"),
              capsys.readouterr().err, "tracking.uri")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"], "something was written"


@pytest.mark.parametrize("key", ["resume", "reproduce"])
def test_truncated_record_json_is_one_line(tmp_path, monkeypatch, capsys, key):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "composed.yaml").write_text("model: {}\n")
    (run / "record.json").write_text('{"run_id": "abc", "tracking_')
    _one_line(launch_here(f"{key}={run}", f"run.out_dir={tmp_path / 'out'}"), capsys.readouterr().err, "record.json")
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_closed_stdout_ends_quietly(tmp_path):
    """`launch.py dry_run=true | head -1`: the reader is gone before the plan is written."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = _launch(tmp_path, "model=tiny", "dry_run=true", f"run.out_dir={tmp_path / 'out'}",
                       stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 141


def test_a_context_extension_stage_needs_its_starting_checkpoint():
    from marin.config.validate import ConfigError
    from marin.launch.checks import load
    from tests.helpers import compose_dict

    with pytest.raises(ConfigError, match="train.init_from"):
        load(compose_dict("train.init_seq_len=64", "train.seq_len=256"))
    load(compose_dict("train.init_seq_len=64", "train.seq_len=256", "dry_run=true"))  # a plan needs none


# Mostly read before Hydra composes (marin/launch/command_line.py): a habit Hydra would answer with
# a folder made, a run of defaults, or several lines of advice. (overrides, the exact line)
BEFORE_HYDRA = [
    (["hydra.run.dir=/tmp/x", "dry_run=true"],
     "error: hydra.run.dir: marin writes nothing there; use run.out_dir=<folder> "
     "(a run's directory is <run.out_dir>/<run.name>)"),
    (["+hydra.sweep.dir=/tmp/x", "dry_run=true"],
     "error: hydra.sweep.dir: marin writes nothing there; use run.out_dir=<folder> "
     "(a run's directory is <run.out_dir>/<run.name>)"),
    # without -m Hydra composed a named sweep's file and ran one job of defaults as if it were the sweep
    (["sweep=lr_grid"], "error: sweep=lr_grid has 4 jobs: add -m"),
    (["sweep=lr_grid", "optim.lr=1e-3"], "error: sweep=lr_grid has 1 job: add -m"),
    (["sweep=lr_grid,router_ablation"], "error: sweep=lr_grid,router_ablation is a sweep of 2 values: add -m"),
    (["optim.lr=1e-3,3e-3"], "error: optim.lr=1e-3,3e-3 is a sweep of 2 values: add -m"),
    (["train.steps=range(1,4)", "dry_run=true"], "error: train.steps=range(1,4) is a sweep of 3 values: add -m"),
    # a typo: the nearest names, where Hydra advised `+key=value` (which validation refuses next)
    (["modle=tiny"], "error: modle: no such key or group; did you mean model?"),
    (["train.step=50"], "error: train.step: no such key; did you mean train.steps?"),
    (["steps=50"], "error: steps: no such key or group; did you mean train.steps / sweep?"),
    (["-m", "optim.lrr=1e-3,3e-3"], "error: optim.lrr: no such key; did you mean optim.lr?"),
    (["+train.stepz=3"],
     "error: invalid config: train.stepz: not a field of the schema (TrainConfig); did you mean train.steps?"),
    # an unknown option: Hydra listed the group's options a line each, then its search path
    (["model=tinyy"], f"error: model=tinyy: no such option of model; did you mean tiny? (model has {_options('model')})"),
    (["router=zzz"], f"error: router=zzz: no such option of router; router has {_options('router')}"),
    (["-m", "sweep=lr_gird"],
     f"error: sweep=lr_gird: no such option of sweep; did you mean lr_grid? (sweep has {_options('sweep')})"),
    # a group given no option: Hydra raised a ValueError (a traceback)
    (["model=null"], f"error: model=null: a group takes the name of one of its options (model has {_options('model')})"),
    (["experiment=null"], "error: experiment=null: a group takes the name of one of its options (experiment has "
                          f"{_options('experiment')}); without experiment=… none is used"),
    # a key below a dict field, or below one value: Hydra said "Key 'X' is not in struct"
    (["hardware.env.X=1"], "error: hardware.env.X: hardware.env has no key X; add one with +hardware.env.X=<value>"),
    (["train.steps.x=1"], "error: train.steps.x: no such key; train.steps is one value, with no keys below it "
                          "(train.steps=<value>)"),
    (["hardware.xla_flags.a=1"], "error: hardware.xla_flags.a: no such key; hardware.xla_flags is one value, with no "
                                 "keys below it (hardware.xla_flags=<value>)"),
    # two starting points: resume= won and reproduce= was ignored, silently
    (["resume=a", "reproduce=b"], "error: resume= and reproduce=: give one of them (resume= continues a run; "
                                  "reproduce= runs a saved config again)"),
    # a typed field's value: Hydra's merge error was five lines
    (["tracking.report=maybe"], "error: tracking.report: must be true or false; got 'maybe'"),
    (["verify=first"], "error: verify: must be true or false; got 'first' "
                       "(a replay of run first: python launch.py reproduce=first verify=true)"),
    (["verify=lr_grid/lr=0.001"], "error: verify: must be true or false; got 'lr_grid/lr=0.001' "
                                  "(a replay of run lr_grid/lr=0.001: python launch.py reproduce=lr_grid/lr=0.001 verify=true)"),
    # Hydra's grammar: three lines and a link
    (["optim.lr=1=2"], "error: optim.lr=1=2: mismatched input '=' expecting <EOF> (Hydra's override grammar: "
                       "quote a value that holds '=' or a space, key='a=b')"),
    # nothing close: every key allowed there
    (["model.zzz=3"], "error: model.zzz: no such key; model has " + ", ".join(f.name for f in fields(ModelConfig))),
]


@pytest.mark.parametrize("overrides,line", BEFORE_HYDRA, ids=[" ".join(c[0]) for c in BEFORE_HYDRA])
def test_hydra_habit_is_one_exact_line(tmp_path, overrides, line):
    overrides = [o.replace("/tmp/x", str(tmp_path / "x")) for o in overrides]
    flags = [o for o in overrides if o.startswith("-")]  # before the overrides, as Hydra's parser wants
    proc = _launch(tmp_path, *flags, "model=tiny", "train.steps=1", *(o for o in overrides if o not in flags),
                   f"run.out_dir={tmp_path / 'out'}")
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, line + "\n", "")
    assert list(tmp_path.iterdir()) == [], "something was written"


def test_stop_at_past_the_last_step_is_one_line_naming_it():
    """Issue 40 item 7: train.stop_at ends a run at a lineage's cutover; past train.steps it is refused."""
    from marin.config.validate import ConfigError
    from tests.helpers import make_config

    with pytest.raises(ConfigError, match=r"train.stop_at: must be ≤ train.steps \(10\); got 11"):
        make_config("train.steps=10", "train.stop_at=11")
    with pytest.raises(ConfigError, match=r"data.shuffle_window: must be a multiple of train.seq_len \(128\)"):
        make_config("data.shuffle_window=100")


def test_a_long_or_unsafe_sweep_id_and_a_huge_name_are_one_short_line():
    """A 120 KB value pasted by mistake: refused naming the field, quoted cut short."""
    from marin.config.validate import ConfigError
    from tests.helpers import make_config

    with pytest.raises(ConfigError, match=r"run.sweep_id: must be 1–64 letters.*\(120,000 characters\)") as err:
        make_config("run.sweep_id=" + "x" * 120_000)
    assert len(str(err.value)) < 400
    with pytest.raises(ConfigError, match=r"run.sweep_id: must be"):
        make_config("run.sweep_id=../a")
    with pytest.raises(ConfigError, match=r"run.name: must be a plain folder name.*\(5,000 characters\)") as err:
        make_config("run.name=" + "y" * 5_000)
    assert len(str(err.value)) < 400


PREPARE = [  # python -m marin.data.prepare reads its command line as launch.py does
    (["data=nosuch"], f"error: data=nosuch: no such option of data; data has {_options('data')}"),
    (["modle=tiny"], "error: modle: no such key or group; did you mean model?"),
    (["data.prepare_tasks=abc"], "error: data.prepare_tasks: must be an integer; got 'abc'"),
    (["data.shard_tokens=1,2"], "error: data.shard_tokens=1,2 is a sweep of 2 values: prepare one config at a time"),
]


@pytest.mark.parametrize("overrides,line", PREPARE, ids=[" ".join(c[0]) for c in PREPARE])
def test_the_prepare_command_refuses_bad_input_as_launch_does(tmp_path, overrides, line):
    proc = subprocess.run([sys.executable, "-m", "marin.data.prepare", *overrides, "dry_run=true",
                           f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(ROOT)})
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, line + "\n", "")
    assert list(tmp_path.iterdir()) == [], "something was written"


def test_a_config_folder_of_ones_own_that_is_missing_or_not_yaml_is_one_line(tmp_path):
    """A YAML slip in one's own option file was a 40-line traceback; a --config-dir that is not
    there, two lines and a hint about HYDRA_FULL_ERROR."""
    broken = tmp_path / "conf" / "model" / "broken.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text("d_model: 64\n  bad: [\n")
    proc = _launch(tmp_path, "--config-dir", str(tmp_path / "conf"), "model=broken", "dry_run=true")
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        2, f"error: {broken}, line 2, column 6: not valid YAML (mapping values are not allowed here)\n", "")
    proc = _launch(tmp_path, "--config-dir", str(tmp_path / "none"), "dry_run=true")
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        2, f"error: --config-dir: {tmp_path / 'none'} is not a folder (one of your own config groups: "
           "<dir>/model/mine.yaml …)\n", "")
    assert [p.name for p in tmp_path.iterdir()] == ["conf"], "something was written"
