"""Parameter groups: every CONTRACTS parameter lands in its intended group, by whole names."""
import jax
import jax.numpy as jnp
import pytest

from marin.optim import param_groups
from marin.optim.groups import path_names

# Every parameter of docs/CONTRACTS.md and its intended group (spec §3), written out by hand.
EXPECTED = {
    "embed/embedding": "adam",
    "embed_norm/scale": "adam",
    "embed_gated_norm/down": "muonh", "embed_gated_norm/up": "muonh",
    "layers/attn_norm/scale": "adam",
    "layers/attn_gated_norm/down": "muonh", "layers/attn_gated_norm/up": "muonh",
    "layers/attn/wq": "muonh", "layers/attn/wk": "muonh", "layers/attn/wv": "muonh", "layers/attn/wo": "muonh",
    "layers/attn/gate": "adam",
    "layers/attn/conv_k": "adam",
    "layers/attn_out_conv/kernel": "adam",
    "layers/moe_norm/scale": "adam",
    "layers/moe_gated_norm/down": "muonh", "layers/moe_gated_norm/up": "muonh",
    "layers/moe/router": "adam",
    "layers/moe/latent_down": "muonh", "layers/moe/latent_norm/scale": "adam", "layers/moe/latent_up": "muonh",
    "layers/moe/w_gate": "muonh", "layers/moe/w_up": "muonh", "layers/moe/w_down": "muonh",
    "layers/moe/shared_gate": "muonh", "layers/moe/shared_up": "muonh", "layers/moe/shared_down": "muonh",
    "layers/moe_out_conv/kernel": "adam",
    "final_norm/scale": "adam",
    "final_gated_norm/down": "muonh", "final_gated_norm/up": "muonh",
    "head/kernel": "adamh",
}


def nested(flat: dict) -> dict:
    tree = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def flat_groups(params, optimizer="muonh") -> dict:
    labels = param_groups(params, optimizer)
    return {"/".join(path_names(p)): g for p, g in jax.tree_util.tree_flatten_with_path(labels)[0]}


def test_contract_tree_groups():
    params = nested({path: jax.ShapeDtypeStruct((2, 3), jnp.float32) for path in EXPECTED})
    assert flat_groups(params) == EXPECTED


def test_model_param_shapes_groups():
    transformer = pytest.importorskip("marin.model.transformer")
    from tests.helpers import make_config

    cfg = make_config("model=tiny", "optim=muonh")
    got = flat_groups(transformer.param_shapes(cfg))
    unknown = set(got) - set(EXPECTED)
    assert not unknown, f"parameters outside CONTRACTS: {unknown}"
    assert got == {path: EXPECTED[path] for path in got}
    assert {"muonh", "adamh", "adam"} <= set(got.values())


def test_whole_names_not_substrings():
    # A substring rule ("gate" in path -> adam) would send all of these to adam.
    params = nested({p: jnp.zeros((2, 2)) for p in (
        "layers/attn_gated_norm/down", "layers/attn/gate", "layers/moe/w_gate", "layers/moe/shared_gate")})
    assert flat_groups(params) == {
        "layers/attn_gated_norm/down": "muonh", "layers/attn/gate": "adam",
        "layers/moe/w_gate": "muonh", "layers/moe/shared_gate": "muonh"}


@pytest.mark.parametrize("path", ["layers/attn_gate/kernel", "layers/attn/wq_extra", "head/bias"])
def test_unclaimed_parameter_is_an_error(path):
    with pytest.raises(ValueError, match="no optimizer group rule"):
        param_groups(nested({path: jnp.zeros((2, 2))}))


def test_adamw_single_group():
    params = nested({path: jnp.zeros((2,)) for path in EXPECTED})
    assert set(flat_groups(params, "adamw").values()) == {"adamw"}


def test_model_hyperball_matrices_start_nonzero():
    # The hyperball step keeps ‖W‖: a zero-initialised matrix in muonh/adamh would never move.
    transformer = pytest.importorskip("marin.model.transformer")
    from marin.optim.muonh import matrix_norm
    from tests.helpers import make_config

    params = transformer.init_params(make_config("model=tiny", "optim=muonh"), jax.random.PRNGKey(0))
    groups = param_groups(params)
    for (path, group), leaf in zip(jax.tree_util.tree_flatten_with_path(groups)[0], jax.tree.leaves(params)):
        if group in ("muonh", "adamh"):
            assert float(jnp.min(matrix_norm(leaf))) > 0, path_names(path)
