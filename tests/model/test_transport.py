"""Training-time expert transports (`model.ep_transport`): with ample capacity every transport
(fixed, pooled, ragged) equals the dropless reference; the published `pooled` drops
exactly what a count by hand predicts, per stage (sender pool, receiver), and its round-robin
receiver slots spread an overflow evenly over the senders; `ragged` is exact (its index
arithmetic run through an emulated ragged_all_to_all, since XLA:CPU cannot run the op) and the
hero's train step lowers with it for 64 devices; bad settings are refused.

The expert-parallel cases run this module as a subprocess (`python -m tests.model.test_transport
ep`) with XLA_FLAGS forcing host devices, as in test_expert_parallel.py.
"""
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.config.validate import ConfigError
from marin.model import dispatch
from marin.model.dispatch import ExpertWeights
from tests.helpers import launch_here, make_config, new_store, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
L, I = 16, 24   # latent, expert width


def _weights(key, experts):
    ks = jax.random.split(key, 3)
    return ExpertWeights(*(0.3 * jax.random.normal(kk, s) for kk, s in
                           zip(ks, [(experts, L, I), (experts, L, I), (experts, I, L)])))


def _subprocess(devices: int, *args: str) -> dict:
    env = subprocess_env(devices)
    proc = subprocess.run([sys.executable, "-m", "tests.model.test_transport", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pooled_on_one_device_equals_the_reference_and_counts_its_drops():
    """peers = 1, 6 experts, 3 waves: with ample capacity the dropless result (values and
    gradients of x and the weights); with small buffers exactly the drops counted by hand, the
    sender's being the shard's later tokens (both choices), not its second choices."""
    tokens, experts, k, waves = 96, 6, 2, 3
    kx, kw, kp = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, (tokens, L)), _weights(kw, experts)
    t = jnp.arange(tokens)
    idx = jnp.stack([t % experts, (t + 1) % experts], -1)            # 32 assignments per expert
    wts = jnp.full((tokens, k), 0.5)
    probe = jax.random.normal(kp, x.shape)
    send, recv = dispatch.pooled_capacities(tokens, k, experts, 1, waves, 4.0, 4.0)

    def loss(x, w, send, recv):
        y, drops = dispatch.pooled_dispatch(x, idx, wts, w, experts, 1, send, recv, waves)
        return jnp.sum(y * probe), (drops, y)

    (value, (drops, _)), grads = jax.jit(jax.value_and_grad(partial(loss, send=send, recv=recv), argnums=(0, 1),
                                                             has_aux=True))(x, w)
    ref, ref_grads = jax.value_and_grad(lambda x, w: jnp.sum(dispatch.dense_dispatch(x, idx, wts, w) * probe),
                                        argnums=(0, 1))(x, w)
    assert {s: int(v) for s, v in drops.items()} == {"send": 0, "recv": 0}
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Token-major rank r = 2t + j, wave r % 3. Expert e's first choices are t = e + 6m (r = 2e + 12m)
    # and its second choices t = e − 1 + 6m (r = 2e − 1 + 12m): 16 each, each group in one wave (12m
    # is 0 mod 3), the two in different waves. R = 12 rows per (expert, wave): 4 refused in each of
    # the 12 filled buckets. S = 64 rows per wave: 3 · 64 = 192 = all assignments sent.
    _, (drops, _) = jax.jit(partial(loss, send=64, recv=12))(x, w)
    assert {s: int(v) for s, v in drops.items()} == {"send": 0, "recv": 12 * 4}
    # S = 48 per wave: ranks r < 3 · 48 = 144 are sent, i.e. tokens 0..71 (both choices); tokens
    # 72..95 lose both (48 assignments), whatever their choice rank, and get no expert output.
    _, (drops, y) = jax.jit(partial(loss, send=48, recv=64))(x, w)
    assert {s: int(v) for s, v in drops.items()} == {"send": 48, "recv": 0}
    lost = np.nonzero(np.asarray(jnp.all(y == 0, axis=-1)))[0]
    assert lost.tolist() == list(range(72, 96)), lost


def _one_pass_against_waves(send_factor, recv_factor) -> dict:
    """Asserts that the one-device pooled transport (one fixed-capacity pass with the pool's drop
    rules) gives what the wave-by-wave transport with one peer gives: values, gradients and drops
    per stage. Returns the drops."""
    tokens, experts, k, waves = 96, 6, 2, 3
    kx, kw, kp, ki = jax.random.split(jax.random.key(5), 4)
    x, w = jax.random.normal(kx, (tokens, L)), _weights(kw, experts)
    skew = jnp.array([3.0, 2.0, 0.0, 0.0, 1.0, 0.0])                    # experts 0, 1 popular
    idx = jax.lax.top_k(jax.random.gumbel(ki, (tokens, experts)) + skew, k)[1]
    wts = jax.nn.softmax(jax.random.normal(kp, (tokens, k)))
    probe = jax.random.normal(kp, x.shape)
    send, recv = dispatch.pooled_capacities(tokens, k, experts, 1, waves, send_factor, recv_factor)

    def loss(x, w, one_pass):
        if one_pass:
            y, drops = dispatch.pooled_one_device(x, idx, wts, w, send, recv, waves)
        else:
            y, drops = dispatch.pooled_dispatch(x, idx, wts, w, experts, 1, send, recv, waves)
        return jnp.sum(y * probe), drops

    results = [jax.jit(jax.value_and_grad(partial(loss, one_pass=p), argnums=(0, 1), has_aux=True))(x, w)
               for p in (True, False)]
    (value, drops), grads = results[0]
    (ref, ref_drops), ref_grads = results[1]
    assert {s: int(v) for s, v in drops.items()} == {s: int(v) for s, v in ref_drops.items()}
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    return {s: int(v) for s, v in drops.items()}


@pytest.mark.parametrize("send_factor,recv_factor,dropped_at", [(4.0, 4.0, ()), (0.7, 4.0, ("send",)),
                                                                (4.0, 0.6, ("recv",)), (0.8, 0.7, ("send", "recv"))])
def test_pooled_on_one_device_in_one_pass_equals_the_waves(send_factor, recv_factor, dropped_at):
    """Nothing dropped, drops at the sender, at the receiver, at both: the same as the waves."""
    drops = _one_pass_against_waves(send_factor, recv_factor)
    assert {stage for stage, n in drops.items() if n} == set(dropped_at), drops


def test_plan_says_pooled_runs_in_one_pass_on_one_device():
    from marin.launch.plan import format_plan, plan

    one = format_plan(plan(make_config("experiment=ladder_d768", "hardware=h200_node", "hardware.gpus_per_node=1",
                                       "hardware.tasks_per_node=1", "hardware.mesh.expert=1", "dry_run=true")))
    many = format_plan(plan(make_config("experiment=ladder_d768", "dry_run=true")))
    assert "3 waves in one pass (one device: the waves only add bookkeeping; the same drops)" in one
    assert "3 waves" in many and "one pass" not in many


# --- expert parallelism on 8 forced host devices ----------------------------------------------

TRANSPORT_NAMES = ("fixed", "pooled", "ragged")


def compare_transports() -> dict:
    """data=2 × expert=4, E=24 (6 local experts, 3 waves), k=4, 64 tokens per device, capacity
    factors so large that nothing can drop; device 0 routes all its tokens to experts 0 and 1
    first (both on peer 0): every transport must give the dropless result."""
    from marin.model import expert_parallel
    from marin.model.expert_parallel import routed_experts_ep
    from marin.model.mesh import make_mesh

    experts, k, per_device, tokens = 24, 4, 64, 512
    base = ("model=tiny", f"model.num_experts={experts}", f"router.top_k={k}", "model.capacity_factor=6.0",
            "model.ep_send_capacity_factor=8.0", "model.ep_recv_capacity_factor=8.0", "model.ep_waves=3",
            "hardware.host_devices=8", "hardware.mesh.expert=4")
    cfgs = {t: make_config(*base, f"model.ep_transport={t}", "dry_run=true") for t in TRANSPORT_NAMES}
    mesh = make_mesh(cfgs["fixed"])
    kx, kl, kw, kp = jax.random.split(jax.random.key(3), 4)
    x, w = jax.random.normal(kx, (tokens, L)), _weights(kw, experts)
    logits = jax.random.normal(kl, (tokens, experts)).at[:per_device, :2].add(20.0)
    bias, probe = jnp.zeros(experts), jax.random.normal(kp, (tokens, L))

    def loss(x, w, cfg):
        y, stats = routed_experts_ep(x, logits, bias, w, cfg, train=True, mesh=mesh)
        return jnp.sum(y * probe), stats["dropped_frac"]

    expert_parallel.RAGGED_ALL_TO_ALL = expert_parallel.emulated_ragged_all_to_all  # XLA:CPU lacks the op
    out = {}
    for name, cfg in cfgs.items():
        (value, dropped), grads = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, cfg), argnums=(0, 1),
                                                              has_aux=True))(x, w)
        out[name] = (float(value), float(dropped), grads)
    # Dropless reference: every expert on every token, per device group (routing is per token).
    unbounded = make_config(*base, "model.eval_dispatch=unbounded")
    one = jax.vmap(lambda x, lg, w: dispatch.routed_experts(x, lg, bias, w, unbounded, train=False)[0],
                   in_axes=(0, 0, None))

    def ref_loss(x, w):
        y = one(x.reshape(8, per_device, L), logits.reshape(8, per_device, experts), w).reshape(tokens, L)
        return jnp.sum(y * probe)

    ref, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))(x, w)
    diff = lambda a, b: max(float(jnp.max(jnp.abs(u - v))) for u, v in  # noqa: E731
                            zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return {"devices": jax.device_count(), "ref": float(ref)} | {
        name: {"loss": v, "dropped": d, "grads_vs_ref": diff(g, ref_grads)} for name, (v, d, g) in out.items()}


@pytest.mark.slow
def test_every_transport_with_ample_capacity_equals_the_dropless_reference():
    r = _subprocess(8, "ep")
    assert r["devices"] == 8, r
    for name in TRANSPORT_NAMES:                          # nothing dropped: the dropless loss and grads
        assert r[name]["dropped"] == 0.0, (name, r)
        assert abs(r[name]["loss"] - r["ref"]) <= 1e-4 * max(1.0, abs(r["ref"])), (name, r)
        assert r[name]["grads_vs_ref"] <= 1e-4, (name, r)


def count_pooled_drops() -> dict:
    """The published pooled transport on data=2 × expert=4 with a routing one can count by hand.

    E=24 over 4 peers: 6 local experts, 3 waves. T=96 tokens per device, k=1, every token to
    expert 0 (peer 0); send factor 1.0, receive factor 1.5: the pool for a destination holds
    S = 96/(4·3) = 8 rows per wave, the receiver R = 1.5·96/(6·3) = 8 rows per (expert, wave).
    Token t has rank t in peer 0's queue: wave t % 3, pool row t // 3, so tokens 0..23 are
    sent and 24..95 dropped at the sender. Expert 0 gets 4 senders × 8 rows per wave for 8 slots,
    allocated round-robin over pool rows: every sender's rows 0 and 1 (tokens 0..5) are kept,
    rows 2..7 (tokens 6..23) refused."""
    from jax.sharding import PartitionSpec as P

    from marin.model.expert_parallel import _transport
    from marin.model.mesh import BATCH_AXES, make_mesh

    experts, k, per_device, devices = 24, 1, 96, 8
    cfg = make_config("model=tiny", f"model.num_experts={experts}", f"router.top_k={k}", "model.ep_transport=pooled",
                      "model.ep_send_capacity_factor=1.0", "model.ep_recv_capacity_factor=1.5", "model.ep_waves=3",
                      "hardware.host_devices=8", "hardware.mesh.expert=4", "dry_run=true")
    mesh = make_mesh(cfg)
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    idx = jnp.zeros((devices * per_device, k), jnp.int32)
    wts = jnp.ones((devices * per_device, k))
    kx, kw = jax.random.split(jax.random.key(5))
    x, w = jax.random.normal(kx, (devices * per_device, L)), _weights(kw, experts)

    def local(x, idx, wts, gate, up, down):
        fn = _transport(cfg, ExpertWeights(gate, up, down), experts, 4, x.shape[0], axes)
        y, drops = fn(x, idx, wts)
        return y, jax.lax.psum(drops, axes)

    tok, ex = P(axes, None), P("expert", None, None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, ex, ex, ex), out_specs=(tok, P()))
    y, drops = jax.jit(fn)(x, idx, wts, w.gate, w.up, w.down)
    zero = np.asarray(jnp.all(y == 0, axis=-1)).reshape(devices, per_device)
    return {"drops": {s: int(v) for s, v in drops.items()}, "assignments": devices * per_device * k,
            "recv_dropped_per_sender": zero[:, :24].sum(axis=1).tolist(),
            "send_dropped_per_sender": zero[:, 24:].sum(axis=1).tolist(),
            "dropped_tokens_of_sender_0": np.nonzero(zero[0])[0].tolist()}


