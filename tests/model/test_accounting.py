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
    assert sum(sizes.values()) == accounting.all_leaves_of(accounting.Shapes.of(cfg))
    # Leaf by leaf too: the table the optimizer-group and memory plans are built from.
    # shapes too: the memory plan shards leaves by their dims as marin/train/state.py does
    table = {leaf.path: leaf.shape for leaf in accounting.leaves_of(accounting.Shapes.of(cfg))}
    assert _leaf_shapes(cfg) == table


def test_constants_mirror_the_code():
    """The memory plan mirrors a few of the code's choices without importing JAX."""
    from marin.train import state

    assert accounting.FSDP_MIN_SIZE == state.FSDP_MIN_SIZE
    for overrides in ((), ("optim=adamw",), ("optim.offload=false",)):
        cfg = make_config("experiment=ladder_d768", "dry_run=true", *overrides)
        assert accounting.offloaded_masters(cfg) == state.offloaded_masters(cfg)


@pytest.mark.parametrize("fsdp", [True, False])
def test_leaf_shards_follow_the_state_layout(fsdp):
    """Ways each leaf is split, from the config alone, as marin/train/state.py's PartitionSpecs
    split it on the rung's mesh (data 1 × expert 64)."""
    from marin.train import state

    cfg = make_config("experiment=ladder_d768", "dry_run=true", "attention.impl=blockwise",  # shapes only: any kernel
                      f"hardware.mesh.fsdp={str(fsdp).lower()}")
    sizes = {"data": int(cfg.hardware.mesh.data), "expert": cfg.hardware.mesh.expert, "model": 1}
    table = {leaf.path: leaf for leaf in accounting.leaves_of(accounting.Shapes.of(cfg))}
    for path, leaf in jax.tree_util.tree_flatten_with_path(transformer.param_shapes(cfg))[0]:
        spec = state.leaf_spec(path, leaf, cfg, sizes)
        ways = math.prod(math.prod(sizes[a] for a in ((s,) if isinstance(s, str) else s)) for s in spec if s)
        assert accounting.leaf_shards(table["/".join(k.key for k in path)], cfg) == ways, path
