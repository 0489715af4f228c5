"""The published experiments compose, validate, and reproduce the published numbers (spec §1, §4,
§7) from the code's own accounting: nothing here is typed into the configs."""
import pytest

from marin.config import derive
from marin.launch.plan import plan
from tests.helpers import make_config

HERO = "mochi_535b_a23b"
EXPERIMENTS = [HERO, "mochi_535b_a23b_8k", "mochi_535b_a23b_65k",
               "ladder_d768", "ladder_d1024", "ladder_d1536", "ladder_d2048"]

# rung: (d, layers, racks, total params, active params, tokens, each ± half its last published digit)
LADDER = {
    "ladder_d768": (768, 8, 1, (1.6e9, 0.05e9), (61e6, 0.5e6), (48e9, 0.5e9)),
    "ladder_d1024": (1024, 12, 2, (4.0e9, 0.05e9), (162e6, 0.5e6), (128e9, 0.5e9)),
    "ladder_d1536": (1536, 16, 6, (11.5e9, 0.05e9), (481e6, 0.5e6), (381e9, 0.5e9)),
    "ladder_d2048": (2048, 22, 11, (27.7e9, 0.05e9), (1.2e9, 0.05e9), (926e9, 0.5e9)),
}


def experiment(name: str):
    # dry_run: validated as a plan, without the site's data files (the hero mixture's cells)
    return make_config(f"experiment={name}", "dry_run=true")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_validates_and_names_its_run(name):
    cfg = experiment(name)
    assert (cfg.run.name, cfg.run.experiment) == (name, name)
    assert cfg.train.global_batch * cfg.train.seq_len == plan(cfg)["tokens_per_step"]


def test_hero_matches_the_published_numbers():
    p = plan(experiment(HERO))
    assert p["total_params"] == pytest.approx(535.3e9, abs=0.05e9)
    assert p["active_params"] == pytest.approx(22.76e9, abs=0.005e9)
    assert p["steps"] == 390_251
    assert p["tokens"] == pytest.approx(18.0e12, abs=0.05e12)
    assert p["train_flops"] == pytest.approx(2.7e24, abs=0.05e24)
    assert p["train_flops_no_head"] == pytest.approx(2.61e24, abs=0.02e24)
    assert (p["seq_len"], p["global_batch"]) == (4096, 11_264)
    assert p["b2"] == 0.95  # the rule's clip at the hero's batch


def test_hero_recipe_and_layout():
    cfg = experiment(HERO)
    a, m = cfg.attention, cfg.model
    assert (m.d_model, m.num_layers, a.num_heads, a.head_dim) == (6144, 48, 48, 128)
    assert (a.kv_heads_local, a.kv_heads_global, a.window) == (12, 6, 2048)
    assert (m.num_experts, cfg.router.top_k, cfg.router.kind, m.latent_dim, m.expert_width) == (384, 8, "qb", 3072, 3072)
    assert (cfg.optim.name, m.remat, m.compute_dtype) == ("muonh", "full", "bfloat16")
    assert (m.offload_carry, cfg.optim.offload, cfg.hardware.mesh.fsdp) == (True, True, True)  # the layout that fits
    mesh = cfg.hardware.mesh
    assert (mesh.replica_dcn, mesh.data, mesh.expert, mesh.model) == (11, 1, 64, 1)


