"""Tokenize a mixture's sources once into cached shards; training reuses them.

    python -m marin.data.prepare [--config-dir DIR] [group=option ...] [key=value ...]

is a Hydra app composed exactly as `launch.py` is (the same conf/, schemas and named sweeps,
``--help``, ``--cfg job``, ``--config-dir``); it validates the config (one line per bad field,
exit 2) and prepares every source and evaluation set, with a progress bar. The `Loader` calls the
same `prepare_source`, so training without this step works too: it just tokenizes first.

One shard per source, under ``<cache>/<key>/`` where the key hashes the tokenizer, the source's
kind and field, and its files (path, size, modification time) or built-in text:
``tokens.bin`` (flat uint16/uint32 ids, every document followed by the tokenizer's end-of-document
id), ``offsets.npy`` (int64 start of each document, plus the end) and ``meta.json``. A shard is
written to a temporary folder and renamed into place, so concurrent preparers never see half of one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marin.config.paths import CONF_DIR
from marin.config.store import name_options, register
from marin.config.validate import ConfigError, load
from marin.data import builtin, mixture
from marin.data.documents import Counts, UnreadableSource, documents, eval_subsets
from marin.data.tokenizers import load_tokenizer, token_dtype
from marin.model.accounting import offload_estimate  # resolves offload `auto` (pure Python)

log = logging.getLogger("marin.data")
FORMAT_VERSION = 1
BATCH_CHARS = 4_000_000  # characters handed to the tokenizer at once


@dataclass
class Shard:
    """A prepared source: its tokens (memory-mapped) and document boundaries."""
    name: str
    path: Path
    tokens: np.ndarray   # [n] uint16 | uint32, memory-mapped
    offsets: np.ndarray  # [docs + 1] int64
    documents: int
    corrupt: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def cache_dir(cfg) -> Path:
    if cfg.data.cache_dir:
        return mixture.config_path(cfg.data.cache_dir)
    return mixture.config_path(cfg.run.out_dir) / "cache" / "tokens"


def _files(kind: str, paths, root: Path) -> list[Path]:
    if kind == "builtin":
        return []
    try:
        files = [p for p in mixture.expand(paths, root) if p.is_file()]
    except mixture.SymlinkLoop as err:  # validation refuses it first; a tree changed since is refused here
        raise UnreadableSource(str(err)) from None
    if not files:
        raise UnreadableSource(f"no file matches {[str(root / p) for p in paths]}")
    return files


def source_key(kind: str, paths, text_field: str, tokenizer, root: Path) -> str:
    """Hash of what the shard's content depends on (changes when any file changes)."""
    if kind == "builtin":
        content = [builtin.fingerprint(loc) for loc in paths]
    else:
        content = [(str(p.resolve()), (s := p.stat()).st_size, s.st_mtime_ns) for p in _files(kind, paths, root)]
    blob = json.dumps([FORMAT_VERSION, tokenizer.fingerprint, kind, text_field, content])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _load(name: str, path: Path) -> Shard:
    meta = json.loads((path / "meta.json").read_text())
    tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["tokens"],))
    offsets = np.load(path / "offsets.npy")
    return Shard(name, path, tokens, offsets, meta["documents"], meta["corrupt"])


def _batches(docs, limit: int):
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


BAR_DELAY_S = 1.0  # a tokenizing bar appears once a source has taken this long


def prepare_source(name: str, kind: str, paths, text_field: str, tokenizer, root: Path,
                   cache: Path, progress: bool = True) -> Shard:
    """The shard of one source: from the cache, or tokenized now (and cached)."""
    files = _files(kind, paths, root)
    final = cache / source_key(kind, paths, text_field, tokenizer, root)
    if (final / "meta.json").is_file():
        return _load(name, final)
    from tqdm import tqdm

    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
    counts, offsets, total = Counts(), [0], 0
    dtype = token_dtype(tokenizer.vocab_size)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    # delay: drawn from BAR_DELAY_S on, so neither an empty `0.00tok` line before the first batch
    # nor a bar for a source tokenized in a moment
    bar = tqdm(desc=f"tokenizing {name}", unit="tok", unit_scale=True, disable=not progress,
               file=sys.stderr, mininterval=0.5, delay=BAR_DELAY_S)
    try:
        with open(tmp / "tokens.bin", "wb") as out:
            docs = documents(kind, files, text_field, counts, builtin_locations=paths)
            for batch in _batches(docs, BATCH_CHARS):
                encoded = [np.concatenate([ids, np.asarray(eos, np.uint32)]) for ids in tokenizer.encode_batch(batch)]
                lengths = np.fromiter((len(e) for e in encoded), np.int64, len(encoded))
                offsets.extend((total + np.cumsum(lengths)).tolist())
                total += int(lengths.sum())
                out.write(np.concatenate(encoded).astype(dtype).tobytes())
                bar.update(int(lengths.sum()))
        bar.close()
        if counts.documents == 0:
            raise UnreadableSource(f"the source is empty: no readable document ({counts.corrupt} "
                                   "corrupt skipped)")
        np.save(tmp / "offsets.npy", np.asarray(offsets, np.int64))
        meta = {"name": name, "kind": kind, "paths": list(paths), "files": [str(f) for f in files],
                "tokenizer": tokenizer.fingerprint, "dtype": np.dtype(dtype).name, "tokens": total,
                "documents": counts.documents, "corrupt": counts.corrupt, "version": FORMAT_VERSION}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its copy first: keep that one
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if counts.corrupt:
        log.warning("source %s: skipped %d corrupt document(s) of %d", name, counts.corrupt,
                    counts.corrupt + counts.documents)
    return _load(name, final)