@pytest.mark.slow
def test_pooled_drops_per_stage_as_counted_by_hand_and_round_robin_over_senders():
    r = _subprocess(8, "counts")
    # Send: tokens 24..95 of every device: 72 × 8. Receive: 3 waves × (32 − 8) refused, × 2 data groups.
    assert r["drops"] == {"send": 8 * 72, "recv": 2 * 3 * 24}, r
    assert r["send_dropped_per_sender"] == [72] * 8, r
    # Round-robin over pool rows: every sender keeps rows 0, 1 of each wave and loses rows 2..7 ...
    assert r["recv_dropped_per_sender"] == [18] * 8, r
    assert r["dropped_tokens_of_sender_0"] == list(range(6, 96)), r     # ... its later tokens


def ragged_chunks() -> dict:
    """The ragged transport on data=2 × expert=4, E=24 (6 local experts: chunks of 3), T=32, k=2,
    for model.ep_expert_chunks 1 and 2: the drops with receive factor 1.0 on a routing counted by
    hand, and the largest difference between the two outputs with factor 8 (nothing clips)."""
    from jax.sharding import PartitionSpec as P

    from marin.model import expert_parallel
    from marin.model.expert_parallel import _transport
    from marin.model.mesh import BATCH_AXES

    experts, k, per_device, devices = 24, 2, 32, 8
    t = jnp.arange(per_device)
    second = jnp.where(t < 4, 3, 6 + t % 18)
    idx = jnp.tile(jnp.stack([jnp.zeros_like(t), second], -1), (devices, 1)).astype(jnp.int32)
    wts = jnp.full((devices * per_device, k), 0.5)
    kx, kw = jax.random.split(jax.random.key(7))
    x, w = jax.random.normal(kx, (devices * per_device, L)), _weights(kw, experts)
    expert_parallel.RAGGED_ALL_TO_ALL = expert_parallel.emulated_ragged_all_to_all  # XLA:CPU lacks the op

    def run(chunks, factor):
        cfg = make_config("model=tiny", f"model.num_experts={experts}", f"router.top_k={k}", "model.ep_transport=ragged",
                          f"model.ep_recv_capacity_factor={factor}", f"model.ep_expert_chunks={chunks}",
                          "hardware.host_devices=8", "hardware.mesh.expert=4", "dry_run=true")
        from marin.model.mesh import make_mesh
        mesh = make_mesh(cfg)
        axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)

        def local(x, idx, wts, gate, up, down):
            y, drops = _transport(cfg, ExpertWeights(gate, up, down), experts, 4, x.shape[0], axes)(x, idx, wts)
            return y, jax.lax.psum(drops, axes)

        tok, ex = P(axes, None), P("expert", None, None)
        fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, ex, ex, ex), out_specs=(tok, P()))
        y, drops = jax.jit(fn)(x, idx, wts, w.gate, w.up, w.down)
        return y, {s: int(v) for s, v in drops.items()}

    (y1, d1), (y2, d2) = run(1, 8.0), run(2, 8.0)
    return {"ample": [d1, d2], "ample_diff": float(jnp.max(jnp.abs(y1 - y2))),
            "clipped": {c: run(c, 1.0)[1] for c in (1, 2)}}


