"""The Mochi MoE transformer (spec §2), top to bottom.

    tokens → embed → RMSNorm → GatedNorm
           → L × Block (one nn.scan over stacked parameters):
                 x += conv(attention(GatedNorm(RMSNorm(x))))
                 x += conv(MoE(GatedNorm(RMSNorm(x))))
           → RMSNorm → GatedNorm → head (untied) → logits

Layers differ only in data: each scan step receives its `is_global` flag and its router bias
row, so compile time does not grow with depth. Parameters are float32 masters; matmuls run in
`model.compute_dtype`; norms, softmax, logits and the loss stay float32 (the head and the loss
are fused, marin/model/loss.py: the logits' gradient enters the head's backward matmuls in the
compute dtype, and the logits exist one tile at a time). The residual stream
(each layer's carry, and what `model.offload_carry` stages in host memory) is in
`model.residual_dtype`: float32 by default, bfloat16 as production ran it (spec §8 "Numerics").

Public API (docs/CONTRACTS.md "Model API"): `init_params`, `param_shapes`, `forward`, `loss_fn`.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from marin.config.counts import layer_is_global
from marin.config.derive import batch_shards, remat_mode
from marin.config.schema import Config
from marin.model.attention import Attention, report_fallback
from marin.model.conv import CausalConv
from marin.model.loss import linear_cross_entropy
from marin.model.memory import fetch
from marin.model.moe import MoE
from marin.model.norms import GatedNorm, RMSNorm, matmul, matrix_init

# Sequence length of the dummy batch that traces the parameters (their shapes do not depend on it).
INIT_SEQ_LEN = 8
# Name of each layer's input (the residual carry) for remat policies: `model.offload_carry`
# stages exactly this tensor in pinned host memory between the forward and backward pass.
CARRY = "carry"
# Routed expert weights [E, ...] per layer: expert-parallel, never gathered (marin/train/state.py).
EXPERT_LEAVES = ("w_gate", "w_up", "w_down")


def gathered(module, cfg: Config, mesh):
    """`module` whose weights are brought where they are used, one layer at a time.

    FSDP (`hardware.mesh.fsdp`): the state keeps each weight sharded inside the replica; an
    explicit constraint to replicated at its use makes XLA all-gather one layer at a time (inside
    the layer scan and, with remat, again in the backward pass) and reduce-scatter the gradient,
    instead of letting the partitioner split the matmuls over the batch's own axes. Expert
    weights stay split. Expert weights in pinned host memory (fp32 masters offloaded,
    marin.train.state) are copied to the device here, a layer's slice at a time; the transpose
    of that copy sends the slice's gradient back to host memory."""
    if mesh is None:
        return module
    from jax.sharding import NamedSharding, PartitionSpec


    replicated = NamedSharding(mesh, PartitionSpec())
    fsdp = cfg.hardware.mesh.fsdp

    def gather(path, x):
        names = {getattr(k, "key", None) for k in path}
        if names & set(EXPERT_LEAVES):
            return fetch(x)
        return jax.lax.with_sharding_constraint(x, replicated) if fsdp else x

    return nn.map_variables(module, "params", trans_in_fn=lambda v: jax.tree_util.tree_map_with_path(gather, v),
                            init=False)


def compute_dtype(cfg: Config) -> jnp.dtype:
    return jnp.dtype(cfg.model.compute_dtype)


def residual_dtype(cfg: Config) -> jnp.dtype:
    return jnp.dtype(cfg.model.residual_dtype)


def norm_site(cfg: Config, name: str):
    """The two modules of one norm site, named `<name>_norm` and `<name>_gated_norm`."""
    m = cfg.model
    rms = RMSNorm(m.norm_eps, name=f"{name}_norm")
    gated = GatedNorm(m.gated_norm_rank, m.init_std, compute_dtype(cfg), name=f"{name}_gated_norm")
    return lambda x: gated(rms(x))


