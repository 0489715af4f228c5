"""Tokenize a mixture's sources once into cached, sharded, verified caches; training reuses them.

    python -m marin.data.prepare [--config-dir DIR] [group=option ...] [key=value ...]
    python -m marin.data.prepare data=mochi_hero hardware=slurm_cpu dry_run=true   # the plan only

is a Hydra app composed exactly as `launch.py` is (the same conf/, schemas and named sweeps,
``--help``, ``--cfg job``, ``--config-dir``); it validates the config (one line per bad field,
exit 2), plans the work (`marin.data.prepare_tasks`: sources → file groups → tasks, with estimated
tokens, shards and hours) and runs it: locally in a process pool (`data.prepare_tasks`, default the
CPUs here) with a progress bar, on Slurm (a hardware with ``launcher: slurm``) as one submitit job
array (`marin.launch.prepare_array`, the launch layer: this module's ``__main__`` hands the command
line to `marin.launch.prepare`). ``dry_run=true`` prints the plan and writes nothing. The `Loader`
calls `prepare`, so training without this step works too: it tokenizes what is missing first.

Each source's cache is ``<cache>/<key>/`` (`marin.data.shards`: shards, manifests, an index), the
key a hash of the tokenizer, `data.shard_tokens`, the source's kind and field, and its files
(path, size, modification time) or built-in text. A rerun skips the shards whose manifests verify.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import sys
from pathlib import Path

from marin.config import derive
from marin.config.paths import CONF_DIR
from marin.config.store import name_options, register
from marin.config.validate import ConfigError, load
from marin.data import builtin, mixture, prepare_tasks
from marin.data.documents import UnreadableSource, eval_subsets, records
from marin.data.prepare_tasks import Plan, SourcePlan
from marin.data.shards import ShardedSource, read_index
from marin.data.tokenizers import load_tokenizer
from marin.model.accounting import offload_estimate  # resolves offload `auto` (pure Python)

log = logging.getLogger("marin.data")
FORMAT_VERSION = 3   # in the cache key: a bump re-tokenizes old caches once (3: the index as columns)
SAMPLE_CHARS = 1_000_000   # text tokenized to estimate a source's tokens
Shard = ShardedSource      # a prepared source, as the loader knows it


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


def _inputs(kind: str, paths, root: Path, files: list[Path] | None = None) -> list:
    """What a source's cache content depends on: every file's (path, size, modification time), or
    the built-in text's fingerprints (globs, unless given `files`, and stats every file)."""
    if kind == "builtin":   # its text, and how it is cut into groups (the shards follow the groups)
        return [f"{builtin.fingerprint(loc)}:groups-{builtin.GROUP_CHARS}" for loc in paths]
    files = _files(kind, paths, root) if files is None else files
    return [(str(p.resolve()), (s := p.stat()).st_size, s.st_mtime_ns) for p in files]


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:24]


def source_key(kind: str, paths, text_field: str, tokenizer, root: Path, shard_tokens: int = 2**31,
               inputs: list | None = None) -> str:
    """Hash of what the cache's content depends on (changes when any file changes)."""
    inputs = _inputs(kind, paths, root) if inputs is None else inputs
    return _hash([FORMAT_VERSION, tokenizer.fingerprint, kind, text_field, shard_tokens, inputs])


def config_key(kind: str, paths, text_field: str, tokenizer, root: Path, shard_tokens: int) -> str:
    """Hash of a source's config alone (its path patterns, not the files they match): the name of
    the pointer (`pointer_path`) to its last preparation, found without touching the input files."""
    where = [builtin.fingerprint(loc) for loc in paths] if kind == "builtin" else [str(root / p) for p in paths]
    return _hash([FORMAT_VERSION, tokenizer.fingerprint, kind, text_field, shard_tokens, where])


def _entries(cfg):
    """(field, name, kind, paths, text_field, tokens) of every source to prepare (weighted in some
    phase) and every eval set; `cfg` has its eval subsets applied."""
    out = [(s.field, s.name, s.kind, s.paths, s.text_field, s.tokens)
           for s in mixture.sources(cfg) if any(w > 0 for w in s.weights)]
    out += [(f"data.eval_sets[{i}]", e.name, e.kind, e.paths, e.text_field, None)
            for i, e in enumerate(cfg.data.eval_sets)]
    return out


