"""`python -m marin.generate <run> --prompt "..."`: text from a run's newest checkpoint.

Greedy by default; `--temperature T` samples from softmax(logits / T), `--top-k K` from the K
likeliest tokens only, `--seed` makes sampling repeatable. The prompt is encoded with the run's
own tokenizer (`data.tokenizer`), or given as ids (`--prompt-ids`); the output is the prompt and
its continuation as text, printed as it is generated (`--json`: one object at the end, the ids
too); the checkpoint's step goes to stderr. Generation stops after `--max-new-tokens` (at most
MAX_NEW_TOKENS) or at
the tokenizer's end-of-document id (unless `--ignore-eos`). Only ids the tokenizer has are sampled
(a model's vocabulary may be padded beyond them; the byte tokenizer's pad id is never a target).

How: the checkpoint is restored through `marin.train.checkpoint.restore_from` (the whole train
state, laid out with the run's own shardings, `train.state.state_sharding`), and the model is the
training forward (`transformer.forward`, `train=False`: dropless evaluation) with the router bias
of the checkpoint's router state (QB's pending betas, as every evaluation applies them, spec §2).
There is no KV cache: every new token re-runs the forward over the whole (fixed-length, padded)
window, so the cost per token is a full forward over min(train.seq_len, prompt + new tokens)
positions; one compilation per call. Past `train.seq_len` tokens the window slides.

Supported: one process; the run's mesh when this machine has exactly the run's device count
(rows are then repeated over the batch axes), else one device with every parameter on it — CPU
for small models (tiny, the default CPU model). Not supported: multi-process (multi-node)
restores, KV caching, batched prompts, partial restores (the optimizer state is read too).
"""
from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from marin.cli import Parser, fail
from marin.config.derive import batch_shards
from marin.config.schema import Config
from marin.data.tokenizers import BYTE, load_tokenizer
from marin.model.mesh import AXES, make_mesh, mesh_shape
from marin.optim import build_optimizer
from marin.track import record
from marin.track.errors import first_line
from marin.train.checkpoint import NoCheckpointError, checkpoint_dir, restore_from

log = logging.getLogger("marin.generate")
MAX_NEW_TOKENS = 100_000  # each new token is a whole forward pass (no KV cache): more is never meant


class GenerateError(ValueError):
    """A run, prompt or option that cannot give text; the message is one line."""


@dataclass
class Model:
    cfg: object          # the run's resolved Config
    params: dict
    router_bias: object  # [L, E] from the checkpoint's router state
    mesh: object
    step: int            # the checkpoint's step
    tokenizer: object
    compiled: dict = field(default_factory=dict)  # (temperature, top_k) -> its jitted next-token step


# ---------------------------------------------------------------------------- the run, without JAX

def run_config(rec):
    """The run's resolved config as the typed `Config` (its own saved `resolved.yaml`)."""
    from omegaconf import OmegaConf


    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), rec.resolved()))


def check_checkpoint(run_dir: Path) -> None:
    """A cheap look before JAX starts: the run has at least one finished checkpoint directory."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir() or not any(p.name.isdigit() for p in folder.iterdir()):
        raise GenerateError(f"run {run_dir.name} has no checkpoint (nothing in {folder}); a run saves one "
                            "when it ends and every train.checkpoint.every_steps")


def prompt_ids(tokenizer, vocab_size: int, text: str | None = None, ids: str | None = None) -> list[int]:
    """The prompt's ids; a GenerateError if it is empty or holds an id the model does not have."""
    if ids is not None:
        try:
            out = [int(x) for x in ids.replace(",", " ").split()]
        except ValueError:
            raise GenerateError(f"--prompt-ids: {ids!r} is not a list of integers (e.g. 72,105)") from None
    else:
        out = [int(x) for x in tokenizer.encode_batch([text or ""])[0]]
    if not out:
        raise GenerateError("the prompt is empty: give at least one token (--prompt or --prompt-ids)")
    bad = sorted({i for i in out if not 0 <= i < vocab_size})
    if bad:
        raise GenerateError(f"the prompt holds ids outside the model's vocabulary (model.vocab_size {vocab_size}): "
                            f"{', '.join(map(str, bad[:5]))}{' …' if len(bad) > 5 else ''} "
                            f"(tokenizer {tokenizer.name} with {tokenizer.vocab_size} ids)")
    return out