@pytest.mark.slow
def test_ragged_chunks_clip_per_chunk_and_equal_one_chunk_when_nothing_clips():
    r = _subprocess(8, "chunks")
    assert r["ample"] == [{"send": 0, "recv": 0}] * 2 and r["ample_diff"] < 1e-5, r
    # Every device sends peer 0 its 32 first choices (expert 0, chunk 0) and 4 second choices
    # (expert 3, chunk 1); 4 senders per expert group, 2 groups. Factor 1.0: ⌈1.0 · 64⌉ = 64 rows.
    # One chunk: 144 rows arrive for 64, 80 cut. Two chunks of 32 rows: chunk 0 gets 128 (96 cut),
    # chunk 1 gets 16 (none cut).
    assert r["clipped"] == {"1": {"send": 0, "recv": 2 * 80}, "2": {"send": 0, "recv": 2 * 96}}, r


def test_pooled_waves_need_not_divide_the_local_experts(capsys):
    """Every wave carries every local expert (spec §9), so 256 experts on the hero (4 local, 3
    waves) plan; before, validation refused them (one stripe per wave)."""
    make_config("model=tiny", "model.num_experts=8", "hardware.host_devices=8", "hardware.mesh.expert=4",
                "model.ep_transport=pooled", "model.ep_waves=3")
    assert launch_here("experiment=mochi_535b_a23b", "model.num_experts=256", "dry_run=true") == 0
    assert "pooled" in capsys.readouterr().out