def source_plan(cfg, entry, tok, root: Path, cache: Path, here: bool = True) -> SourcePlan:
    """One source's plan; `here=False` (a dry run) tolerates files and tokenizer not on this machine."""
    field, name, kind, paths, text_field, tokens = entry
    limit = cfg.data.shard_tokens
    inputs, ckey = [], ""
    try:
        files = _files(kind, paths, root)
        if kind == "builtin":   # each location cut into groups of consecutive documents
            split = [(loc, r) for loc in paths for r in builtin.ranges(loc)]
            groups, ranges = [([loc], r[2]) for loc, r in split], [[r[0], r[1]] for _, r in split]
        else:
            groups, ranges = prepare_tasks.group_files(files, limit, kind), []
        if tok is not None:
            inputs = _inputs(kind, paths, root, files)
            key = source_key(kind, paths, text_field, tok, root, limit, inputs)
            ckey = config_key(kind, paths, text_field, tok, root, limit)
        else:
            key = "(tokenizer not here)"
    except UnreadableSource as err:
        if here:
            raise UnreadableSource(f"{field} ({name}): {err}") from err
        groups, ranges, key = [], [], "(files not here)"
    return SourcePlan(field, name, kind, text_field, key, str(cache / key), [g for g, _ in groups],
                      [b for _, b in groups], tokens,
                      pointer=str(pointer_path(cache, ckey)) if ckey else "", inputs=inputs,
                      group_records=ranges)


def pointer_path(cache: Path, ckey: str) -> Path:
    return cache / "by-config" / f"{ckey}.json"


def plan(cfg, here: bool = True) -> Plan:
    """The preparation plan of `cfg` (its eval subsets applied), tasks assigned."""
    cfg = with_eval_subsets(cfg, here)
    try:
        tok = load_tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError):
        if here:
            raise
        tok = None
    root, cache = mixture.data_root(cfg), cache_dir(cfg)
    p = Plan(cfg.data.tokenizer, cfg.data.shard_tokens, cfg.data.max_bad_fraction,
             [source_plan(cfg, e, tok, root, cache, here) for e in _entries(cfg)])
    prepare_tasks.assign(p, task_count(cfg, p))
    return p


def task_count(cfg, p: Plan) -> int:
    if cfg.data.prepare_tasks:
        return cfg.data.prepare_tasks
    if cfg.hardware.launcher == "slurm":
        return min(len(p.units), prepare_tasks.AUTO_SLURM_TASKS)
    return os.cpu_count() or 1


def _open_all(p: Plan) -> list[ShardedSource]:
    """Every source of `p` (all indexed), its pointer (re)written: the config now names this cache."""
    opened = [ShardedSource.open(s.name, Path(s.dir)) for s in p.sources]
    for s, src in zip(p.sources, opened):
        prepare_tasks.write_pointer(s, src.index)
    return opened


def open_prepared(cfg, tok) -> tuple[list[Shard | None], dict[str, Shard]] | None:
    """What `prepare(cfg)` returns, found through each source's pointer (`config_key`) without
    globbing or reading an input file; None when a source has no pointer or its pointer and index
    disagree (the caller then plans from the inputs). The cache a pointer names is one whole
    preparation (content-keyed, indexed last): changed inputs make a new cache and move the pointer,
    so an opened source is never a mix of old and new input."""
    cfg = with_eval_subsets(cfg)
    root, cache, limit = mixture.data_root(cfg), cache_dir(cfg), cfg.data.shard_tokens
    opened = []
    for field, name, kind, paths, text_field, _ in _entries(cfg):
        try:
            pointer = json.loads(pointer_path(cache, config_key(kind, paths, text_field, tok, root, limit)).read_text())
            src = ShardedSource.open(name, Path(pointer["dir"]))
        except (OSError, ValueError, KeyError):
            return None
        if (src.index.get("key"), src.index.get("inputs")) != (pointer["key"], pointer["inputs"]):
            log.warning("%s (%s): its pointer and its index disagree: planning from the input files", field, name)
            return None
        opened.append(src)
    it = iter(opened)
    shards = [next(it) if any(w > 0 for w in s.weights) else None for s in mixture.sources(cfg)]
    return shards, {e.name: next(it) for e in cfg.data.eval_sets}


BAR_DELAY_S = 1.0  # a tokenizing bar appears once a source has taken this long


def prepare_plan(p: Plan, progress: bool = True) -> None:
    """Every source of `p` not indexed yet, tokenized in this process (the loader's path)."""
    from tqdm import tqdm

    tok = None
    for s, source in enumerate(p.sources):
        if read_index(Path(source.dir)) is not None:
            continue
        tok = tok or load_tokenizer(p.tokenizer)
        # delay: drawn from BAR_DELAY_S on, so neither an empty `0.00tok` line before the first batch
        # nor a bar for a source tokenized in a moment
        with tqdm(desc=f"tokenizing {source.name}", unit="tok", unit_scale=True, disable=not progress,
                  file=sys.stderr, mininterval=0.5, delay=BAR_DELAY_S) as bar:
            for g in range(len(source.groups)):
                try:
                    prepare_tasks.run_group(p, s, g, tok, bar.update)
                except UnreadableSource as err:
                    raise type(err)(f"{source.field} ({source.name}): {err}") from err
        prepare_tasks.finalize(p, s)


