"""warmup_linear: warmup, peak, final value at the last step, the shortened horizon."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marin.optim import lr_at
from marin.optim.hparams import padded_breakpoints
from marin.optim.schedule import interp_schedule, warmup_steps
from tests.optim import config

PEAK = 1e-2


def curve(cfg, steps):
    return np.array([lr_at(cfg, s)["adamw"] for s in steps])


def test_warmup_peak_and_final():
    cfg = config(steps=1000, lr=PEAK, warmup_frac=0.01, final_ratio=0.05)  # 10 warmup steps
    W = warmup_steps(cfg)
    warm = curve(cfg, range(W + 1))
    np.testing.assert_allclose(warm, PEAK * np.arange(W + 1) / W, rtol=1e-6)
    assert lr_at(cfg, 999)["adamw"] == pytest.approx(0.05 * PEAK)
    assert lr_at(cfg, 5000)["adamw"] == pytest.approx(0.05 * PEAK)  # past the end: stays final
    decay = curve(cfg, range(W, 1000))
    assert np.all(np.diff(decay) < 0)
    np.testing.assert_allclose(np.diff(decay, 2), 0, atol=1e-12)  # linear


@pytest.mark.parametrize("steps, warmup_frac", [(1000, 0.01), (390_251, 0.01), (20, 0.01), (200, 0.05)])
def test_lr_is_zero_at_step_0_and_peaks_at_step_w_as_optax_warmup(steps, warmup_frac):
    """Production's warmup (spec §9): lr(0) = 0, the peak at step W, as optax's linear warmup."""
    cfg = config(steps=steps, lr=PEAK, warmup_frac=warmup_frac)
    W = warmup_steps(cfg)
    assert W >= 1
    warm = optax.linear_schedule(0.0, PEAK, W)
    assert lr_at(cfg, 0)["adamw"] == float(warm(0)) == 0.0
    assert lr_at(cfg, W)["adamw"] == pytest.approx(float(warm(W))) == pytest.approx(PEAK)
    assert lr_at(cfg, W - 1)["adamw"] < PEAK and lr_at(cfg, W + 1)["adamw"] < PEAK
    assert lr_at(cfg, steps - 1)["adamw"] == pytest.approx(0.05 * PEAK)


def test_horizon_reslopes_decay():
    cfg = config(steps=1000, lr=PEAK, horizon_steps=750)
    full = config(steps=1000, lr=PEAK)
    np.testing.assert_allclose(curve(cfg, range(10)), curve(full, range(10)))  # warmup unchanged
    assert lr_at(cfg, 749)["adamw"] == pytest.approx(0.05 * PEAK)
    mid = (warmup_steps(cfg) + 749) / 2
    assert lr_at(cfg, mid)["adamw"] == pytest.approx(PEAK * (1 + 0.05) / 2)
    assert lr_at(cfg, 500)["adamw"] < lr_at(full, 500)["adamw"]


def test_horizon_change_mid_run_is_continuous():
    full = config(steps=1000, lr=PEAK)
    cfg = config(steps=1000, lr=PEAK, horizon_steps=750, horizon_from_step=500)
    before = range(0, 501)
    np.testing.assert_allclose(curve(cfg, before), curve(full, before), rtol=1e-6)
    after = curve(cfg, range(500, 750))
    np.testing.assert_allclose(np.diff(after, 2), 0, atol=1e-12)
    assert after[-1] == pytest.approx(0.05 * PEAK)
    with pytest.raises(ValueError, match="horizon_from_step"):
        lr_at(config(steps=1000, horizon_steps=750, horizon_from_step=749), 0)


def test_group_lrs_follow_the_schedule():
    cfg = config("muonh", steps=1000, lr=PEAK)
    at = lr_at(cfg, 500)
    assert set(at) == {"muonh", "adamh", "adam"}
    assert at["muonh"] == pytest.approx(cfg.optim.muonh_lr_ratio * at["adam"])


def test_optax_schedule_matches_logged_lr_under_jit():
    cfg = config(steps=300, lr=PEAK, warmup_frac=0.05, horizon_steps=200, horizon_from_step=100)
    schedule = jax.jit(interp_schedule(PEAK, *map(jnp.asarray, padded_breakpoints(cfg))))  # as the optimizer builds it
    for step in (0, 7, 14, 15, 100, 150, 199, 250):
        assert float(schedule(jnp.int32(step))) == pytest.approx(lr_at(cfg, step)["adamw"], rel=1e-5)


def test_hero_warmup_and_phase_boundary_follow_productions_rule():
    """Production (levanter `_convert_frac_or_steps`, marin `_phase_1_start_step`): warmup =
    int(0.01 · 390,251) = 3,902 (not rounded: 3,903); the 80% boundary int(0.8 · 390,251) =
    312,200 moved down to a multiple of 49,152 / gcd(49,152, 11,264) = 48 steps: 312,192."""
    from marin.config import derive
    from tests.helpers import make_config

    hero = make_config("experiment=mochi_535b_a23b", "dry_run=true")
    assert hero.train.steps == 390_251
    assert derive.warmup_steps(hero) == warmup_steps(hero) == 3_902
    assert lr_at(hero, 0)["adam"] == 0.0 and lr_at(hero, 3_902)["adam"] == pytest.approx(hero.optim.lr)
    assert derive.phase_step_multiple(hero) == 48
    assert derive.phase_boundary_steps(hero) == [312_192]
    for rung, batch in (("d768", 1024), ("d1024", 2048), ("d1536", 6144), ("d2048", 11264)):
        cfg = make_config(f"experiment=ladder_{rung}", "dry_run=true")
        steps, multiple = cfg.train.steps, 49_152 // np.gcd(49_152, batch)
        [boundary] = derive.phase_boundary_steps(cfg)
        assert boundary % multiple == 0 and 0 <= 0.8 * steps - boundary < multiple, rung
        assert derive.warmup_steps(cfg) == int(0.01 * steps), rung
    # without mixture blocks (the default) the boundary is the nearest step, as before
    small = make_config("data=mochi_hero", "dry_run=true")
    assert derive.phase_boundary_steps(small) == [round(0.8 * small.train.steps)]