def test_pooled_with_waves_that_do_not_divide_the_experts_equals_the_reference():
    """4 experts in 3 waves, one device: ample capacity gives the dropless result; small buffers
    give the same drops in one pass as wave by wave."""
    tokens, experts, k, waves = 64, 4, 2, 3
    kx, kw, ki = jax.random.split(jax.random.key(2), 3)
    x, w = jax.random.normal(kx, (tokens, L)), _weights(kw, experts)
    idx = jax.lax.top_k(jax.random.gumbel(ki, (tokens, experts)), k)[1]
    wts = jnp.full((tokens, k), 0.5)
    ref = dispatch.dense_dispatch(x, idx, wts, w)
    send, recv = dispatch.pooled_capacities(tokens, k, experts, 1, waves, 4.0, 4.0)
    for one_pass in (True, False):
        y, drops = (dispatch.pooled_one_device(x, idx, wts, w, send, recv, waves) if one_pass else
                    dispatch.pooled_dispatch(x, idx, wts, w, experts, 1, send, recv, waves))
        assert {s: int(v) for s, v in drops.items()} == {"send": 0, "recv": 0}
        np.testing.assert_allclose(y, ref, atol=1e-5)
    send, recv = dispatch.pooled_capacities(tokens, k, experts, 1, waves, 0.8, 0.7)
    a = dispatch.pooled_one_device(x, idx, wts, w, send, recv, waves)
    b = dispatch.pooled_dispatch(x, idx, wts, w, experts, 1, send, recv, waves)
    assert {s: int(v) for s, v in a[1].items()} == {s: int(v) for s, v in b[1].items()}
    assert int(a[1]["send"]) > 0 and int(a[1]["recv"]) > 0, a[1]
    np.testing.assert_allclose(a[0], b[0], atol=1e-5)


