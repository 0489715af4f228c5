"""Padding is no token for routing (spec §9 "Evaluation"): a token with segment id 0 takes no
expert slot (no capacity, no wave, no drop) in any dispatch, enters no router statistic, and gets
zero expert output. A batch with padding gives, on its valid tokens, the outputs, drops and
statistics of the batch without it."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model import dispatch, routers, transformer
from marin.model.dispatch import ExpertWeights
from tests.helpers import make_config

T, PAD, L, I, E, K = 64, 24, 16, 24, 8, 2


def _problem():
    ks = jax.random.split(jax.random.key(0), 7)
    x = jax.random.normal(ks[0], (T + PAD, L))
    skew = jnp.arange(E, dtype=jnp.float32)[::-1] * 0.4                   # popular low experts: drops
    idx = jax.lax.top_k(jax.random.gumbel(ks[1], (T + PAD, E)) + skew, K)[1].astype(jnp.int32)
    wts = jax.random.uniform(ks[2], (T + PAD, K), minval=0.5, maxval=1.5)
    w = ExpertWeights(*(0.3 * jax.random.normal(k, s) for k, s in zip(ks[3:], [(E, L, I), (E, L, I), (E, I, L)])))
    # Padding interleaved: every fourth position of the padded batch, and the tail.
    pos = np.arange(T + PAD)
    valid = np.ones(T + PAD, bool)
    valid[(pos % 4 == 3) & (pos < 4 * (PAD - 8))] = False
    valid[-8:] = False
    assert valid.sum() == T
    return x, idx, wts, w, jnp.asarray(valid)


DISPATCHES = {   # name: (x, expert_idx, weights, w) -> (y, drops), at fixed capacities
    "sort": lambda x, i, g, w: dispatch.sort_dispatch(x, i, g, partial(dispatch.expert_swiglu, w=w), E, 8),
    "waves": lambda x, i, g, w: dispatch.wave_dispatch(x, i, g, partial(dispatch.expert_swiglu, w=w), E, 8),
    "pooled_one_device": lambda x, i, g, w: dispatch.pooled_one_device(x, i, g, w, 30, 4, 3),
    "pooled_waves": lambda x, i, g, w: dispatch.pooled_dispatch(x, i, g, w, E, 1, 30, 4, 3),
    "ragged_dot": lambda x, i, g, w: (dispatch.ragged_dot_dispatch(x, i, g, w), 0),
    "dense": lambda x, i, g, w: (dispatch.dense_dispatch(x, i, g, w), 0),
}


@pytest.mark.parametrize("name", list(DISPATCHES))
def test_padding_takes_no_slot_in_any_dispatch(name):
    """The same capacities with and without the padding: the same drops, the same outputs on the
    valid tokens (their relative order is kept), zeros on the padding."""
    x, idx, wts, w, valid = _problem()
    fn = jax.jit(DISPATCHES[name])
    y_pad, d_pad = fn(x, dispatch.mask_invalid(idx, valid, E), jnp.where(valid[:, None], wts, 0.0), w)
    y, d = fn(x[valid], idx[valid], wts[valid], w)
    counts = lambda d: {s: int(v) for s, v in d.items()} if isinstance(d, dict) else {"send": int(d)}  # noqa: E731
    assert counts(d_pad) == counts(d)
    if name in ("sort", "pooled_one_device", "pooled_waves"):
        assert sum(counts(d).values()) > 0, d                                # the capacities bite
    np.testing.assert_allclose(y_pad[valid], y, atol=1e-5, rtol=1e-5)
    assert bool(jnp.all(y_pad[~valid] == 0))


@pytest.mark.parametrize("kind", ["qb", "softmax_aux", "bias_update"])
def test_padding_enters_no_router_statistic(kind):
    cfg = make_config("model=tiny", f"model.num_experts={E}", f"router.top_k={K}", f"router={kind}")
    x, _, _, _, valid = _problem()
    logits = x @ jax.random.normal(jax.random.key(4), (L, E))
    logits = jnp.where(valid[:, None], logits, 30.0 * jnp.arange(E))       # padding: all on the last expert
    bias = jnp.zeros(E)
    _, _, padded = jax.jit(lambda lg, v: routers.route(lg, bias, cfg, valid=v))(logits, valid)
    _, _, clean = jax.jit(lambda lg: routers.route(lg, bias, cfg))(logits[valid])
    for key in ("beta", "load", "aux_loss"):
        np.testing.assert_allclose(padded[key], clean[key], atol=1e-6, err_msg=key)


def _batch(cfg, pad_rows: int):
    """2 rows of tokens (row 1 ends in padding), then `pad_rows` rows of padding only."""
    rng = np.random.default_rng(0)
    rows, seq = 2 + pad_rows, 16
    tokens = rng.integers(0, cfg.model.vocab_size, (rows, seq + 1))
    segments = np.ones((rows, seq), np.int32)
    segments[1, 12:] = 0
    segments[2:] = 0
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
            "segment_ids": jnp.asarray(segments), "loss_mask": jnp.asarray(segments > 0, jnp.float32)}


@pytest.mark.parametrize("transport", ["fixed", "pooled"])
def test_padding_rows_change_nothing_for_the_valid_tokens(transport):
    """The tiny model's training pass (ample capacity: C = T either way) with 2 extra rows of
    padding: the valid tokens' logits, the router statistics and the drops are those of the batch
    without them."""
    cfg = make_config("model=tiny", "model.capacity_factor=64", "model.ep_send_capacity_factor=64",
                      "model.ep_recv_capacity_factor=64", f"model.ep_transport={transport}")
    params = transformer.init_params(cfg, jax.random.key(0))
    bias = jnp.zeros((cfg.model.num_layers, cfg.model.num_experts))
    fwd = jax.jit(lambda b: transformer.forward(params, b, bias, cfg, train=True))
    small, big = _batch(cfg, 0), _batch(cfg, 2)
    (lg_small, aux_small), (lg_big, aux_big) = fwd(small), fwd(big)
    valid = np.asarray(small["segment_ids"] > 0)
    np.testing.assert_allclose(lg_big[:2][valid], lg_small[valid], atol=2e-5, rtol=2e-5)
    for key in ("beta", "load", "aux_loss", "dropped_frac", "dropped_frac/send", "dropped_frac/recv"):
        np.testing.assert_allclose(aux_big["router"][key], aux_small["router"][key], atol=1e-5, err_msg=key)


def ep_padding() -> dict:
    """8 host devices (data 2 × expert 4), E=24, k=4, ample capacity: every transport with 16
    padding tokens per device against the same tokens without them."""
    from marin.model import expert_parallel
    from marin.model.expert_parallel import routed_experts_ep
    from marin.model.mesh import make_mesh

    experts, k, devices, real, pad = 24, 4, 8, 48, 16
    base = ("model=tiny", f"model.num_experts={experts}", f"router.top_k={k}", "model.capacity_factor=64",
            "model.ep_send_capacity_factor=64", "model.ep_recv_capacity_factor=64", "model.ep_waves=3",
            "hardware.host_devices=8", "hardware.mesh.expert=4", "dry_run=true")
    expert_parallel.RAGGED_ALL_TO_ALL = expert_parallel.emulated_ragged_all_to_all  # XLA:CPU lacks the op
    kx, kl, kw = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (devices, real + pad, L))
    logits = jax.random.normal(kl, (devices, real + pad, experts))
    w = ExpertWeights(*(0.3 * jax.random.normal(kk, s) for kk, s in
                        zip(jax.random.split(kw, 3), [(experts, L, I), (experts, L, I), (experts, I, L)])))
    valid = jnp.broadcast_to(jnp.arange(real + pad) % 4 != 1, (devices, real + pad))   # 16 padding each
    out = {}
    for transport in ("fixed", "pooled", "ragged"):
        cfg = make_config(*base, f"model.ep_transport={transport}")
        mesh = make_mesh(cfg)
        run = jax.jit(lambda x, lg, v: routed_experts_ep(x, lg, jnp.zeros(experts), w, cfg, train=True, mesh=mesh,
                                                         valid=v))
        y_pad, s_pad = run(x.reshape(-1, L), logits.reshape(-1, experts), valid.reshape(-1))
        keep = np.asarray(valid).reshape(-1)
        y, s = run(x.reshape(-1, L)[keep], logits.reshape(-1, experts)[keep], None)
        out[transport] = {"diff": float(jnp.max(jnp.abs(y_pad[keep] - y))),
                          "padding_zero": bool(jnp.all(y_pad[~keep] == 0)),
                          "stats_diff": max(float(jnp.max(jnp.abs(s_pad[key] - s[key])))
                                            for key in ("beta", "load", "dropped_frac"))}
    return out


@pytest.mark.slow
def test_padding_under_expert_parallelism():
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import subprocess_env

    proc = subprocess.run([sys.executable, "-m", "tests.model.test_valid_mask"], cwd=Path(__file__).resolve().parents[2],
                          env=subprocess_env(8), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for transport, got in r.items():
        assert got["diff"] < 1e-5 and got["padding_zero"] and got["stats_diff"] < 1e-5, (transport, got)


if __name__ == "__main__":
    import json
    print(json.dumps(ep_padding()))