def prepare(cfg, progress: bool = True) -> tuple[list[Shard | None], dict[str, Shard]]:
    """Prepared sources of every source (None for one with zero weight in every phase) and eval set.

    Raises `UnreadableSource` naming the config field of a source that cannot be used."""
    cfg = with_eval_subsets(cfg)
    p = plan(cfg)
    prepare_plan(p, progress)
    opened = iter(_open_all(p))
    shards = [next(opened) if any(w > 0 for w in s.weights) else None for s in mixture.sources(cfg)]
    evals = {e.name: next(opened) for e in cfg.data.eval_sets}
    return shards, evals


def pool_start_method() -> str:
    """How the pool's workers start: forked (they inherit the imports: no start cost, which is a
    fifth of preparing the built-in corpus) unless this process runs JAX, whose threads a fork
    would copy mid-lock; then spawned. (The tokenizer's own thread pool is safe either way: the
    `tokenizers` library turns its parallelism off in a forked child if the parent had used it.)"""
    return "spawn" if "jax" in sys.modules or sys.platform != "linux" else "fork"


def run_pool(p: Plan, progress: bool = True) -> None:
    """The plan's tasks in a process pool (a worker per task, at most the CPUs here), with a bar of
    the groups done; then every index is checked (each task wrote those of the sources it completed)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    todo = range(len(p.tasks))
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with tqdm(total=len(p.units), desc="preparing", unit="group", disable=not progress, file=sys.stderr) as bar:
        if workers == 1:
            for t in todo:
                prepare_tasks.run_task(p, t)
                bar.update(len(p.tasks[t]))
        else:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(pool_start_method())) as pool:
                futures = {pool.submit(prepare_tasks.run_task, p, t): t for t in todo}
                for f in as_completed(futures):
                    f.result()
                    bar.update(len(p.tasks[futures[f]]))
    for s in range(len(p.sources)):
        prepare_tasks.finalize(p, s)


def estimate_tokens(source: SourcePlan, tok) -> tuple[float | None, str]:
    """A source's tokens, and how they were found: its configured `tokens`; else its records from
    the first file on, tokenized up to `SAMPLE_CHARS` (all of a smaller source: exact; a built-in
    source: all of it), scaled by its bytes on disk (compressed files: a lower bound)."""
    if source.tokens:
        return float(source.tokens), "configured"
    if tok is None or not source.groups:
        return None, "unknown"
    texts, chars = [], 0
    for rec in records(source.kind, source.inputs_in_order, source.text_field):
        if chars >= SAMPLE_CHARS and source.kind != "builtin":
            break
        if rec.text is not None:
            texts.append(rec.text)
            chars += len(rec.text.encode())
    else:
        return float(_tokens(tok, texts)), "all of it"
    return _tokens(tok, texts) / chars * sum(source.group_bytes), f"sample of {chars:,} bytes"


def _tokens(tok, texts) -> int:
    return sum(len(ids) + (tok.eos_id is not None) for ids in tok.encode_batch(texts))


def describe(p: Plan, cfg, out=None) -> None:
    """The plan, as a dry run prints it (to `out`, default stdout)."""
    out = out or sys.stdout
    try:
        tok = load_tokenizer(p.tokenizer)
    except (OSError, ValueError):
        tok = None
    rate, rate_from = derive.tokenize_rate(cfg.data.tokens_per_core_s)
    cpus = cfg.hardware.cpus_per_task
    total_tokens, total_shards = 0.0, 0
    print(f"{'source':<24} {'files':>7} {'bytes':>16} {'est. tokens':>18} {'shards':>7}  estimate", file=out)
    for s in p.sources:
        tokens, how = estimate_tokens(s, tok)
        n = prepare_tasks.estimated_shards(s, tokens, p.shard_tokens)
        files = f"{len(s.files):,}" if s.groups and s.kind != "builtin" else "-"
        total_tokens += tokens or 0
        total_shards += n
        shown = f"{tokens:,.0f}" if tokens is not None else "?"
        print(f"{s.name:<24} {files:>7} {sum(s.group_bytes):>16,} {shown:>18} {n:>7,}  {how}", file=out)
    tasks = len(p.tasks) or (cfg.data.prepare_tasks or min(total_shards, prepare_tasks.AUTO_SLURM_TASKS))
    where = "a Slurm array" if cfg.hardware.launcher == "slurm" else "a local process pool"
    cores = tasks * (cpus if cfg.hardware.launcher == "slurm" else 1)
    hours = derive.preparation_hours(total_tokens, rate, cores)
    print(f"total: {len(p.sources)} sources, {total_tokens:,.0f} tokens (est.), {total_shards:,} shards of ≤ "
          f"{p.shard_tokens:,} tokens, {len(p.units):,} file groups", file=out)
    print(f"run: {tasks:,} tasks on {where}, {cores:,} cores at {rate:,.0f} tokens/s per core "
          f"(data.tokens_per_core_s, {rate_from}): {derive.preparation_hours(total_tokens, rate, 1):,.1f} "
          f"core-hours, {hours:,.2f} hours", file=out)
    print(f"cache: {cache_dir(cfg)}", file=out)


def run(composed, submit=None) -> int:
    """Validate a composed config, plan and prepare its data; the exit status. `submit(cfg, plan)`
    runs the plan on a Slurm hardware (the launch layer's job array) and returns whether every
    source is now indexed (False: the array runs on, nothing to print yet)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        _, cfg = load(composed, (mixture.check,), memory=offload_estimate)  # the data checks; the others are a launch's
    except ConfigError as err:
        print("\n".join(f"error: {n}: {m}" for n, m in err.problems), file=sys.stderr)
        return 2
    dry = bool(cfg.dry_run)
    try:
        p = plan(cfg, here=not dry)
        if dry:
            describe(p, cfg)
            return 0
        if cfg.hardware.launcher == "slurm":
            if submit is None:
                print(f"error: hardware={cfg.hardware.name} submits a Slurm array: run python -m marin.data.prepare "
                      "(or marin.launch.prepare), not this function without `submit`", file=sys.stderr)
                return 2
            if not submit(cfg, p):
                return 0
        else:
            run_pool(p)
        cfg = with_eval_subsets(cfg)
        opened = {s.name: s for s in _open_all(p)}
    except UnreadableSource as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    epochs = mixture.epochs_per_source(cfg, {n: s.num_tokens for n, s in opened.items()})
    print(f"{'source':<28} {'documents':>10} {'corrupt':>8} {'tokens':>14} {'shards':>6} {'epochs':>7}  cache")
    for name, s in opened.items():
        e = f"{sum(epochs[name]):.2f}" if name in epochs else "eval"
        print(f"{name:<28} {s.documents:>10,} {s.corrupt:>8,} {s.num_tokens:>14,} {len(s.shard_ids):>6} {e:>7}  {s.path}")
    return 0


def main(argv: list[str] | None = None, submit=None) -> int:
    """The Hydra app on `argv` (default: the command line); returns the exit status. Hydra's
    own composition errors (an unknown option or key) exit as they do for `launch.py`. `submit`:
    see `run` (`marin.launch.prepare` passes the Slurm array's)."""
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

        status["code"] = run(name_options(cfg, HydraConfig.get().runtime.choices), submit)

    if "--help" in argv or "-h" in argv:  # Hydra's help, headed by what this app does
        argv = [*argv, "hydra.help.header='usage: python -m marin.data.prepare [group=option ...] [key=value ...]"
                "    tokenize the mixture of a config "
                "(the same overrides as launch.py) into the sharded cache training reads: a local process pool, "
                "or a Slurm job array (hardware.launcher slurm); dry_run=true prints the plan only'"]
    saved = sys.argv
    sys.argv = ["python -m marin.data.prepare", *argv]  # Hydra reads its arguments from here
    try:
        app()
    finally:
        sys.argv = saved
    return status["code"]


def with_eval_subsets(cfg, here: bool = True):
    """`cfg` with each `subsets` eval set replaced by its subsets (`documents.eval_subsets`); the same
    `cfg` when none has them. `here=False` (a dry run's plan) keeps a set whose files are not on
    this machine (a site's Paloma copy) whole."""
    if not any(getattr(e, "subsets", False) for e in cfg.data.eval_sets):
        return cfg
    root = mixture.data_root(cfg)

    def subsets(e):
        try:
            return eval_subsets(e, root)
        except UnreadableSource:
            if here:
                raise
            return [e]

    sets = [s for e in cfg.data.eval_sets for s in subsets(e)]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_sets=sets))


if __name__ == "__main__":
    # The command runs at the tool layer, which adds Slurm submission (marin.launch.prepare);
    # run as a program, not imported, so this data module depends on nothing above it.
    import runpy

    runpy.run_module("marin.launch.prepare", run_name="__main__", alter_sys=True)