def test_hero_and_ladder_run_the_published_transport():
    for experiment in ("mochi_535b_a23b", "ladder_d768", "ladder_d1024", "ladder_d1536", "ladder_d2048"):
        m = make_config(f"experiment={experiment}", "dry_run=true").model
        assert (m.ep_transport, m.ep_send_capacity_factor, m.ep_recv_capacity_factor, m.ep_waves) == (
            "pooled", 1.15, 1.15, 3), experiment


# --- ragged: the hero's train step lowers on CPU ----------------------------------------------

def lower_hero_ragged() -> dict:
    """The hero's train step (mesh expert=64 on 64 forced host devices, one rack) with the
    ragged transport, lowered to StableHLO without compiling (XLA:CPU cannot compile the op)."""
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state
    from marin.train.step import make_train_step

    cfg = make_config("experiment=mochi_535b_a23b", "hardware=gb200_nvl72", "hardware.racks=1", "hardware.platform=cpu",
                      "hardware.launcher=local", "hardware.nodes=1", "hardware.tasks_per_node=1",
                      "hardware.gpus_per_node=0", "hardware.host_devices=64", "train.global_batch=1024",
                      "model.ep_transport=ragged", "dry_run=true")   # one rack: 16 × 4,096 tokens per device
    tx = build_optimizer(cfg)
    state = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "loss_mask")}
    text = jax.jit(make_train_step(cfg, tx, make_mesh(cfg))).lower(state, batch).as_text()
    return {"devices": jax.device_count(), "tokens_per_device": cfg.train.micro_batch * cfg.train.seq_len,
            "ragged_calls": text.count("@ragged_all_to_all"),
            "layers": cfg.model.num_layers, "experts": cfg.model.num_experts, "mesh_expert": cfg.hardware.mesh.expert}


