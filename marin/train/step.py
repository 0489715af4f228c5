"""The jitted train and eval steps.

One train step = (optionally) several micro-batches scanned with gradient accumulation, one
optimizer update, and the router-state update (QB: the betas measured in this step become the
pending betas applied at the start of the next one). Shapes never change between steps, so the
step compiles once.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from marin.config.derive import batch_shards, drops_microbatches
from marin.model import routers, transformer
from marin.optim import build_optimizer
from marin.optim.hparams import structure_key, values
from marin.optim.muonh import fetch, on_host, per_layer
from marin.train.state import TrainState, batch_sharding

SCALARS = ("loss", "ce", "z_loss", "aux_loss", "dropped_frac", "dropped_frac/send", "dropped_frac/recv",
           "load_spread")


def num_microbatches(cfg) -> int:
    """Micro-batches per step: the global batch over what the devices hold in one forward."""

    return cfg.train.global_batch // (cfg.train.micro_batch * batch_shards(cfg.hardware))


def to_memory(tree, space):
    """Move every leaf of `tree` to memory `space` (jax.memory.Space.Device / Host), keeping
    its sharding: how `optim.offload` brings the optimizer state in and out of the step."""
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def streamed(path) -> bool:
    """Optimizer-state leaves the optimizer reads and writes one layer at a time itself, from
    wherever they live: MuonH's momentum (`trace`, marin.optim.muonh). The step does not
    stage them on the device whole."""
    return any(getattr(k, "name", None) == "trace" for k in path)


def opt_state_to_device(opt_state):
    """The offloaded optimizer state as the update reads it: every leaf on the device, except
    the streamed ones (`streamed`), which stay in host memory."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if streamed(p) else jax.device_put(x, jax.memory.Space.Device), opt_state)


def add(a, b):
    """a + b (in a's dtype) where either may live in host memory: one layer at a time there."""
    if on_host(a) or on_host(b):
        return per_layer(lambda x, y: x + y.astype(x.dtype), a, b)
    return (a + b).astype(a.dtype)


def apply_updates(params, updates):
    """`optax.apply_updates`, with leaves in host memory (offloaded fp32 masters) updated one
    layer at a time: a whole host leaf never comes to the device."""
    return jax.tree.map(add, params, updates)


def global_norm(tree):
    """`optax.tree.norm`, reading host leaves one layer's slice at a time."""
    def sum_sq(x):
        if not on_host(x):
            return jnp.sum(jnp.square(x.astype(jnp.float32)))
        if x.ndim <= 2:
            return jnp.sum(jnp.square(fetch(x).astype(jnp.float32)))
        part = lambda i, acc: acc + jnp.sum(jnp.square(fetch(x[i]).astype(jnp.float32)))
        return jax.lax.fori_loop(0, x.shape[0], part, jnp.zeros((), jnp.float32))
    return jnp.sqrt(sum(sum_sq(x) for x in jax.tree.leaves(tree)))


def make_train_step(cfg, tx, mesh):
    n_micro = num_microbatches(cfg)
    offload = cfg.optim.offload

    def grads_of(params, batch, bias):
        def loss(p):
            value, metrics = transformer.loss_fn(p, batch, bias, cfg, train=True, mesh=mesh)
            return value, metrics
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return grads, metrics

    def train_step(state: TrainState, batch, hp=None):
        # hp: the optimizer's numbers as inputs (marin.optim.hparams); None = tx as given
        opt = tx if hp is None else build_optimizer(cfg, hp)
        bias = routers.router_bias(state.router_state, cfg)
        if n_micro == 1:
            grads, metrics = grads_of(state.params, batch, bias)
        else:
            # [B, ...] → [n_micro, B / n_micro, ...]: rows are split contiguously per device
            micro = jax.tree.map(lambda x: x.reshape(n_micro, -1, *x.shape[1:]), batch)

            def accumulate(acc, mb):
                g, m = grads_of(state.params, mb, bias)
                return (jax.tree.map(add, acc[0], g), jax.tree.map(jnp.add, acc[1], m)), None

            zeros = jax.eval_shape(grads_of, state.params, jax.tree.map(lambda x: x[0], micro), bias)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
            (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
            grads, metrics = jax.tree.map(lambda x: x / n_micro, (grads, metrics))
        with jax.named_scope("optimizer"):   # a part of its own in profiles (benchmarks/gpu_profile.py)
            opt_state = opt_state_to_device(state.opt_state) if offload else state.opt_state
            updates, opt_state = opt.update(grads, opt_state, state.params)
            if offload:  # back to pinned host memory (its place in the state's out_shardings)
                opt_state = to_memory(opt_state, jax.memory.Space.Host)
            params = apply_updates(state.params, updates)
        router_state = routers.next_router_state(state.router_state, metrics["router"], cfg)
        out = {k: metrics[k] for k in SCALARS if k in metrics}
        out["grad_norm"] = global_norm(grads)
        # per layer [L]: logged as train/<name>/layer_<i>
        out["dropped_frac_per_layer"] = metrics["router"]["dropped_frac"]
        out["load_spread_per_layer"] = jax.vmap(lambda load: transformer.load_spread(load[None]))(
            metrics["router"]["load"])
        out["expert_load"] = metrics["router"]["load"]  # [L, E]: snapshots for the run report
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  router_state=router_state)
        return new_state, out

    return train_step