class Block(nn.Module):
    """One pre-norm residual layer: attention branch, then MoE branch, each closed by a conv."""
    cfg: Config
    train: bool
    mesh: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, layer_inputs: tuple[jax.Array, jax.Array], segment_ids: jax.Array):
        is_global, router_bias = layer_inputs
        taps = self.cfg.model.conv_kernel
        residual = residual_dtype(self.cfg)   # each branch is added to the stream in this dtype
        x = name_carry(x)

        h = norm_site(self.cfg, "attn")(x)
        h = Attention(self.cfg, compute_dtype(self.cfg), name="attn")(h, segment_ids, is_global)
        x = x + CausalConv(taps, name="attn_out_conv")(h, segment_ids).astype(residual)

        h = norm_site(self.cfg, "moe")(x)
        # Padding (segment 0, marin/data/loader.py) is no token for routing (spec §9).
        h, stats = MoE(self.cfg, name="moe")(h, router_bias, train=self.train, mesh=self.mesh, valid=segment_ids != 0)
        x = x + CausalConv(taps, name="moe_out_conv")(h, segment_ids).astype(residual)
        return x, stats


def _carry_as_bits(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return jax.lax.bitcast_convert_type(checkpoint_name(bits, CARRY), x.dtype)


# Identity derivative (a bitcast to an integer has none). The rule computes the primal inline, not
# through the custom_jvp, so the remat policy sees the named uint16 value.
_carry_as_bits_jvp = jax.custom_jvp(_carry_as_bits)
_carry_as_bits_jvp.defjvp(lambda primals, tangents: (_carry_as_bits(primals[0]), tangents[0]))


def name_carry(x: jax.Array) -> jax.Array:
    """`x` named CARRY for the remat policy. A 16-bit float carry is named as its raw bits (uint16):
    XLA:CPU computes every dynamic-slice and dynamic-update-slice of bf16 in float32 (its float
    normalization; XLA:GPU slices bf16 as it is), so the layer scan's stacked bf16 carries
    [L, B, T, d] would gain a whole float32 copy, hoisted out of the backward loop, that a GPU never
    makes (the hero's `dry_run=compile`: +36.8 GiB). Bits are sliced as they are. The values and
    gradients are bit for bit those of the bf16 carry; on a GPU the bitcasts cost nothing."""
    if x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        return _carry_as_bits_jvp(x)
    return checkpoint_name(x, CARRY)


def remat_policy(cfg: Config):
    """What a rematerialised block keeps for the backward pass (`model.remat`, `model.offload_carry`):

    full  nothing but the block's input (the carry): the whole block is recomputed;
    dots  also the outputs of matmuls without batch dims (projections; not attention scores);
    offload_carry  the carry goes to pinned host memory instead of staying on the device.
    """
    cp = jax.checkpoint_policies
    keep = cp.dots_with_no_batch_dims_saveable if remat_mode(cfg.model.remat) == "dots" else cp.nothing_saveable
    if not cfg.model.offload_carry:
        return keep
    offload = cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[CARRY],
        offload_src="device", offload_dst="pinned_host")

    def policy(prim, *args, **params):  # the carry is offloaded; the rest as `keep` says
        decision = offload(prim, *args, **params)  # Offloadable (a NamedTuple) for the carry only
        return decision if isinstance(decision, tuple) else keep(prim, *args, **params)
    return policy


class Head(nn.Module):
    """Untied output projection `kernel` [d, V]; logits come out float32."""
    vocab_size: int
    init_std: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", matrix_init(self.init_std), (x.shape[-1], self.vocab_size), jnp.float32)
        return matmul(x, kernel, self.dtype, jnp.float32)


class Transformer(nn.Module):
    cfg: Config
    train: bool
    mesh: Any = None
    hidden_only: bool = False  # return the final normed hidden state instead of logits (chunked loss)

    @nn.compact
    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, router_bias: jax.Array):
        m, a = self.cfg.model, self.cfg.attention
        embed = gathered(nn.Embed, self.cfg, self.mesh)
        x = embed(m.vocab_size, m.d_model, embedding_init=matrix_init(m.init_std), name="embed")(inputs)
        x = norm_site(self.cfg, "embed")(x).astype(residual_dtype(self.cfg))   # the residual stream starts here

        mode = remat_mode(m.remat)
        block = gathered(Block, self.cfg, self.mesh)
        if mode != "none":
            block = nn.remat(block, prevent_cse=False, policy=remat_policy(self.cfg))
        layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, nn.broadcast), length=m.num_layers)
        report_fallback(segment_ids, self.cfg)   # cudnn on a row of too many documents: one log line
        is_global = jnp.array(layer_is_global(m.num_layers, a.global_every, a.last_layer_global))
        x, stats = layers(self.cfg, self.train, self.mesh, name="layers")(
            x, (is_global, router_bias), segment_ids)

        x = norm_site(self.cfg, "final")(x)
        if self.hidden_only:
            return x, stats
        logits = gathered(Head, self.cfg, self.mesh)(m.vocab_size, m.init_std, compute_dtype(self.cfg), name="head")(x)
        return logits, stats