@pytest.mark.slow
def test_hero_train_step_lowers_with_the_ragged_transport():
    r = _subprocess(64, "hero")
    assert r["devices"] == 64 and r["mesh_expert"] == 64 and r["experts"] == 384, r
    assert r["layers"] == 48 and r["tokens_per_device"] == 16 * 4096, r
    # forward there and back, and the transposes in the backward pass (layers are one scan)
    assert r["ragged_calls"] >= 4, r


# --- evaluation with drops -----------------------------------------------------------------------

def test_eval_with_drops_adds_the_training_capacity_loss_beside_the_dropless_one():
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state
    from marin.train.step import make_eval_step
    from tests.train.test_step import batch_of

    base = ["model=tiny", "train.seq_len=32", "train.global_batch=8", "model.capacity_factor=0.25"]
    plain, with_drops = make_config(*base), make_config(*base, "eval.with_drops=true")
    state = init_state(plain, build_optimizer(plain), jax.random.key(0))
    batch = batch_of(plain)
    a = jax.jit(make_eval_step(plain, make_mesh(plain)))(state, batch)
    b = jax.jit(make_eval_step(with_drops, make_mesh(with_drops)))(state, batch)
    assert set(a) == {"loss", "scored"} and set(b) == {"loss", "scored", "loss_dropped"}
    gap = abs(float(b["loss_dropped"]) - float(b["loss"]))
    assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-6 * float(a["loss"]), (a, b)  # stays dropless
    assert gap > 1e-4, (a, b)                  # cf 0.25 drops most assignments (noise ~1e-6)


def test_eval_with_drops_runs_at_the_trained_shard_size():
    """An eval batch of 4 training batches: the with-drops pass is the token mean of the training
    forward's shards (capacity of micro_batch rows), not one forward over all of them."""
    from dataclasses import replace

    from marin.model import routers, transformer
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state
    from marin.train.step import drops_microbatches, make_eval_step
    from tests.train.test_step import batch_of

    cfg = make_config("model=tiny", "train.seq_len=32", "train.global_batch=8", "train.eval_batch_size=32",
                      "model.capacity_factor=0.5", "eval.with_drops=true")
    state = init_state(cfg, build_optimizer(cfg), jax.random.key(0))
    batch = batch_of(replace(cfg, train=replace(cfg.train, global_batch=32)))   # 4 training batches
    assert drops_microbatches(cfg, 32) == 4 and drops_microbatches(cfg, 8) == 1
    out = jax.jit(make_eval_step(cfg, make_mesh(cfg)))(state, batch)
    drops = replace(cfg, model=replace(cfg.model, eval_dropless=False))
    bias = routers.router_bias(state.router_state, cfg)
    # jitted: one program per batch shape (run eagerly, each of the model's ops compiled on its own
    # took most of this test's 15 CPU-s)
    metrics = jax.jit(lambda params, b: transformer.loss_fn(params, b, bias, drops, train=False)[1])
    pieces = [metrics(state.params, {k: v[i * 8:(i + 1) * 8] for k, v in batch.items()}) for i in range(4)]
    expected = sum(float(m["ce"]) * float(m["tokens"]) for m in pieces) / sum(float(m["tokens"]) for m in pieces)
    whole = float(metrics(state.params, batch)["ce"])
    assert float(out["loss_dropped"]) == pytest.approx(expected, rel=1e-5)
    assert abs(whole - expected) > 1e-5        # one forward over 32 rows drops otherwise


