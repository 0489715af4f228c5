"""optim.offload and model.offload_carry take true, false or auto: `auto` is resolved from the
memory plan (marin.config.derive.choose_offload): off where the run fits without it, else the
fitting layout that moves the fewest bytes over the host link."""
import pytest

from marin.config import derive, validate
from marin.config.validate import ConfigError
from marin.model import accounting
from tests.helpers import compose_dict, make_config

HERO = "experiment=mochi_535b_a23b"
RUNG_ON_ONE_H200 = ("experiment=ladder_d768", "hardware=h200", "train.global_batch=32")  # as measured


def switches(cfg) -> tuple:
    return cfg.optim.offload, cfg.model.offload_carry


def test_the_recipe_leaves_offload_to_the_plan():
    composed = validate.to_config(compose_dict(HERO))
    assert switches(composed) == ("auto", "auto")


def test_the_hero_needs_both_and_the_rung_on_one_h200_neither():
    hero = make_config(HERO, "dry_run=true")
    assert switches(hero) == (True, True)
    limit = derive.memory_limit_gib(hero.hardware)
    for off in ({"optim.offload": False}, {"model.offload_carry": False}):  # neither alone is enough
        assert accounting.offload_estimate(derive.with_offload(hero, off)).device_gib > limit
    rung = make_config(*RUNG_ON_ONE_H200, "dry_run=true")
    assert switches(rung) == (False, False)
    assert accounting.offload_estimate(rung).device_gib <= derive.memory_limit_gib(rung.hardware)
    assert switches(make_config("model=tiny", "optim.offload=auto", "model.offload_carry=auto", "model.remat=full")) \
        == (False, False)  # CPU: no memory figure, nothing to fit


def test_auto_chooses_the_fitting_layout_that_moves_the_fewest_bytes():
    """A device between the hero's carry-only and both-off estimates: either switch alone fits,
    and the carries (72 GiB moved a step) cost far less link time than the optimizer (366 GiB)."""
    hero = make_config(HERO, "dry_run=true")
    costs = {(o, c): accounting.offload_estimate(derive.with_offload(hero, {"optim.offload": o, "model.offload_carry": c}))
             for o in (False, True) for c in (False, True)}
    limit = (costs[(False, True)].device_gib + costs[(False, False)].device_gib) / 2
    assert costs[(True, False)].device_gib < limit < costs[(False, False)].device_gib
    cfg = make_config(HERO, f"hardware.memory_per_device_gib={limit / 0.9}", "dry_run=true")
    assert switches(cfg) == (False, True)
    assert costs[(False, True)].moved_bytes < costs[(True, False)].moved_bytes
    # an explicit value is kept: only the auto one is chosen
    assert switches(make_config(HERO, f"hardware.memory_per_device_gib={limit / 0.9}", "model.offload_carry=false",
                                "dry_run=true")) == (True, False)


def test_auto_never_picks_what_validation_refuses():
    assert make_config(HERO, "model.remat=none", "dry_run=true").model.offload_carry is False
    clipped = make_config(HERO, "optim.grad_clip=1.0", "dry_run=true")
    assert clipped.optim.offload is False  # MuonH's offloaded masters rule out global-norm clipping


@pytest.mark.parametrize("override", ["optim.offload=maybe", "model.offload_carry=1", "optim.offload=0"])
def test_a_bad_offload_value_names_the_field_and_the_choices(override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        make_config("model=tiny", override)
    assert [name for name, _ in err.value.problems] == [field]
    assert "one of true, false, auto" in str(err.value)


def test_auto_without_the_memory_plan_is_one_clear_error():
    with pytest.raises(ConfigError) as err:
        validate.load(compose_dict(HERO, "dry_run=true"))  # no `memory`: marin.config cannot import the plan
    assert [name for name, _ in err.value.problems] == ["optim.offload"]
    assert "memory plan" in str(err.value)


def test_an_invalid_config_with_auto_reports_its_own_field():
    with pytest.raises(ConfigError) as err:
        make_config(HERO, "attention.num_heads=5", "dry_run=true")
    assert "attention.num_heads" in [name for name, _ in err.value.problems]