def prepare(cfg, progress: bool = True) -> tuple[list[Shard | None], dict[str, Shard]]:
    """Shards of every source (None for one with zero weight in every phase) and eval set.

    Raises `UnreadableSource` naming the config field of a source that cannot be used.
    """
    cfg = with_eval_subsets(cfg)
    tok = load_tokenizer(cfg.data.tokenizer)
    root, cache = mixture.data_root(cfg), cache_dir(cfg)

    def one(field, name, kind, paths, text_field):
        try:
            return prepare_source(name, kind, paths, text_field, tok, root, cache, progress)
        except UnreadableSource as err:
            raise UnreadableSource(f"{field} ({name}): {err}") from err

    shards = [one(s.field, s.name, s.kind, s.paths, s.text_field) if any(w > 0 for w in s.weights) else None
              for s in mixture.sources(cfg)]
    evals = {e.name: one(f"data.eval_sets[{i}]", e.name, e.kind, e.paths, e.text_field)
             for i, e in enumerate(cfg.data.eval_sets)}
    return shards, evals


def run(composed) -> int:
    """Validate a composed config and prepare its data; the exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        _, cfg = load(composed, (mixture.check,), memory=offload_estimate)  # the data checks; the others are a launch's
    except ConfigError as err:
        print("\n".join(f"error: {n}: {m}" for n, m in err.problems), file=sys.stderr)
        return 2
    try:
        shards, evals = prepare(cfg)
    except UnreadableSource as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    epochs = mixture.epochs_per_source(cfg, {s.name: s.num_tokens for s in shards if s})
    print(f"{'source':<28} {'documents':>10} {'corrupt':>8} {'tokens':>14} {'epochs':>7}  cache")
    for s in [*(s for s in shards if s), *evals.values()]:
        e = f"{sum(epochs[s.name]):.2f}" if s.name in epochs else "eval"
        print(f"{s.name:<28} {s.documents:>10,} {s.corrupt:>8,} {s.num_tokens:>14,} {e:>7}  {s.path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The Hydra app on `argv` (default: the command line); returns the exit status. Hydra's
    own composition errors (an unknown option or key) exit as they do for `launch.py`."""
    import hydra


    argv = sys.argv[1:] if argv is None else list(argv)
    if "-m" in argv or "--multirun" in argv:
        print("error: marin.data.prepare takes one config, not a multirun (-m): prepare each in turn",
              file=sys.stderr)
        return 2
    register()
    status = {"code": 0}

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def app(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        status["code"] = run(name_options(cfg, HydraConfig.get().runtime.choices))

    if "--help" in argv or "-h" in argv:  # Hydra's help, headed by what this app does
        argv = [*argv, "hydra.help.header='usage: python -m marin.data.prepare [group=option ...] [key=value ...]"
                "    tokenize the mixture of a config (the same overrides as launch.py) into the cache training "
                "reads'"]
    saved = sys.argv
    sys.argv = ["python -m marin.data.prepare", *argv]  # Hydra reads its arguments from here
    try:
        app()
    finally:
        sys.argv = saved
    return status["code"]


def with_eval_subsets(cfg):
    """`cfg` with each `subsets` eval set replaced by its subsets (`documents.eval_subsets`); the same
    `cfg` when none has them."""
    if not any(getattr(e, "subsets", False) for e in cfg.data.eval_sets):
        return cfg
    root = mixture.data_root(cfg)
    sets = [s for e in cfg.data.eval_sets for s in eval_subsets(e, root)]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_sets=sets))


if __name__ == "__main__":
    sys.exit(main())