# ---------------------------------------------------------------------------- restoring

def _mesh(cfg):
    """The run's own mesh when this process sees its device count, else one device."""
    import jax
    from jax.sharding import AxisType


    if math.prod(mesh_shape(cfg)) == jax.device_count() and jax.process_count() == 1:
        return make_mesh(cfg)
    return jax.make_mesh((1,) * len(AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=jax.devices()[:1])


def _restore(run_dir: Path, template):
    """The one place a checkpoint is read: the project's restore of another run's newest state."""
    return restore_from(run_dir, template)


def load(rec, cfg=None) -> Model:
    """The run's newest checkpoint, restored with the run's shardings on the chosen mesh."""
    import jax

    from marin.model import routers  # JAX: imported only when this runs
    from marin.train.state import init_state, state_sharding  # JAX: imported only when this runs

    cfg = cfg or run_config(rec)
    mesh = _mesh(cfg)
    tx = build_optimizer(cfg)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    shardings = state_sharding(cfg, abstract, mesh)
    template = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    state, meta = _restore(rec.run_dir, template)
    bias = routers.router_bias(state.router_state, cfg)
    return Model(cfg, state.params, bias, mesh, int(meta.get("step", state.step)), load_tokenizer(cfg.data.tokenizer))


# ---------------------------------------------------------------------------- generating

def _next_token_fn(model: Model, temperature: float, top_k: int, allowed: int, banned: tuple[int, ...]):
    """jit(params, bias, tokens [B, S], segments [B, S], n, key) -> the token after position n-1."""
    import jax
    import jax.numpy as jnp

    from marin.model import transformer  # JAX: imported only when this runs

    cfg, mesh = model.cfg, model.mesh

    def next_token(params, bias, tokens, segments, n, key):
        logits, _ = transformer.forward(params, {"inputs": tokens, "segment_ids": segments}, bias, cfg,
                                        train=False, mesh=mesh)
        last = jax.lax.dynamic_index_in_dim(logits[0], n - 1, axis=0, keepdims=False)  # [V] float32
        ids = jnp.arange(last.shape[-1])
        last = jnp.where(ids < allowed, last, -jnp.inf)
        for b in banned:
            last = jnp.where(ids == b, -jnp.inf, last)
        if temperature <= 0:
            return jnp.argmax(last)
        last = last / temperature
        if top_k:
            kth = jax.lax.top_k(last, top_k)[0][-1]
            last = jnp.where(last < kth, -jnp.inf, last)
        return jax.random.categorical(key, last)

    return jax.jit(next_token)


def generate(model: Model, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, stop_at_eos: bool = True, on_token=None) -> list[int]:
    """The new ids after `prompt` (at most `max_new_tokens`; fewer if the end-of-document id comes);
    `on_token(id)` is called with each as it comes."""
    import jax
    import numpy as np


    tok = model.tokenizer
    window = min(model.cfg.train.seq_len, len(prompt) + max_new_tokens)
    # The run's mesh splits rows over its batch axes: the prompt is repeated on each (row 0 is read).
    rows = batch_shards(model.cfg.hardware) if model.mesh.size > 1 else 1
    banned = (tok.pad_id,) if tok.name == BYTE else ()  # the byte pad id (a tokenizer.json's pad is a real id)
    if (temperature, top_k) not in model.compiled:
        allowed = min(tok.vocab_size, model.cfg.model.vocab_size)
        model.compiled[temperature, top_k] = _next_token_fn(model, temperature, top_k, allowed, banned)
    step = model.compiled[temperature, top_k]
    key = jax.random.key(seed)
    ids, new = list(prompt), []
    tokens = np.zeros((rows, window), np.int32)
    segments = np.zeros((rows, window), np.int32)
    for i in range(max_new_tokens):
        context = ids[-window:]
        n = len(context)
        tokens[:] = 0
        tokens[:, :n] = context
        segments[:] = 0
        segments[:, :n] = 1  # one document; the padding after it (segment 0) is never attended to
        token = int(step(model.params, model.router_bias, tokens, segments, np.int32(n), jax.random.fold_in(key, i)))
        ids.append(token)
        new.append(token)
        if on_token is not None:
            on_token(token)
        if stop_at_eos and token == tok.eos_id:
            break
    return new


class Stream:
    """Prints the prompt and then each new token's text as it comes, so a long generation is not
    silent; the text printed in the end is exactly `decode(prompt + new)`. A token that ends inside
    a multi-byte character waits for the next one."""

    def __init__(self, tokenizer, prompt: list[int], out=None):
        self.tokenizer, self.ids, self.shown = tokenizer, list(prompt), ""
        self.out = out or sys.stdout
        self._show()

    def _show(self, final: bool = False) -> None:
        text = self.tokenizer.decode(self.ids)
        if not final and (text.endswith("\ufffd") or not text.startswith(self.shown)):
            return  # half a character (or a re-segmented tail): wait for more
        if not text.startswith(self.shown):  # the final text differs from what was shown: show it whole
            self.out.write("\n")
            self.shown = ""
        self.out.write(text[len(self.shown):] + ("\n" if final else ""))
        self.out.flush()
        self.shown = text

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        self._show()

    def end(self) -> None:
        self._show(final=True)


# ---------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the run: its directory, its name under outputs/runs/ or its MLflow run id")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text, encoded with the run's tokenizer")
    source.add_argument("--prompt-ids", metavar="IDS", help="token ids instead, e.g. 72,105")
    parser.add_argument("--max-new-tokens", type=int, default=64, help=f"default 64, at most {MAX_NEW_TOKENS:,}")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    parser.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-document id")
    parser.add_argument("--json", action="store_true", help="print one JSON object (ids and text)")
    parser.add_argument("--tracking-uri", help="where to look MLflow run ids up")
    parser.add_argument("--out-dir", help="where run names are looked up (default: the project's outputs/)")
    args = parser.parse_args(argv)
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        fail(f"--max-new-tokens must be 1 to {MAX_NEW_TOKENS:,} (each token is a whole forward pass); "
             f"got {args.max_new_tokens:,}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        fail(f"--temperature must be 0 (greedy) or positive; got {args.temperature}")
    if args.top_k < 0:
        fail(f"--top-k must be 0 (no limit) or positive; got {args.top_k}")


    try:
        rec = record.open(args.run, tracking_uri=args.tracking_uri, out_dir=Path(args.out_dir) if args.out_dir else None)
        cfg = run_config(rec)
        check_checkpoint(rec.run_dir)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        prompt = prompt_ids(tokenizer, cfg.model.vocab_size, args.prompt, args.prompt_ids)
        if args.top_k > cfg.model.vocab_size:
            raise GenerateError(f"--top-k {args.top_k} exceeds model.vocab_size {cfg.model.vocab_size}")
    except (record.RecordError, GenerateError, FileNotFoundError, ValueError) as err:
        fail(first_line(err))
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax warns that a read-only restore is read-only
    try:
        model = load(rec, cfg)
    except NoCheckpointError as err:
        fail(f"run {rec.run_dir.name}: {first_line(err)}")
    except Exception as err:  # a checkpoint of another model layout (the code changed since), a damaged file
        fail(f"run {rec.run_dir.name}: cannot restore its checkpoint ({type(err).__name__}: {first_line(err)})")
    print(f"checkpoint: step {model.step:,} of run {rec.run_dir.name} ({rec.run_id})", file=sys.stderr, flush=True)
    stream = None if args.json else Stream(model.tokenizer, prompt)
    new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                   stop_at_eos=not args.ignore_eos, on_token=stream)
    if stream is not None:
        stream.end()
        return 0
    print(json.dumps({"run_id": rec.run_id, "checkpoint_step": model.step, "prompt_ids": prompt, "new_ids": new,
                      "text": model.tokenizer.decode(prompt + new), "new_text": model.tokenizer.decode(new)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