def _dummy_inputs(cfg: Config):
    tokens = jnp.zeros((1, INIT_SEQ_LEN), jnp.int32)
    router_bias = jnp.zeros((cfg.model.num_layers, cfg.model.num_experts), jnp.float32)
    return tokens, jnp.ones_like(tokens), router_bias


def init_params(cfg: Config, key: jax.Array):
    """Float32 parameter pytree (tree and names: docs/CONTRACTS.md)."""
    def init(key):
        return Transformer(cfg, train=False).init({"params": key}, *_dummy_inputs(cfg))["params"]
    return jax.jit(init)(key)


def param_shapes(cfg: Config):
    """The parameter pytree as jax.ShapeDtypeStruct leaves, allocating nothing."""
    return jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))


def forward(params, batch: dict, router_bias: jax.Array, cfg: Config, *, train: bool, mesh=None):
    """(logits [B, T, V] float32, aux) with aux["router"] the per-layer MoE stats stacked [L, ...]."""
    logits, stats = Transformer(cfg, train=train, mesh=mesh).apply(
        {"params": params}, batch["inputs"], batch["segment_ids"], router_bias)
    return logits, {"router": stats}


def load_spread(load: jax.Array) -> jax.Array:
    """Mean over layers of (max − min expert load) / mean expert load: 0 when perfectly balanced,
    E (the expert count) when one expert takes every assignment."""
    mean = jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    return jnp.mean((jnp.max(load, axis=-1) - jnp.min(load, axis=-1)) / mean)


def loss_fn(params, batch: dict, router_bias: jax.Array, cfg: Config, *, train: bool, mesh=None):
    """(loss, metrics). loss = ce + z_loss + aux_loss, where over the tokens with loss_mask:
    ce = mean next-token cross-entropy, z_loss = model.z_loss · mean(logsumexp²), and aux_loss is
    the MoE auxiliary loss summed over layers (zero except for the softmax_aux router).
    The metrics report each term as it enters the loss, so they add up to "loss"."""
    hidden, stats = Transformer(cfg, train=train, mesh=mesh, hidden_only=True).apply(
        {"params": params}, batch["inputs"], batch["segment_ids"], router_bias)
    kernel = params["head"]["kernel"]
    if mesh is not None and cfg.hardware.mesh.fsdp:  # FSDP: gathered where used, as in `gathered`
        from jax.sharding import NamedSharding, PartitionSpec
        kernel = jax.lax.with_sharding_constraint(kernel, NamedSharding(mesh, PartitionSpec()))
    mask = batch["loss_mask"].astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    # fused head + loss: logits exist one [row chunk, vocabulary tile] at a time (marin/model/loss.py)
    ce_sum, lse_sq_sum = linear_cross_entropy(hidden, kernel, batch["targets"], mask, compute_dtype(cfg),
                                              batch_shards=batch_shards(cfg.hardware) if mesh is not None else 1)
    ce = ce_sum / tokens
    z_loss = cfg.model.z_loss * lse_sq_sum / tokens
    aux_loss = jnp.sum(stats["aux_loss"])
    loss = ce + z_loss + aux_loss

    metrics = {
        "loss": loss, "ce": ce, "z_loss": z_loss, "aux_loss": aux_loss,
        "dropped_frac": jnp.mean(stats["dropped_frac"]),
        "dropped_frac/send": jnp.mean(stats["dropped_frac/send"]),   # by stage of the transport
        "dropped_frac/recv": jnp.mean(stats["dropped_frac/recv"]),
        "load_spread": load_spread(stats["load"]),
        "tokens": jnp.sum(mask),
        "router": stats,
    }
    return loss, metrics
