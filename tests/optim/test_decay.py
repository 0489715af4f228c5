"""`optim.decay`: scheduled, decoupled weight decay on chosen parameters, in every optimizer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.config.schema import DecayRule
from marin.config.validate import ConfigError
from marin.launch.checks import load
from marin.optim import build_optimizer, lr_at, param_groups
from marin.optim.decay import coefficient, rule_schedule
from marin.optim.groups import path_names
from tests.helpers import compose_dict
from tests.optim import config


def test_schedule_is_value_at_start_linear_to_zero_at_end_and_zero_outside():
    rule = DecayRule("attn/gate", value=0.02, start=10, end=30)
    schedule = jax.jit(rule_schedule(rule))
    # step: expected coefficient (value · (end − step) / (end − start) inside [start, end))
    expected = {0: 0.0, 9: 0.0, 10: 0.02, 15: 0.015, 20: 0.01, 29: 0.001, 30: 0.0, 31: 0.0, 1000: 0.0}
    for step, want in expected.items():
        assert float(schedule(jnp.int32(step))) == pytest.approx(want, abs=1e-9), step
        assert coefficient(rule, step) == pytest.approx(want, abs=1e-12), step


def toy_params():
    """Every optimizer group and the two published decay targets, named as in CONTRACTS."""
    k = jax.random.split(jax.random.key(0), 6)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (16, 8))},
        "layers": {"attn": {"wq": jax.random.normal(k[1], (2, 8, 8)), "gate": jax.random.normal(k[2], (2, 8, 4))},
                   "attn_norm": {"scale": 1.0 + jax.random.normal(k[3], (2, 8))},
                   "moe": {"router": jax.random.normal(k[4], (2, 8, 6))}},
        "head": {"kernel": jax.random.normal(k[5], (8, 16))},
    }


RULES = {  # optimizer: rules exercising a path, an alternative, and a whole group
    "adamw": [DecayRule("attn/gate", 0.02, 10, 30), DecayRule("moe|embed/router|embedding", 0.5, 0, 20)],
    "muonh": [DecayRule("attn/gate", 0.02, 10, 30), DecayRule("moe/router", 0.5, 0, 20),
              DecayRule("muonh", 0.1, 5, 25), DecayRule("adamh", 0.3, 2, 12)],
}


@pytest.mark.parametrize("name", ["adamw", "muonh"])
def test_decay_is_minus_lr_times_coefficient_times_w_on_its_leaves_only(name):
    # Two optimizers, with and without rules, see the same gradients and (fixed) parameters, so
    # everything but the decay evolves identically: their difference is the decay term alone. Off
    # the decayed leaves the two programs agree to rounding (XLA may order their float operations
    # differently: tens of ulp of the largest update), far below a decay term (lr · coefficient · w).
    plain, decayed = config(name, steps=40, lr=1e-2), config(name, steps=40, lr=1e-2)
    decayed.optim.decay = RULES[name]
    params = toy_params()
    opts = [build_optimizer(plain), build_optimizer(decayed)]
    states = [opt.init(params) for opt in opts]
    step = jax.jit(lambda i, g, s: opts[i].update(g, s, params), static_argnums=0)
    groups = {path_names(p): g for p, g in jax.tree_util.tree_leaves_with_path(param_groups(params, name))}
    leaves = {path_names(p): np.asarray(w) for p, w in jax.tree_util.tree_leaves_with_path(params)}

    def rule_of(names, group):
        from marin.optim.decay import applies
        return next((r for r in RULES[name] if applies(r, names, group)), None)

    decayed_leaves = set()
    for k in range(32):
        grads = jax.tree.map(lambda w: jnp.sin(w * (k + 1)), params)
        (u0, states[0]), (u1, states[1]) = step(0, grads, states[0]), step(1, grads, states[1])
        diffs = {path_names(p): np.asarray(d) for p, d in
                 jax.tree_util.tree_leaves_with_path(jax.tree.map(lambda a, b: b - a, u0, u1))}
        plain_updates = {path_names(p): np.abs(np.asarray(u)).max() for p, u in jax.tree_util.tree_leaves_with_path(u0)}
        for names, diff in diffs.items():
            group = groups[names]
            rule = rule_of(names, group)
            want = 0.0 if rule is None else coefficient(rule, k)
            if want == 0.0:
                rounding = 32 * np.finfo(np.float32).eps * plain_updates[names]
                np.testing.assert_allclose(diff, 0.0, atol=rounding, rtol=0, err_msg=f"{names} at step {k}")
            else:
                decayed_leaves.add(names)
                np.testing.assert_allclose(diff, -lr_at(plain, k)[group] * want * leaves[names],
                                           rtol=2e-3, atol=1e-9, err_msg=f"{names} at step {k}")
    expected = {names for names, group in groups.items() if rule_of(names, group) is not None}
    assert decayed_leaves == expected and len(expected) >= (2 if name == "adamw" else 4)


def test_optimizer_state_has_one_structure_with_and_without_rules():
    # A checkpoint taken without decay resumes with a rule added (as the published run did).
    plain, decayed = config("muonh"), config("muonh")
    decayed.optim.decay = RULES["muonh"]
    shapes = [jax.eval_shape(build_optimizer(c).init, toy_params()) for c in (plain, decayed)]
    assert jax.tree.structure(shapes[0]) == jax.tree.structure(shapes[1])


BAD = [  # (rules as a Hydra override, the field named in the message)
    ("[{pattern: attn/gate, value: 0.1, end: 10}, {pattern: nope/x, value: 0.1, end: 10}]", "optim.decay[1].pattern"),
    ("[{pattern: ttn/gate, value: 0.1, end: 10}]", "optim.decay[0].pattern"),      # whole names, not substrings
    ("[{pattern: adam, value: 0.1, end: 10}]", "optim.decay[0].pattern"),         # no adam group under adamw
    ("[{pattern: adamw, value: 0.1, end: 10}, {pattern: moe/router, value: 0.1, end: 10}]", "optim.decay[1].pattern"),
    ("[{pattern: attn//gate, value: 0.1, end: 10}]", "optim.decay[0].pattern"),
    ("[{pattern: attn/gate, value: nan, end: 10}]", "optim.decay[0].value"),
    ("[{pattern: attn/gate, value: inf, end: 10}]", "optim.decay[0].value"),
    ("[{pattern: attn/gate, value: -0.1, end: 10}]", "optim.decay[0].value"),
    ("[{pattern: attn/gate, value: 0.1, start: 10, end: 10}]", "optim.decay[0].end"),
    ("[{pattern: attn/gate, value: 0.1, start: -1, end: 10}]", "optim.decay[0].start"),
]


@pytest.mark.parametrize("rules,field", BAD, ids=[f for _, f in BAD])
def test_bad_rules_name_their_field(rules, field):
    with pytest.raises(ConfigError) as err:
        load(compose_dict("model=tiny", f"optim.decay={rules}"))
    assert [name for name, _ in err.value.problems] == [field]


def test_good_rules_validate_and_end_defaults_to_the_last_step():
    cfg = load(compose_dict("model=tiny", "optim=muonh", "train.steps=50",
                            "optim.decay=[{pattern: adam, value: 0.1}, {pattern: head/kernel, value: 0.1, end: 20}]"))[1]
    assert [(r.pattern, r.start, r.end) for r in cfg.optim.decay] == [("adam", 0, 50), ("head/kernel", 0, 20)]


def test_a_rule_can_switch_on_part_way_down_its_line():
    """The hero's gate/router decay (spec §8): the line 0.02 at step 0 → 0 at the last step,
    off at launch, on from step 58,014 where it is 0.02 · (1 − 58,014/390,251) = 0.01703."""
    from marin.optim.decay import describe
    from tests.helpers import make_config

    hero = make_config("experiment=mochi_535b_a23b", "dry_run=true")
    assert [(r.pattern, r.value, r.origin, r.start, r.end) for r in hero.optim.decay] == [
        ("attn/gate", 0.02, 0, 58_014, 390_251), ("moe/router", 0.02, 0, 58_014, 390_251)]
    rule = hero.optim.decay[0]
    assert coefficient(rule, 0) == coefficient(rule, 58_013) == 0.0          # off at launch
    assert round(coefficient(rule, 58_014), 5) == 0.01703
    assert coefficient(rule, 58_014) == pytest.approx(0.02 * (1 - 58_014 / 390_251), rel=1e-12)
    assert float(jax.jit(rule_schedule(rule))(jnp.int32(58_014))) == pytest.approx(0.01703, abs=5e-6)
    assert float(jax.jit(rule_schedule(rule))(jnp.int32(58_013))) == 0.0
    assert "on from step 58,014 (0.01703 there)" in describe(hero)[0]
    # origin defaults to start: the old meaning (value at start) is unchanged
    plain = make_config("optim=muonh", "optim.decay=[{pattern: attn/gate, value: 0.02, start: 10}]").optim.decay[0]
    assert plain.origin == 10 and coefficient(plain, 10) == 0.02


def test_an_origin_after_start_is_refused():
    with pytest.raises(ConfigError) as err:
        load(compose_dict("optim=muonh", "optim.decay=[{pattern: attn/gate, value: 0.02, start: 5, origin: 9}]"))
    assert "optim.decay[0].origin" in str(err.value)
