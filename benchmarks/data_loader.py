"""Loader speed against the default run's token consumption, measured in one run.

    python benchmarks/data_loader.py [overrides ...] [--steps 200] [--train-steps 10]

1. Builds the `Loader` of the composed config (default: the built-in mixture; the cache is
   prepared first and not timed) and times `batch(step)` over --steps consecutive steps:
   loader tokens/s = steps × global_batch × seq_len / time (one process, all rows).
2. Times --train-steps jitted train steps of the same config (compiled first, not timed) with
   `marin.train.step.make_train_step`: consumption tokens/s = tokens per step / step time.
3. Prints the ratio. Target: loader ≥ 20× the step's consumption on the default run.

If the training code cannot be imported, step 2 is skipped and the consumption to beat is
printed as a formula of the step time.

    python benchmarks/data_loader.py start [--sources 200] [--shards 1000] [--documents 1e8] [--scales 1 0.1]

Start at the hero's scale (issue 41 item 3): a synthetic prepared corpus of --sources sources ×
--shards shards holding --documents documents per source (each source's index is real; its shard
folders are links to one template shard: a sparse tokens.bin and a real offsets.npy), built once
under outputs/bench/. A fresh process composes the hero (experiment=mochi_535b_a23b, the byte
tokenizer: the ids do not matter), opens every source and builds process 0's `Loader` (of
nodes × tasks_per_node processes), then reads its first batch. Printed per scale (shards per
source × scale): seconds to the first batch, from the process's start, and its peak RSS.
Targets: ≤ 2 s and ≤ 500 MB at every scale (start does not grow with the corpus). The opened
sources are handed to the Loader (`prepared=`); --input-files N also starts a Loader given nothing,
over N empty input files a cell and each cell's config pointer to its prepared source (as
`python -m marin.data.prepare` leaves them): it opens them without reading an input file
(`data.verify_inputs` auto, off for many processes). Last it times what verifying would add
(`marin.data.prepare.plan`: a glob and a stat of every input file).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 20.0
START_SECONDS, START_RSS_MB = 2.0, 500  # issue 41 item 3: whatever the corpus size
CORPUS = Path(__file__).resolve().parents[1] / "outputs" / "bench" / "loader-corpus"
HERO = ["experiment=mochi_535b_a23b", "data.tokenizer=byte"]


def compose(overrides: list[str]):
    from marin.config.store import compose as compose_config
    from marin.launch.checks import load

    return load(compose_config(overrides))[1]


def loader_rate(cfg, steps: int) -> tuple[float, float]:
    """(tokens/s, median seconds per batch) of Loader.batch over consecutive steps."""
    from marin.data.loader import Loader

    loader = Loader(cfg)
    loader.batch(0)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        loader.batch(step % cfg.train.steps)
        times.append(time.perf_counter() - start)
    tokens = steps * cfg.train.global_batch * cfg.train.seq_len
    return tokens / sum(times), statistics.median(times)


def step_time(cfg, steps: int) -> float:
    """Median seconds of one jitted train step of `cfg` (after compilation)."""
    import jax

    from marin.data.loader import Loader
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import batch_sharding, init_state, state_sharding
    from marin.train.step import make_train_step

    mesh = make_mesh(cfg)
    tx = build_optimizer(cfg)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    shardings = state_sharding(cfg, abstract, mesh)
    spec = batch_sharding(mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: init_state(cfg, tx, k), out_shardings=shardings)(jax.random.key(0))
    step = jax.jit(make_train_step(cfg, tx, mesh), in_shardings=(shardings, spec),
                   out_shardings=(shardings, None), donate_argnums=0)
    loader = Loader(cfg, progress=False)
    keys = ("inputs", "targets", "segment_ids", "loss_mask")
    batches = [{k: jax.device_put(v, spec) for k, v in loader.batch(s).items() if k in keys}
               for s in range(steps + 1)]
    state, metrics = step(state, batches[0])
    jax.block_until_ready(metrics)
    times = []
    for batch in batches[1:]:
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py")
    parser.add_argument("--steps", type=int, default=200, help="loader batches timed")
    parser.add_argument("--train-steps", type=int, default=10, help="train steps timed")
    args = parser.parse_args(argv)
    cfg = compose(args.overrides)
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    rate, per_batch = loader_rate(cfg, args.steps)
    print(f"loader: {rate:,.0f} tokens/s ({per_batch * 1e3:.2f} ms per batch of "
          f"{cfg.train.global_batch} × {cfg.train.seq_len} = {tokens_per_step:,} tokens)")
    try:
        seconds = step_time(cfg, args.train_steps)
    except ImportError as err:
        print(f"train step: not measured ({err}); the loader keeps up with any step slower than "
              f"{TARGET:g} × {per_batch * 1e3:.2f} ms = {TARGET * per_batch * 1e3:.1f} ms")
        return 0
    consumption = tokens_per_step / seconds
    ratio = rate / consumption
    print(f"train step: {seconds * 1e3:.1f} ms → consumes {consumption:,.0f} tokens/s "
          f"(model={cfg.model.name}, {cfg.hardware.name})")
    print(f"ratio loader / consumption: {ratio:,.1f}× (target ≥ {TARGET:g}×): "
          f"{'OK' if ratio >= TARGET else 'TOO SLOW'}")
    return 0 if ratio >= TARGET else 1


def synthetic_corpus(names: list[str], shards: int, documents: int, doc_tokens: int) -> Path:
    """The corpus folder (built on first use): per source an index of `shards` shards, each a link
    to one template shard of documents / shards documents of `doc_tokens` tokens."""
    import numpy as np

    from marin.data import shards as fmt

    per = documents // shards
    root = CORPUS / f"v{fmt.FORMAT}-{len(names)}x{shards}x{documents}x{doc_tokens}"
    if (root / "done").is_file():
        return root
    template = root / "template"
    template.mkdir(parents=True, exist_ok=True)
    with open(template / fmt.TOKENS, "wb") as f:
        f.truncate(per * doc_tokens * 2)  # sparse: uint16 zeros, no disk blocks
    np.save(template / fmt.OFFSETS, np.arange(per + 1, dtype=np.int64) * doc_tokens)
    manifest = {"format": fmt.FORMAT, "dtype": "uint16", "tokens": per * doc_tokens, "documents": per}
    for name in names:
        folder = root / "sources" / name
        folder.mkdir(parents=True, exist_ok=True)
        ids = [fmt.shard_id(k, 0) for k in range(shards)]
        for sid in ids:
            if not (folder / sid).exists():
                (folder / sid).symlink_to("../../template", target_is_directory=True)  # short: kept in the inode
        fmt.write_index(folder, name, [{**manifest, "shard": sid} for sid in ids],
                        {"corrupt": 0, "key": f"synthetic-{name}", "inputs": "synthetic"})
    (root / "done").write_text("")
    return root


def start_child(root: str, inputs: str = "") -> int:
    """In a fresh process: compose the hero, open the corpus, build the Loader, read a batch. With
    `inputs` (a folder of input files and config pointers to the corpus: `input_tree`), the Loader
    is given nothing and opens the sources itself, as a training process does."""
    import json
    import resource

    begin = time.perf_counter()
    from marin.config.store import compose as compose_config
    from marin.config.validate import load
    from marin.data import mixture
    from marin.data.loader import Loader
    from marin.data.shards import ShardedSource
    from marin.model.accounting import offload_estimate

    extra = [f"data.root={inputs}", f"data.cache_dir={inputs}/cache"] if inputs else []
    cfg = load(compose_config([*HERO, *extra]), memory=offload_estimate)[1]
    composed = time.perf_counter()
    processes = cfg.hardware.nodes * cfg.hardware.tasks_per_node
    if inputs:
        prepared = None
    else:
        prepared = ([ShardedSource.open(s.name, Path(root) / "sources" / s.name) if any(w > 0 for w in s.weights)
                     else None for s in mixture.sources(cfg)], {})
    opened = time.perf_counter()
    loader = Loader(cfg, 0, processes, progress=False, prepared=prepared)
    batch = loader.batch(0)
    done = time.perf_counter()
    print(json.dumps({"compose_s": composed - begin, "open_s": opened - composed, "loader_s": done - opened,
                      "rows": int(batch["inputs"].shape[0]), "seq_len": cfg.train.seq_len, "processes": processes,
                      "shards_opened": sum(len(s._open) for s in loader.shards if s),
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    return 0


def input_tree(tmp: Path, root: Path, files: int) -> None:
    """Under `tmp`: `files` empty input files a cell (the hero's `cells/<cell>/*.parquet`) and, in
    `tmp/cache`, each cell's config pointer (`marin.data.prepare.config_key`) to its synthetic
    prepared source under `root`: what `python -m marin.data.prepare` leaves for training."""
    import json

    from marin.config.store import compose as compose_config
    from marin.config.validate import load
    from marin.data import mixture, prepare
    from marin.data.tokenizers import load_tokenizer
    from marin.model.accounting import offload_estimate

    cfg = load(compose_config([*HERO, f"data.root={tmp}", f"data.cache_dir={tmp}/cache"]), memory=offload_estimate)[1]
    tok = load_tokenizer(cfg.data.tokenizer)
    for source in mixture.sources(cfg):
        folder = tmp / "cells" / source.name
        folder.mkdir(parents=True)
        for i in range(files):
            (folder / f"part-{i:05d}.parquet").touch()
        key = prepare.config_key(source.kind, source.paths, source.text_field, tok, tmp, cfg.data.shard_tokens)
        pointer = prepare.pointer_path(tmp / "cache", key)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.write_text(json.dumps({"key": f"synthetic-{source.name}", "inputs": "synthetic", "name": source.name,
                                       "dir": str(root / "sources" / source.name)}))


def start(argv) -> int:
    import json
    import subprocess

    parser = argparse.ArgumentParser(description="loader start on a synthetic corpus at the hero's scale")
    parser.add_argument("--sources", type=int, default=200)
    parser.add_argument("--shards", type=int, default=1000, help="shards per source at scale 1")
    parser.add_argument("--documents", type=float, default=1e8, help="documents per source at scale 1")
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--input-files", type=int, nargs="*", default=[],
                        help="also time what training's `prepare(cfg)` does before it opens the sources: "
                             "plan from this many (empty) input files a cell")
    args = parser.parse_args(argv)
    from marin.config.store import compose as compose_config
    from marin.config.validate import load
    from marin.data import mixture
    from marin.model.accounting import offload_estimate

    names = [s.name for s in mixture.sources(load(compose_config(HERO), memory=offload_estimate)[1])][:args.sources]
    ok = True
    for scale in args.scales:
        shards, documents = max(1, round(args.shards * scale)), int(args.documents * scale)
        root = synthetic_corpus(names, shards, documents, args.doc_tokens)
        runs = [("sources opened, handed to the Loader (prepared=)", "")]
        tmps = [tempfile.TemporaryDirectory() for _ in args.input_files]
        for files, tmp in zip(args.input_files, tmps):
            input_tree(Path(tmp.name), root, files)
            runs.append((f"the Loader alone, {files:,} input files a cell ({files * len(names):,}; "
                         "data.verify_inputs auto: not read)", tmp.name))
        for what, inputs in runs:
            began = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "start-child", str(root), inputs],
                                 capture_output=True, text=True)
            wall = time.perf_counter() - began
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                return 1
            r = json.loads(out.stdout.splitlines()[-1])
            good = wall <= START_SECONDS and r["rss_mb"] <= START_RSS_MB
            ok &= good
            print(f"{len(names)} sources × {shards} shards, {documents:,} documents and "
                  f"{documents * args.doc_tokens:,} tokens each, {what}: first batch ({r['rows']} rows × "
                  f"{r['seq_len']}, process 0 of {r['processes']}) {wall:.2f} s after the process started (compose "
                  f"{r['compose_s']:.2f}, open {r['open_s']:.2f}, loader + batch {r['loader_s']:.2f}; "
                  f"{r['shards_opened']} shards mapped), peak RSS {r['rss_mb']:.0f} MB (targets ≤ {START_SECONDS:g} s, "
                  f"≤ {START_RSS_MB} MB): {'OK' if good else 'OVER'}")
        for tmp in tmps:
            tmp.cleanup()
    for files in args.input_files:
        print(plan_time(files))
    return 0 if ok else 1


def plan_time(files: int) -> str:
    """`marin.data.prepare.plan` of the hero over `files` empty input files a cell (a glob and a stat
    of each: what a Loader with data.verify_inputs=true does before it opens the sources)."""
    from marin.config.store import compose as compose_config
    from marin.config.validate import load
    from marin.data import mixture, prepare
    from marin.model.accounting import offload_estimate

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(compose_config([*HERO, f"data.root={tmp}", f"data.cache_dir={tmp}/cache"]),
                   memory=offload_estimate)[1]
        for source in mixture.sources(cfg):
            folder = Path(tmp) / "cells" / source.name
            folder.mkdir(parents=True)
            for i in range(files):
                (folder / f"part-{i:05d}.parquet").touch()
        began = time.perf_counter()
        prepare.plan(cfg)
        seconds = time.perf_counter() - began
    total = files * len(mixture.sources(cfg))
    return (f"prepare.plan over {total:,} input files ({files} a cell): {seconds:.2f} s (what a Loader with "
            "data.verify_inputs=true adds, and python -m marin.data.prepare)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["start"]:
        sys.exit(start(sys.argv[2:]))
    if sys.argv[1:2] == ["start-child"]:
        sys.exit(start_child(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
    sys.exit(main())
