"""Every option of every group, every experiment and every sweep composes and validates."""
import pytest

from marin.config.schema import GROUPS
from marin.config.store import options
from tests.helpers import make_config

GROUP_OPTIONS = [(g, o) for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if group == "hardware" or (group == "model" and option == "mochi"):
        # multi-device hardware needs experts and a batch its mesh axes divide: the hero's shapes
        overrides += ["model=mochi", "attention=mochi_full", "router.top_k=8", "train.global_batch=33792",  # 1,024 × 33: every rack count divides it
                      "data.allow_vocab_mismatch=true"]  # the byte tokenizer on a 128,256 vocabulary: a site sets data.tokenizer
    if group in ("hardware", "model", "data"):
        overrides.append("dry_run=true")  # site-specific data files are checked only when training
    cfg = make_config(*overrides)
    assert getattr(cfg, group).name == option


def test_option_files_do_not_repeat_their_name():
    """The name is the option chosen (marin.config.store.name_options), written nowhere else."""
    import yaml

    from marin.config.paths import CONF_DIR

    for group in GROUPS:
        for path in (CONF_DIR / group).glob("*.yaml"):
            assert "name" not in (yaml.safe_load(path.read_text()) or {}), path


def test_a_group_without_a_chosen_option_is_one_line(tmp_path):
    """`~model` (no option) leaves model.name missing: one line naming the field, exit 2."""
    import subprocess
    import sys

    from marin.config.paths import PROJECT_ROOT

    done = subprocess.run([sys.executable, "launch.py", "~model", "dry_run=true", f"run.out_dir={tmp_path}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "model.name" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_validates(experiment):
    cfg = make_config(f"experiment={experiment}", "dry_run=true")
    assert cfg.run.experiment == experiment
    assert isinstance(cfg.train.steps, int) and cfg.train.steps > 0


def test_default_config_has_no_auto_after_resolution():
    cfg = make_config()
    for value in (cfg.attention.num_heads, cfg.attention.kv_heads_local, cfg.model.latent_dim,
                  cfg.model.init_std, cfg.train.steps, cfg.hardware.mesh.data, cfg.train.micro_batch):
        assert value != "auto"
    assert cfg.attention.num_heads * cfg.attention.head_dim == cfg.model.d_model


def test_derived_values_follow_the_ladder_rules():
    cfg = make_config("model.d_model=1024", "attention.head_dim=128")
    assert (cfg.attention.num_heads, cfg.attention.kv_heads_local, cfg.attention.kv_heads_global) == (8, 2, 1)
    assert cfg.model.expert_width == cfg.model.latent_dim == cfg.model.shared_width == 512
    assert cfg.model.init_std == pytest.approx(0.5 / 1024 ** 0.5)


def test_steps_auto_follows_the_token_budget():
    from marin.model import accounting

    cfg = make_config("train.steps=auto")
    expected = round(cfg.train.tokens_per_active_param * accounting.active_params(cfg)
                     / (cfg.train.seq_len * cfg.train.global_batch))
    assert cfg.train.steps == max(1, expected)


def test_explicit_values_are_kept():
    cfg = make_config("attention.num_heads=8", "attention.head_dim=16", "attention.kv_heads_local=4",
                      "attention.kv_heads_global=2", "train.steps=7")
    assert (cfg.attention.num_heads, cfg.attention.kv_heads_local, cfg.train.steps) == (8, 4, 7)


def test_no_schema_option_in_any_group():
    """Schemas type the groups without being options: not listed, not selectable."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType
    from hydra.errors import ConfigCompositionException

    from marin.config.paths import CONF_DIR
    from marin.config.store import register
    from tests.helpers import compose_dict

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in GROUPS:
            assert sorted(loader.get_group_options(group, ObjectType.CONFIG)) == options(group)  # what glob(*) and completion list
    with pytest.raises(ConfigCompositionException, match="Could not find 'router/schema'"):
        compose_dict("router=schema")


def test_help_lists_no_schema_and_option_files_are_typed(tmp_path):
    """`--help` lists real options only; an option file from --config-dir is still type-checked."""
    import subprocess
    import sys

    from marin.config.paths import PROJECT_ROOT

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "typo.yaml").write_text("name: typo\nd_modle: 64\n")
    done = subprocess.run([sys.executable, "launch.py", "--help"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    groups = done.stdout.split("== Config ==")[0]
    assert "router: bias_update, qb, softmax_aux" in groups and "schema" not in groups
    done = subprocess.run([sys.executable, "launch.py", "--config-dir", str(tmp_path), "model=typo", "--cfg", "job"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and "Key 'd_modle' not in 'ModelConfig'" in done.stderr


# Override sets that tests compose through tests.helpers.compose_dict: options, experiments, values
# of every kind Hydra's grammar parses (numbers, null, lists, quoted strings, interpolations,
# top-level keys), `+` additions, and the bad ones with their errors.
SAME_AS_HYDRA = [
    ("model=tiny", "train.steps=5", "optim.lr=1e-3", "run.name=a.b", "tracking.uri=null"),
    ("experiment=mochi_535b_a23b", "dry_run=true", "train.steps=7", "model.num_layers=2"),
    ("train.seq_len=32", "model=tiny", "hardware.setup=[a,b]", "hardware.xla_flags='--x=1 --y'", "dry_run=json"),
    ("model=tiny", "+hardware.env.FOO=bar", "train.steps=3", "run.name=${model.name}"),
    ("sweep=lr_grid", "train.steps=2"),
    ("model=tiny", "model.hiden=3"),
    ("model=tiny", "model.d_model=abc"),
    ("model=nope", "train.steps=2"),
    ("model=tiny", "train.steps=["),
]


@pytest.mark.parametrize("overrides", SAME_AS_HYDRA, ids=[" ".join(o) for o in SAME_AS_HYDRA])
def test_the_tests_compose_gives_hydras_config_and_errors(overrides):
    """compose_dict sets value overrides on a memoised compose of the options (tests/helpers.py):
    the same config, or the same error, as Hydra composing all of them."""
    from omegaconf import OmegaConf

    from marin.config.store import compose
    from tests.helpers import compose_dict

    def outcome(make):
        try:
            return OmegaConf.to_yaml(make())
        except Exception as err:  # noqa: BLE001 (the error is what is compared)
            return type(err).__name__, str(err)
    assert outcome(lambda: compose_dict(*overrides)) == outcome(lambda: compose(overrides))


def _cfg_job(*args):
    import subprocess
    import sys

    from marin.config.paths import PROJECT_ROOT

    done = subprocess.run([sys.executable, "launch.py", "--cfg", "job", *args], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cfg_job_shows_the_option_names_chosen():
    """Hydra's own --cfg job prints the composed config before marin names the options: `???`."""
    import yaml

    tree = yaml.safe_load(_cfg_job("model=tiny", "router=softmax_aux"))
    assert (tree["model"]["name"], tree["router"]["name"], tree["optim"]["name"]) == ("tiny", "softmax_aux", "adamw")
    assert "???" not in yaml.safe_dump(tree)
    assert tree["attention"]["num_heads"] == "auto"  # composed, not resolved
    assert _cfg_job("model=tiny", "--package", "model.name") == "tiny\n"


def test_cfg_job_resolve_fills_auto():
    """--resolve shows what the run gets: every auto derived (Hydra's fills interpolations only)."""
    import yaml

    out = _cfg_job("--resolve", "model=tiny", "train.steps=auto")
    tree = yaml.safe_load(out)
    assert isinstance(tree["train"]["steps"], int) and tree["attention"]["num_heads"] == 2, out
    assert "auto" not in out.split() and "???" not in out
    assert yaml.safe_load(_cfg_job("--resolve", "-p", "attention", "model=tiny"))["num_heads"] == 2


def test_the_default_run_keeps_a_checkpoint_to_fork_from_every_tenth_of_it():
    """permanent_every auto (issue 42 item 7): every 10% of a run of 100 steps or more; none below."""
    from marin.config import derive

    cfg = make_config()
    assert cfg.train.checkpoint.permanent_every == cfg.train.steps // 10 == 20   # steps 20, 40, …, 200
    assert make_config("train.steps=1000").train.checkpoint.permanent_every == 100
    assert make_config("train.steps=50").train.checkpoint.permanent_every == 0 == derive.permanent_every(99)
    assert make_config("train.checkpoint.permanent_every=7").train.checkpoint.permanent_every == 7
