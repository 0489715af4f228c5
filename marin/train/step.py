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
import optax

from marin.model import routers, transformer
from marin.train.state import TrainState

SCALARS = ("loss", "ce", "z_loss", "aux_loss", "dropped_frac", "load_spread")


def num_microbatches(cfg) -> int:
    """Micro-batches per step: the global batch over what the devices hold in one forward."""
    from marin.config.derive import batch_shards

    return cfg.train.global_batch // (cfg.train.micro_batch * batch_shards(cfg.hardware))


def to_memory(tree, space):
    """Move every leaf of `tree` to memory `space` (jax.memory.Space.Device / Host), keeping
    its sharding: how `optim.offload` brings the optimizer state in and out of the step."""
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def make_train_step(cfg, tx, mesh):
    n_micro = num_microbatches(cfg)
    offload = cfg.optim.offload

    def grads_of(params, batch, bias):
        def loss(p):
            value, metrics = transformer.loss_fn(p, batch, bias, cfg, train=True, mesh=mesh)
            return value, metrics
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return grads, metrics

    def train_step(state: TrainState, batch):
        bias = routers.router_bias(state.router_state, cfg)
        if n_micro == 1:
            grads, metrics = grads_of(state.params, batch, bias)
        else:
            # [B, ...] → [n_micro, B / n_micro, ...]: rows are split contiguously per device
            micro = jax.tree.map(lambda x: x.reshape(n_micro, -1, *x.shape[1:]), batch)

            def accumulate(acc, mb):
                g, m = grads_of(state.params, mb, bias)
                return jax.tree.map(jnp.add, acc, (g, m)), None

            zeros = jax.eval_shape(grads_of, state.params, jax.tree.map(lambda x: x[0], micro), bias)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
            (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
            grads, metrics = jax.tree.map(lambda x: x / n_micro, (grads, metrics))
        opt_state = to_memory(state.opt_state, jax.memory.Space.Device) if offload else state.opt_state
        updates, opt_state = tx.update(grads, opt_state, state.params)
        if offload:  # back to pinned host memory (its place in the state's out_shardings)
            opt_state = to_memory(opt_state, jax.memory.Space.Host)
        params = optax.apply_updates(state.params, updates)
        router_state = routers.next_router_state(state.router_state, metrics["router"], cfg)
        out = {k: metrics[k] for k in SCALARS if k in metrics}
        out["grad_norm"] = optax.tree.norm(grads)
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
    batch axes. `dry_run=compile` lowers these same two functions."""
    from marin.train.state import batch_sharding

    batch_spec = batch_sharding(mesh)
    train_step = jax.jit(make_train_step(cfg, tx, mesh), in_shardings=(shardings, batch_spec),
                         out_shardings=(shardings, None), donate_argnums=0)
    eval_step = jax.jit(make_eval_step(cfg, mesh), in_shardings=(shardings, batch_spec))
    return train_step, eval_step


def make_eval_step(cfg, mesh):
    """eval_step(state, batch) -> {"loss": dropless ce} (+ "loss_dropped": the ce with the
    training transport's capacity and drops, when `train.eval_with_drops`)."""
    # The same forward with the training pass's dispatch (model.ep_transport and its capacities).
    with_drops = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, eval_dropless=False))

    def eval_step(state: TrainState, batch):
        # Evaluation applies the pending router state too (spec: QB betas apply at every eval).
        bias = routers.router_bias(state.router_state, cfg)
        _, metrics = transformer.loss_fn(state.params, batch, bias, cfg, train=False, mesh=mesh)
        out = {"loss": metrics["ce"]}
        if cfg.train.eval_with_drops:
            _, dropped = transformer.loss_fn(state.params, batch, bias, with_drops, train=False, mesh=mesh)
            out["loss_dropped"] = dropped["ce"]
        return out

    return eval_step
