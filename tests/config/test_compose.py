"""Every option of every group, every experiment and every sweep composes and validates."""
import pytest

from marin.config.store import options
from marin.config.schema import GROUPS
from tests.helpers import make_config

GROUP_OPTIONS = [(g, o) for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if group == "hardware" or (group == "model" and option == "mochi"):
        # multi-device hardware needs experts and a batch its mesh axes divide: the hero's shapes
        overrides += ["model=mochi", "attention=mochi_full", "router.top_k=8", "train.global_batch=33792"]  # 1,024 × 33: every rack count divides it
    if group in ("hardware", "model", "data"):
        overrides.append("dry_run=true")  # site-specific data files are checked only when training
    cfg = make_config(*overrides)
    assert getattr(cfg, group).name == option


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