def test_hero_operations_and_evaluation_are_productions():
    """Spec §9 "Operations" and "Evaluation", on the composed hero config."""
    from marin.config.schema import EvalSetConfig
    from marin.config.validate import ConfigError

    cfg = experiment(HERO)
    ck = cfg.train.checkpoint
    assert (ck.keep_last, ck.permanent_every, ck.permanent_steps) == (1, 0, [55_000])   # 1 rolling + 55,000
    assert (cfg.hardware.max_requeues, cfg.hardware.max_restarts) == (100, 1_000)
    racks, devices = cfg.hardware.racks, derive.device_count(cfg.hardware)
    assert cfg.train.eval_batch_size == derive.EVAL_ROWS_PER_RACK * racks == devices == 704   # one per device
    assert cfg.train.eval_batches is None                                   # every batch of every set
    assert cfg.data.loss_targets == "causal"
    assert cfg.eval.with_drops is True                                      # pooled: with drops too
    assert experiment("ladder_d768").train.eval_batch_size == 64            # one rack
    # From the ragged switch (81,716) on, dropless evaluation only: the lineage's cutover and the
    # context stages turn the with-drops pass off; an explicit one with ragged is refused.
    ragged = make_config(f"experiment={HERO}", "model.ep_transport=ragged", "dry_run=true")
    assert ragged.eval.with_drops is False
    assert experiment("mochi_535b_a23b_8k").eval.with_drops is False
    with pytest.raises(ConfigError, match="eval.with_drops"):
        make_config(f"experiment={HERO}", "model.ep_transport=ragged", "eval.with_drops=true", "dry_run=true")
    # the headline: the dropless Paloma macro average (the site's Paloma copy is the hero's eval set)
    assert [s.name for s in cfg.data.eval_sets] == ["paloma"] and cfg.data.eval_sets[0].subsets
    assert cfg.eval.headline == "eval/paloma/macro_loss"
    cfg.data.eval_sets = [EvalSetConfig(name="heldout", kind="jsonl", paths=["heldout.jsonl"])]
    assert derive.headline_metric(cfg) == "eval/macro_loss"                # no Paloma: the mean of the sets


def test_hero_lineage_turns_the_with_drops_pass_off_at_the_ragged_cutover():
    import yaml

    from marin.config.paths import CONF_DIR

    runs = yaml.safe_load((CONF_DIR / "lineage" / "mochi_hero.yaml").read_text())["runs"]
    overrides = [o for r in runs for o in r["overrides"]]
    [cut] = [r for r in runs if "model.ep_transport=ragged" in r["overrides"]]
    assert cut["from_step"] == 81_716 and "eval.with_drops=false" in cut["overrides"]
    cfg = make_config(f"experiment={HERO}", *overrides, "dry_run=true")
    assert cfg.eval.with_drops is False


def test_hero_numerics_and_gate_router_decay_are_the_published_ones():
    from marin.optim.decay import coefficient

    cfg = experiment(HERO)
    assert (cfg.optim.ns_dtype, cfg.optim.ns_eps) == ("bfloat16", 1e-8)
    assert (cfg.attention.qk_norm_eps, cfg.model.router_dtype) == (1e-6, "bfloat16")
    steps = plan(cfg)["steps"]
    # marin#8833: the line 0.02 at step 0 → 0 at the last step, only on the head gates and the
    # router, switched on at step 58,014 (spec §8).
    assert [(r.pattern, r.value, r.origin, r.start, r.end) for r in cfg.optim.decay] == [
        ("attn/gate", 0.02, 0, 58_014, steps), ("moe/router", 0.02, 0, 58_014, steps)]
    assert coefficient(cfg.optim.decay[0], 58_013) == 0.0  # off at launch
    assert coefficient(cfg.optim.decay[0], 58_014) == pytest.approx(0.01703, abs=5e-6)  # where it was switched on
    # The context-extension stage continues the same line (same steps), not a fresh one.
    assert experiment("mochi_535b_a23b_8k").optim.decay == cfg.optim.decay


