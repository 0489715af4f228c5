"""The jitted train step: gradient accumulation is exact, and every router trains a 2-layer model."""
import jax
import numpy as np
import pytest

from marin.model.mesh import make_mesh
from marin.optim import build_optimizer
from marin.train.state import init_state
from marin.train.step import make_train_step, num_microbatches
from tests.helpers import make_config

SMALL = ["model=tiny", "train.seq_len=32", "train.global_batch=8", "train.steps=20"]


def batch_of(cfg, seed=0):
    rng = np.random.default_rng(seed)
    B, T = cfg.train.global_batch, cfg.train.seq_len
    # a learnable stream: each row counts up from a random start (next token = token + 1)
    start = rng.integers(0, 200, (B, 1))
    tokens = ((start + np.arange(T + 1)) % 250).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((B, T), np.int32), "loss_mask": np.ones((B, T), np.float32)}


def run_steps(cfg, steps, batch):
    tx = build_optimizer(cfg)
    state = init_state(cfg, tx, jax.random.key(0))
    step = jax.jit(make_train_step(cfg, tx, make_mesh(cfg)))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch():
    whole = make_config(*SMALL)
    split = make_config(*SMALL, "train.micro_batch=2")
    assert num_microbatches(whole) == 1 and num_microbatches(split) == 4
    batch = batch_of(whole)
    # capacity is per micro-batch, so compare where nothing drops: capacity factor = E / k
    no_drop = ["model.capacity_factor=2.0"]
    whole, split = make_config(*SMALL, *no_drop), make_config(*SMALL, *no_drop, "train.micro_batch=2")
    a, la = run_steps(whole, 1, batch)
    b, lb = run_steps(split, 1, batch)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("router,optim", [("qb", "muonh"), ("softmax_aux", "adamw"), ("bias_update", "adamw")])
def test_each_router_and_optimizer_trains_a_two_layer_model(router, optim):
    # model=micro: the routed MoE without the block's optional parts (GatedNorm, convolutions,
    # shared experts), which no router or optimizer touches differently: 0.6 of tiny's compile
    overrides = [*SMALL, "model=micro", f"router={router}", f"optim={optim}"]
    if optim == "adamw":
        overrides.append("optim.lr=1e-2")
    cfg = make_config(*overrides)
    assert cfg.model.num_layers == 2
    _, losses = run_steps(cfg, 15, batch_of(cfg))
    assert all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