@pytest.mark.slow
def test_loop_logs_the_dropped_loss_beside_the_dropless_one_with_the_pooled_transport(tmp_path):
    from mlflow import MlflowClient

    from marin.train.loop import train
    from tests.train.test_loop import start

    cfg, rec = start(tmp_path, "train.steps=2", "eval.with_drops=true", "model.ep_transport=pooled",
                     "model.capacity_factor=0.5", "model.ep_recv_capacity_factor=0.25", "model.ep_waves=1")
    summary = train(cfg, rec)
    dropped = {k: v for k, v in summary.items() if k.endswith("/loss_dropped")}
    dropless = {k: v for k, v in summary.items() if k.endswith("/loss") and k != "eval/macro_loss"}
    assert dropped and len(dropped) == len(dropless), summary
    assert summary["eval/macro_loss"] == pytest.approx(sum(dropless.values()) / len(dropless))
    assert any(abs(dropped[k + "_dropped"] - v) > 1e-5 for k, v in dropless.items()), summary
    metrics = MlflowClient(rec.tracking_uri).get_run(rec.run_id).data.metrics
    assert set(dropped) <= set(metrics)
    # drops by stage: the receive buffers (recv cf 0.25) refuse most; the sender pool none (cf 1.25)
    assert metrics["train/dropped_frac/recv"] > 0.5 and metrics["train/dropped_frac/send"] == 0.0, metrics
    assert metrics["train/dropped_frac"] == pytest.approx(metrics["train/dropped_frac/send"]
                                                          + metrics["train/dropped_frac/recv"], rel=1e-5)


# --- a transport switch at resume= ---------------------------------------------------------------

def test_transport_switch_at_resume_is_tagged_with_its_step(tmp_path):
    """The hero's story line: `resume=<run> model.ep_transport=ragged` continues the same state
    (the transport changes no parameter) and records the switch as a tag with the step."""
    from mlflow import MlflowClient

    from marin.launch.resume import _note_resume, changes_between
    from marin.track import record

    where = [f"run.out_dir={tmp_path}", f"tracking.uri={new_store(tmp_path)}", "model=tiny",
             "model.ep_waves=2"]   # tiny: 4 experts, 2 waves
    before = make_config(*where, "model.ep_transport=pooled")
    after = make_config(*where, "model.ep_transport=ragged", "hardware.platform=gpu")
    rec = record.create(before, before, [])
    changes = changes_between(record.config_dict(before), record.config_dict(after))
    assert changes["model.ep_transport"] == ["pooled", "ragged"]
    _note_resume(rec, [], ["model.ep_transport=ragged"], changes, after, after, step=81716)
    tags = MlflowClient(rec.tracking_uri).get_run(rec.run_id).data.tags
    assert tags["ep_transport"].startswith("ragged from step 81716"), tags
    assert "model.ep_transport: pooled → ragged" in tags["resume_1"]
    assert json.loads((rec.run_dir / "record.json").read_text())["resumes"][0]["changes"]["model.ep_transport"] == [
        "pooled", "ragged"]


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("override,field", [
    ("model.ep_transport=waves", "model.ep_transport"),
    ("model.ep_send_capacity_factor=0", "model.ep_send_capacity_factor"),
    ("model.ep_recv_capacity_factor=nan", "model.ep_recv_capacity_factor"),
    ("model.capacity_factor=nan", "model.capacity_factor"),
    ("model.ep_waves=0", "model.ep_waves"),
])
def test_bad_transport_settings_name_their_field(override, field):
    with pytest.raises(ConfigError) as err:
        make_config(override)
    assert [p[0] for p in err.value.problems] == [field]


def test_ragged_is_refused_on_cpu_unless_only_planned(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="model.ep_transport"):
        make_config("model.ep_transport=ragged")
    make_config("model.ep_transport=ragged", "dry_run=true")              # planning a GPU run from here
    make_config("model.ep_transport=ragged", "hardware=h200_node")        # a GPU run
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    code = launch_here("model.ep_transport=ragged", f"run.out_dir={tmp_path / 'out'}")
    err = capsys.readouterr().err
    assert code == 2, err
    assert [line for line in err.splitlines() if "ep_transport" in line] == [
        "error: invalid config: model.ep_transport: ragged needs a GPU (XLA:CPU cannot compile or run ragged_all_to_all): "
        "use fixed or pooled on CPU, or dry_run=true to plan"], err
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":
    print(json.dumps({"ep": compare_transports, "counts": count_pooled_drops, "hero": lower_hero_ragged,
                      "chunks": ragged_chunks}[sys.argv[1]]()))