@pytest.mark.parametrize("name", list(LADDER))
def test_ladder_rung_matches_the_published_size(name):
    d, layers, racks, total, active, tokens = LADDER[name]
    cfg = experiment(name)
    p = plan(cfg)
    assert p["total_params"] == pytest.approx(total[0], abs=total[1])
    assert p["active_params"] == pytest.approx(active[0], abs=active[1])
    assert p["tokens"] == pytest.approx(tokens[0], abs=tokens[1])
    # The same recipe at width d (spec §4), 1,024 sequences per rack, one rack per replica.
    a, m = cfg.attention, cfg.model
    heads = d // 128
    assert (m.d_model, m.num_layers, a.head_dim, a.num_heads) == (d, layers, 128, heads)
    assert (a.kv_heads_local, a.kv_heads_global) == (max(1, heads // 4), max(1, heads // 8))
    assert m.latent_dim == m.expert_width == m.shared_width == d // 2
    assert (m.num_experts, cfg.router.top_k, m.num_shared_experts, a.window) == (384, 8, 2, 2048)
    assert (cfg.optim.name, cfg.train.seq_len) == ("muonh", 4096)
    assert cfg.train.global_batch == 1024 * racks
    assert (cfg.hardware.racks, cfg.hardware.mesh.replica_dcn, p["devices"]) == (racks, racks, 64 * racks)


def test_context_stages_rescale_qk_mult_by_the_rule():
    hero, k8, k65 = experiment(HERO), experiment("mochi_535b_a23b_8k"), experiment("mochi_535b_a23b_65k")
    assert hero.attention.qk_mult == 1.3
    assert k8.attention.qk_mult == pytest.approx(1.390, abs=5e-4)  # spec §7: 1.3 → 1.390 for 4K → 8K
    # Stated in the experiments (spec §9: the launcher's explicit --qk-mult) to the spec's three
    # decimals; the rule computes them.
    assert k8.attention.qk_mult == pytest.approx(derive.qk_mult_for_length(1.3, 4096, 8192), abs=5e-4)
    # 8K → 65K compounds on the 8K stage's value, not on the pretraining one.
    assert k65.attention.qk_mult == pytest.approx(derive.qk_mult_for_length(k8.attention.qk_mult, 8192, 65536),
                                                  abs=5e-4)
    assert (k8.train.seq_len, k8.train.init_seq_len, k65.train.seq_len, k65.train.init_seq_len) == (8192, 4096, 65536, 8192)
    for name in ("mochi_535b_a23b_8k", "mochi_535b_a23b_65k"):  # a number in the file, not `auto`
        assert make_config(f"experiment={name}", "attention.qk_mult_base=1.0", "dry_run=true").attention.qk_mult \
            == experiment(name).attention.qk_mult


def test_context_stages_keep_the_recipe_in_force_at_their_step():
    """spec §9 "Context launcher": ragged transport (from 81,716), gate/router decay (on from
    58,014), the 108,000 mixture, eval at 4K, and read positions a stage continues exactly."""
    hero = experiment(HERO)
    for name in ("mochi_535b_a23b_8k", "mochi_535b_a23b_65k"):
        cfg = experiment(name)
        first = plan(cfg)["init"]["first_step"]
        assert cfg.model.ep_transport == "ragged" and 81_716 < first
        assert cfg.data.name == "mochi_hero_108k" and cfg.data.cells_from_step == 108_000 < first
        assert all(r.start == 58_014 < first for r in cfg.optim.decay) and cfg.optim.decay == hero.optim.decay
        assert cfg.train.eval_seq_len == hero.train.seq_len == 4096 != cfg.train.seq_len
        assert not cfg.eval.with_drops  # dropless only after the ragged switch (spec §9)
        from marin.model import accounting  # the eval estimate is at the eval length, not the stage's
        at_stage_len = make_config(f"experiment={name}", f"train.eval_seq_len={cfg.train.seq_len}", "dry_run=true")
        assert accounting.eval_memory_per_device(cfg) < accounting.eval_memory_per_device(at_stage_len)
        window = cfg.data.shuffle_window
        assert window == hero.data.shuffle_window and all(window % n == 0 for n in derive.stage_seq_lens(cfg))


@pytest.mark.parametrize("name", ["mochi_535b_a23b_8k", "mochi_535b_a23b_65k"])
def test_a_stage_dry_run_shows_what_it_keeps(name, capsys):
    from marin.launch.plan import print_plan

    cfg = experiment(name)
    print_plan(cfg)
    out = capsys.readouterr().out
    context = out[out.index("context extension"):]
    assert f"qk_mult                    {cfg.attention.qk_mult:.5g} (stated" in context
    assert "eval seq_len               4,096" in context
    assert "ragged transport; mixture mochi_hero_108k; decay attn/gate from step 58,014" in context
    assert f"{cfg.data.shuffle_window:,}-token shuffle windows" in context


def test_context_stages_keep_the_run_schedule():
    """Same tokens per step as pretraining, so the run's horizon and the lr rule resolve as there."""
    hero = plan(experiment(HERO))
    for name in ("mochi_535b_a23b_8k", "mochi_535b_a23b_65k"):
        p = plan(experiment(name))
        assert (p["tokens_per_step"], p["run_steps"], p["lr"], p["eps"]) == (
            hero["tokens_per_step"], hero["steps"], hero["lr"], hero["eps"])


def test_context_stages_plan_their_own_steps_tokens_and_flops():
    """Each stage reports its own part of the run, not the whole run's steps (spec §7): the 8K
    stage from stage_start to where the 65K stage starts, the 65K stage to the run's end."""
    hero_cfg = experiment(HERO)
    hero = plan(hero_cfg)
    k8_cfg, k65_cfg = experiment("mochi_535b_a23b_8k"), experiment("mochi_535b_a23b_65k")
    k8, k65 = plan(k8_cfg), plan(k65_cfg)
    run = hero["steps"]
    assert k8["init"]["first_step"] == round(k8_cfg.train.stage_start * run)
    assert k8["init"]["last_step"] == k65["init"]["first_step"] == round(k8_cfg.train.stage_end * run)
    assert k8_cfg.train.stop_after == k8["init"]["last_step"]  # the loop stops there
    assert k65["init"]["last_step"] == run and k65_cfg.train.stop_after is None
    for cfg, p in ((k8_cfg, k8), (k65_cfg, k65)):
        assert 0 < p["steps"] == p["init"]["last_step"] - p["init"]["first_step"] < run
        assert p["tokens"] == p["steps"] * cfg.train.seq_len * cfg.train.global_batch < hero["tokens"]
        assert p["global_batch"] * p["seq_len"] == hero["tokens_per_step"]
        per_token = p["train_flops"] / p["tokens"]
        assert per_token > hero["train_flops"] / hero["tokens"]  # longer global-attention spans
    # The stages and the pretraining before them cover the run exactly once.
    assert k8["init"]["first_step"] + k8["steps"] + k65["steps"] == run


def test_stage_fields_are_checked():
    from marin.config.validate import ConfigError

    with pytest.raises(ConfigError, match="train.stage_start"):
        make_config("train.stage_start=0.5", "dry_run=true")  # not a context-extension stage
    with pytest.raises(ConfigError, match="train.stage_end"):
        make_config("experiment=mochi_535b_a23b_8k", "train.stage_end=0.4", "dry_run=true")


def test_qk_mult_auto_without_extension_is_the_base():
    assert make_config("attention.qk_mult=auto", "attention.qk_mult_base=1.7").attention.qk_mult == 1.7
    cfg = make_config("attention.qk_mult=auto", "train.init_seq_len=64", "train.seq_len=256", "dry_run=true")
    assert cfg.attention.qk_mult == pytest.approx(1.3 * (1 + 0.1 * 1.3862943611198906))


def test_the_readmes_hero_story_plans_as_dry_runs():
    """README "The hero run, as configs": every `launch.py experiment=…` line plans (dry_run=true),
    and each fork's state plans from the experiment with the fork's overrides (a fork= line itself
    needs its parent run)."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    story = readme.split("## The hero run, as configs", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line.split("#", 1)[0]) for line in story.splitlines() if line.startswith("python launch.py")]
    planned = 0
    for words in lines:
        args = [w for w in words[2:] if not w.startswith(("dry_run=", "resume="))]
        if not args or any("<" in w for w in args if not w.startswith("train.init_from=")):
            continue
        args = [re.sub(r"<run>@", "some-run@", w) for w in args]
        if args[0].startswith("fork="):  # the state the fork runs in: the experiment with its overrides
            args = ["experiment=mochi_535b_a23b", *args[1:]]
        out = plan(make_config(*args, "dry_run=true"))
        assert out["steps"] > 0 and out["fits"], (words, out["fits"])
        planned += 1
    assert planned == 5, lines  # launch (twice: compile, named), two forks' states, the 8K stage
