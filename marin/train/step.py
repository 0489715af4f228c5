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


def make_train_step(cfg, tx, mesh):
    n_micro = num_microbatches(cfg)

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
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        router_state = routers.next_router_state(state.router_state, metrics["router"], cfg)
        out = {k: metrics[k] for k in SCALARS if k in metrics}
        out["grad_norm"] = optax.tree.norm(grads)
        # per layer [L]: logged as train/<name>/layer_<i>
        out["dropped_frac_per_layer"] = metrics["router"]["dropped_frac"]
        out["load_spread_per_layer"] = jax.vmap(lambda load: transformer.load_spread(load[None]))(
            metrics["router"]["load"])
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  router_state=router_state)
        return new_state, out

    return train_step


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
