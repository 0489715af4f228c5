"""`optim.ns_coefficients`: the simple triple and the published quintic schedule (spec §8)."""

import jax.numpy as jnp
import numpy as np
import pytest

from marin.config.validate import ConfigError
from marin.optim.muonh import orthogonalize
from tests.helpers import launch_here, make_config

# Typed in from spec §8, not read from the code under test.
PUBLISHED = {
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "simple": [(3.4445, -4.7750, 2.0315)] * 5,
}


def by_hand(x: np.ndarray, triples, eps: float) -> np.ndarray:
    """Newton–Schulz in float64 numpy: on the wide orientation, X ← X/(‖X‖_F + eps), then for
    each (a, b, c): X ← aX + b(XXᵀ)X + c(XXᵀ)²X."""
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in triples:
        g = x @ x.T
        x = a * x + b * g @ x + c * g @ g @ x
    return x.T if tall else x


@pytest.mark.parametrize("name", ["quintic", "simple"])
@pytest.mark.parametrize("shape", [(6, 9), (9, 6)])
def test_five_iterations_match_a_hand_computation(name, shape):
    x = np.random.default_rng(0).normal(size=shape)
    got = np.asarray(orthogonalize(jnp.asarray(x, jnp.float32), ns_steps=5, eps=1e-8, coefficients=name))
    np.testing.assert_allclose(got, by_hand(x, PUBLISHED[name], 1e-8), atol=2e-5)


def test_the_schedules_differ_and_an_explicit_list_is_the_same_as_its_name():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 12)), jnp.float32)
    quintic = orthogonalize(x, 5, 1e-8, coefficients="quintic")
    listed = orthogonalize(x, 5, 1e-8, coefficients=[list(t) for t in PUBLISHED["quintic"]])
    np.testing.assert_array_equal(np.asarray(quintic), np.asarray(listed))
    assert np.abs(np.asarray(quintic) - np.asarray(orthogonalize(x, 5, 1e-8))).max() > 1e-3


def test_the_hero_and_every_ladder_rung_run_the_published_optimizer():
    for experiment in ("mochi_535b_a23b", "ladder_d768", "ladder_d1024", "ladder_d1536", "ladder_d2048"):
        o = make_config(f"experiment={experiment}", "dry_run=true").optim
        assert (o.ns_coefficients, o.ns_steps, o.ns_dtype, o.ns_eps) == ("quintic", 5, "bfloat16", 1e-8), experiment
    assert make_config("optim=muonh").optim.ns_coefficients == "simple"  # the small default: unchanged


@pytest.mark.parametrize("overrides, text", [
    (["optim.ns_coefficients=[[3.4,-4.7,2.0],[3.4,-4.7,2.0]]"], "optim.ns_steps=5 triples; got 2"),
    (["optim.ns_coefficients=quintic", "optim.ns_steps=4"], "needs optim.ns_steps=5"),
    (["optim.ns_coefficients=cubic"], "must be one of simple, quintic"),
])
def test_bad_coefficients_are_refused_naming_the_field(overrides, text):
    with pytest.raises(ConfigError) as err:
        make_config("optim=muonh", *overrides)
    assert "optim.ns_coefficients" in str(err.value) and text in str(err.value)


def test_launch_refuses_a_wrong_length_with_one_line(tmp_path, capsys):
    code = launch_here("optim=muonh", "dry_run=true", "optim.ns_coefficients=[[1,2,3]]", f"run.out_dir={tmp_path}/out")
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "optim.ns_coefficients: needs one [a, b, c] triple" in lines[0], err