def jit_steps(cfg, tx, mesh, shardings):
    """(train_step, eval_step) jitted exactly as the loop runs them: the state in `shardings`
    (marin.train.state.state_sharding) and donated to the train step, batches split over the
    batch axes. `dry_run=compile` lowers these same two functions.

    train_step(state, batch, hp) takes the optimizer's numbers `hp` (`hyperparams(cfg)`) as an
    input: configs differing only in those share one jitted step in this process (memoised on
    `marin.optim.hparams.structure_key`) and one program in the persistent compilation cache."""

    leaves, treedef = jax.tree.flatten(shardings)
    key = (structure_key(cfg), mesh, treedef, tuple(leaves))
    if key not in _JITTED:
        _JITTED.clear()  # one model per process at a time: do not pin old executables
        _JITTED[key] = _jit_steps(cfg, tx, mesh, shardings)
    return _JITTED[key]


_JITTED: dict = {}


def _jit_steps(cfg, tx, mesh, shardings):
    from jax.sharding import NamedSharding, PartitionSpec


    batch_spec = batch_sharding(mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    train_step = jax.jit(make_train_step(cfg, tx, mesh), in_shardings=(shardings, batch_spec, replicated),
                         out_shardings=(shardings, None), donate_argnums=0)
    eval_step = jax.jit(make_eval_step(cfg, mesh), in_shardings=(shardings, batch_spec))
    return train_step, eval_step


def hyperparams(cfg, mesh):
    """The train step's `hp` input of `cfg`, replicated over `mesh` (built once per run)."""
    from jax.sharding import NamedSharding, PartitionSpec


    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, replicated, lambda idx: x[idx]),
                        jax.tree.map(np.asarray, values(cfg)))


def make_eval_step(cfg, mesh):
    """eval_step(state, batch) -> {"loss": dropless ce, "scored": targets scored} (+ "loss_dropped":
    the ce with the training transport's capacity and drops at the trained shard size
    (`drops_microbatches`), when `eval.with_drops`). The Evaluator weighs batches by "scored"."""
    # The same forward with the training pass's dispatch (model.ep_transport and its capacities).
    with_drops = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, eval_dropless=False))
    def dropped_ce(params, batch, bias):
        n_micro = drops_microbatches(cfg, batch["inputs"].shape[0])   # static at trace time
        if n_micro == 1:
            return transformer.loss_fn(params, batch, bias, with_drops, train=False, mesh=mesh)[1]["ce"]
        # [B, ...] → [n, B / n, ...] as the train step splits its batch: each piece a training shard
        micro = jax.tree.map(lambda x: x.reshape(n_micro, -1, *x.shape[1:]), batch)

        def piece(mb):
            m = transformer.loss_fn(params, mb, bias, with_drops, train=False, mesh=mesh)[1]
            return m["ce"] * m["tokens"], m["tokens"]
        ce_sums, tokens = jax.lax.map(piece, micro)
        return jnp.sum(ce_sums) / jnp.maximum(jnp.sum(tokens), 1.0)

    def eval_step(state: TrainState, batch):
        # Evaluation applies the pending router state too (spec: QB betas apply at every eval).
        bias = routers.router_bias(state.router_state, cfg)
        _, metrics = transformer.loss_fn(state.params, batch, bias, cfg, train=False, mesh=mesh)
        out = {"loss": metrics["ce"], "scored": jnp.sum(batch["loss_mask"])}
        if cfg.eval.with_drops:
            out["loss_dropped"] = dropped_ce(state.params, batch, bias)
        return out

    return eval_step
