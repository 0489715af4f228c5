"""`marin.model.accounting` (pure Python, from the config) against the real parameter tree."""
from __future__ import annotations

import math

import jax
import pytest

from marin.model import accounting, transformer
from tests.helpers import make_config

CONFIGS = {
    "tiny": (),
    "no_gated_norm": ("model.gated_norm_rank=0",),
    "no_conv": ("model.conv_kernel=0",),
    "no_conv_k": ("attention.conv_k=false",),
    "no_output_gate": ("attention.output_gate=false",),
    "gqa_split_kv": ("attention.head_dim=16", "attention.kv_heads_local=2", "attention.kv_heads_global=1"),
    "four_layers_two_global": ("model.num_layers=4", "attention.global_every=2"),
    "no_shared_experts": ("model.num_shared_experts=0",),
}


def _leaf_sizes(cfg) -> dict[str, int]:
    shapes = transformer.param_shapes(cfg)
    return {"/".join(key.key for key in path): math.prod(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def _leaf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    shapes = transformer.param_shapes(cfg)
    return {"/".join(key.key for key in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_all_leaves_matches_the_model(name):
    cfg = make_config("model=tiny", *CONFIGS[name])
    sizes = _leaf_sizes(cfg)
    assert sum(sizes.values()) == accounting.all_leaves(cfg)
    # Leaf by leaf too: the table the optimizer-group and memory plans are built from.
    # shapes too: the memory plan shards leaves by their dims as marin/train/state.py does
    table = {leaf.path: leaf.shape for leaf in accounting.leaves_of(accounting.Shapes.of(cfg))}
    assert _leaf_shapes(cfg) == table
