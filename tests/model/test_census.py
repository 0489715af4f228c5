"""The MoE layer's data movement, pinned at compile time (StableHLO op counts, no backend run):
the routing has no scatter, the fixed layer forward + backward has at most the scatters and
gathers its math needs, and `pooled` on one device costs what `fixed` does. Each bound failed on
the code before the data movement was cut (counts then in the comments: tiny, E 8, k 2, T 256)."""
import jax
import jax.numpy as jnp
import pytest

from marin.model.census import moe_layer_census, op_census, router_census
from tests.helpers import make_config

BASE = ("model=tiny", "model.num_experts=8", "model.ep_waves=2", "dry_run=true")   # ragged: planned on CPU
T = 256


def _layer(*overrides):
    return moe_layer_census(make_config(*BASE, *overrides), T)


def test_op_census_counts_each_call_of_an_outlined_function_and_no_attribute():
    @jax.jit
    def helper(a, i):
        return jnp.take(a, i, axis=0)

    def f(a, i):
        return helper(a, i) + helper(a * 2, i)        # one definition, two calls

    text = jax.jit(f).lower(jnp.ones((8, 3)), jnp.arange(4)).as_text()
    assert text.count('"stablehlo.gather"') == 1 and "#stablehlo.gather<" in text
    census = op_census(text)
    assert census["gather"] == 2 and census["scatter"] == 0
    scatter = jax.jit(lambda a, i: a.at[i].add(1.0)).lower(jnp.ones(8), jnp.arange(4)).as_text()
    assert op_census(scatter)["scatter"] == 1


@pytest.mark.parametrize("router", ["qb", "softmax_aux", "bias_update"])
def test_routing_has_no_scatter(router):
    """QB's histogram was a T·E scatter-add, the load a T·k one (before: 2 scatters for QB)."""
    census = router_census(make_config(*BASE, f"router={router}"), T)
    assert census["scatter"] == 0, census
    assert census["sort"] == 0, census


def test_fixed_layer_moves_data_only_as_its_math_needs():
    """Forward + backward of fixed: one scatter for the sort's inverse permutation (unique
    indices, no atomics) and the router logits' gradient (k distinct experts per row); the sort
    carries the ids, so the sorted experts are not gathered back (before: 5 scatters, 11 gathers)."""
    census = _layer("model.ep_transport=fixed")
    assert census["scatter"] <= 2, census
    assert census["gather"] <= 8, census
    assert census["sort"] == 1, census
    assert census["dynamic_slice"] == census["dynamic_update_slice"] == 0, census


def test_pooled_on_one_device_moves_data_as_fixed_does():
    """One pass, not waves (before: 19 scatters, 45 gathers, 6 sorts, 18 dot_generals)."""
    pooled, fixed = _layer("model.ep_transport=pooled"), _layer("model.ep_transport=fixed")
    assert pooled["scatter"] <= fixed["scatter"], (pooled, fixed)
    assert pooled["gather"] <= fixed["gather"] + 1, (pooled, fixed)   # + the sender pool's limit per expert
    assert pooled["sort"] == fixed["sort"] and pooled["dot_general"] == fixed["dot_general"], (pooled, fixed)


@pytest.mark.parametrize("override", ["model.ep_transport=ragged", "model.dispatch=ragged_dot"])
def test_ragged_layer_has_no_scatter_add(override):
    """Group sizes by compare-and-sum, rows by gathers with gather transposes (before: 5 scatters)."""
    census = _layer(override)
    assert census["scatter"] <= 2, census


def test_hlo_census_counts_the_compiled_module():
    """The backend's view (here XLA:CPU): the pooled layer on one device compiles to no more
    scatters than fixed."""
    pooled, fixed = (moe_layer_census(make_config(*BASE, f"model.ep_transport={t}"), T, compiled=True)
                     for t in ("pooled", "fixed"))
    assert set(fixed) >= {"gather", "scatter", "dynamic_slice", "sort", "custom_call", "fusion"}
    assert pooled["scatter"] <= fixed["scatter"], (pooled, fixed)


def test_command_prints_every_transport_and_the_routing(capsys):
    from marin.model.census import main

    main(["--tokens", "64", "model=tiny", "model.num_experts=8", "model.ep_waves=2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["fixed", "pooled", "ragged", "dispatch=ragged_dot", "routing"]
    assert lines[-1].startswith("routing (qb)") and "scatter=0" in lines[-1]
