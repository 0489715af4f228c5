"""Every numeric leaf of the schema, set to NaN, ∞, −1, 0 and 10¹²: either refused with a message
naming the leaf, or a config that validates and plans (`dry_run`) without crashing.

The leaves come from walking the fields of marin/config/schema.py (nested dataclasses included)
and the range each carries, so a field added later is covered without editing this file. Composing once and setting each value
on a copy is what Hydra does with a `key=value` override (OmegaConf's typed assignment), only
without composing ~400 times; tests/config/test_bad_input.py proves the same refusals through
`launch.py` (one line, exit 2, nothing written).
"""
import contextlib
import io
import math

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from marin.config import fields
from marin.config.schema import Config
from marin.config.validate import ConfigError
from marin.launch.checks import load
from marin.launch.plan import print_plan
from tests.helpers import compose_dict

VALUES = (math.nan, math.inf, -1, 0, 1e12)


def test_the_walk_reaches_nested_and_auto_leaves_with_their_rules():
    leaves = {leaf.name: leaf for leaf in fields.leaves(Config)}
    numeric = {leaf.name for leaf in fields.numeric_leaves(Config)}
    assert {"hardware.mesh.expert", "hardware.mesh.data", "train.checkpoint.every_minutes",
            "hardware.memory_per_device_gib", "hardware.memory_usable_fraction", "schema_version",
            "train.steps", "optim.b2"} <= numeric
    assert leaves["train.steps"].auto and leaves["train.steps"].range.integer      # auto or an integer
    assert leaves["optim.b2"].auto and not leaves["optim.b2"].range.integer        # auto or a real number
    assert leaves["optim.grad_clip"].nullable and leaves["hardware.mesh.data"].auto
    assert "qb" in leaves["router.kind"].allowed() and leaves["model.ep_transport"].allowed() == ("fixed", "pooled", "ragged")
    assert all(leaf.help for leaf in leaves.values() if leaf.range or leaf.choices), "a rule without a help line"


def _setting(leaf, value):
    """The value as Hydra would parse it from the command line (`1e12` on an int leaf is `1000000000000`)."""
    if leaf.range.integer and math.isfinite(value):
        return int(value)
    return value


def test_every_numeric_leaf_is_refused_by_name_or_plans():
    base = compose_dict("model=tiny")
    wrong, accepted = [], []
    for leaf in fields.numeric_leaves(Config):
        for value in VALUES:
            cfg = base.copy()
            try:
                OmegaConf.update(cfg, leaf.name, _setting(leaf, value), merge=False)
            except OmegaConfBaseException as err:  # the schema's type refuses it, as Hydra would
                if leaf.name.split(".")[-1] not in str(err):
                    wrong.append(f"{leaf.name}={value}: type error without the key: {err}")
                continue
            try:
                _, resolved = load(cfg)
            except ConfigError as err:
                if not any(name == leaf.name or leaf.name in msg for name, msg in err.problems):
                    wrong.append(f"{leaf.name}={value}: refused without naming it: {err}")
                continue
            except Exception as err:  # noqa: BLE001 — a crash is exactly what this test hunts
                wrong.append(f"{leaf.name}={value}: validation crashed: {type(err).__name__}: {err}")
                continue
            if not (math.isfinite(value)):
                wrong.append(f"{leaf.name}={value}: a non-finite value was accepted")
            accepted.append(f"{leaf.name}={value}")
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    print_plan(resolved)
            except Exception as err:  # noqa: BLE001
                wrong.append(f"{leaf.name}={value}: accepted, but the plan crashed: {type(err).__name__}: {err}")
    assert not wrong, f"{len(wrong)} leaves mishandled:\n" + "\n".join(wrong)
    # The walk did run: ordinary values such as 0 checkpoints or 10¹² FLOP/s peaks are accepted.
    assert {"train.checkpoint.every_steps=0", "hardware.peak_flops_per_device=1000000000000.0",
            "model.num_shared_experts=0"} <= set(accepted)


@pytest.mark.parametrize("override,field", [
    ("+train.stepz=5", "train.stepz"), ("+model.hiden=3", "model.hiden"),
    ("+hardware.mesh.dat=2", "hardware.mesh.dat"), ("resume=", "resume"), ("reproduce=", "reproduce"),
    ("optim.b1=1.5", "optim.b1"), ("attention.window=-1", "attention.window"),
    ("train.init_from=/nonexistent/run", "train.init_from"),
])
def test_misspelt_added_keys_empty_refs_and_missing_files_are_refused(override, field):
    with pytest.raises(ConfigError) as err:
        load(compose_dict("model=tiny", override))
    assert [name for name, _ in err.value.problems] == [field]


def test_free_form_dicts_still_take_new_keys():
    _, resolved = load(compose_dict("model=tiny", "+hardware.env.FOO=bar"))
    assert resolved.hardware.env["FOO"] == "bar"


def test_init_from_needs_a_complete_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "20.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a save in progress
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        load(compose_dict("model=tiny", f"train.init_from={tmp_path}"))
    (tmp_path / "checkpoints" / "20").mkdir()
    assert load(compose_dict("model=tiny", f"train.init_from={tmp_path}"))[1].train.init_from == str(tmp_path)
