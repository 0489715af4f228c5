"""Tokenizer throughput per core, and preparation against it (issue 41 items 1 and 4; not named
tokenize.py: a script's folder heads sys.path, and the standard library imports `tokenize`).

    python benchmarks/tokenizer_rate.py [--tokenizer PATH] [--cores N] [--prepare] [--out FILE]

1. Encodes the built-in training text (`marin.data.builtin`, ≈ 8 M characters) with batch encoding,
   in fresh processes: the `tokenizers` library's parallelism off (TOKENIZERS_PARALLELISM=false:
   one core) and on (RAYON_NUM_THREADS=N: N cores). tokens/s per core = tokens / seconds / cores.
   The tokenizer: --tokenizer, default the suite's byte-level BPE (`marin.data.bpe`, trained once
   and cached under outputs/cache/tokenizers/).
2. Writes the one-core figure to --out (default outputs/bench/tokenize.json): the preparation
   plan's `data.tokens_per_core_s` (the figure, its tokenizer and how it was measured).
3. --prepare: prepares the built-in mixture (`data=builtin`, this tokenizer, a fresh cache) in
   `marin.data.prepare`'s process pool and prints its tokens/s against the per-core rate × N
   (target: ≥ 80 %, the pipeline adds little to the tokenizer's own cost), and the seconds of the
   whole `python -m marin.data.prepare` command (its start included), and the pool against the
   library's own parallel encoding measured in step 1 (on a shared machine, the cores this run got).
   The built-in text is cut into groups of ≈ 500,000 characters (`marin.data.builtin.ranges`), so
   the pool balances the largest source (≈ 80 % of the tokens) across cores.
Timings on a shared machine vary: run it with the cores to itself.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 0.8
OUT = ROOT / "outputs" / "bench" / "tokenize.json"
TOKENIZERS = ROOT / "outputs" / "cache" / "tokenizers"  # the test suite's cache (tests/conftest.py)
BATCH_CHARS = 4_000_000  # as marin.data.prepare hands text to the tokenizer


def encode_child(path: str) -> None:
    """In a fresh process (the library's thread pool set by the environment): tokens, seconds."""
    from marin.data import builtin
    from marin.data.tokenizers import load_tokenizer

    tok = load_tokenizer(path)
    docs = [d for name in ("pydoc_data", "stdlib") for d in builtin.documents(name)]
    batches, batch, size = [], [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= BATCH_CHARS:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    tok.encode_batch(batches[0][:8])  # warm the library (its thread pool, caches)
    start = time.perf_counter()
    tokens = sum(len(ids) for b in batches for ids in tok.encode_batch(b))
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start,
                      "characters": sum(len(d) for d in docs)}))


def measure(path: Path, cores: int) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true" if cores > 1 else "false",
           "RAYON_NUM_THREADS": str(cores)}
    out = subprocess.run([sys.executable, __file__, "encode-child", str(path)], env=env, capture_output=True,
                         text=True, check=True)
    r = json.loads(out.stdout.splitlines()[-1])
    return {**r, "cores": cores, "tokens_per_s": r["tokens"] / r["seconds"],
            "tokens_per_core_s": r["tokens"] / r["seconds"] / cores}


def prepare_child(path: str, cache: str) -> None:
    """In a fresh process: compose data=builtin with this tokenizer, plan, time the process pool
    (`marin.data.prepare.run_pool`: tokenizing, writing, hashing, indexing)."""
    from marin.config.store import compose
    from marin.data import prepare
    from marin.launch.checks import load

    cfg = load(compose(["data=builtin", "model=micro", f"data.tokenizer={path}", f"data.cache_dir={cache}",
                        f"run.out_dir={cache}"]))[1]
    plan = prepare.plan(cfg)
    start = time.perf_counter()
    prepare.run_pool(plan, progress=False)
    seconds = time.perf_counter() - start
    opened = prepare._open_all(plan)
    print(json.dumps({"tokens": sum(s.num_tokens for s in opened), "seconds": seconds, "tasks": len(plan.tasks),
                      "groups": len(plan.units),
                      "largest": max(s.num_tokens for s in opened) / sum(s.num_tokens for s in opened)}))


def prepare_rate(path: Path, cores: int) -> tuple[dict, float]:
    """(the pool's figures, seconds of the whole `python -m marin.data.prepare data=builtin` command),
    each on a fresh cache."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(cores)}
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, __file__, "prepare-child", str(path), tmp], env=env,
                             capture_output=True, text=True, check=True)
        pool = json.loads(out.stdout.splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "marin.data.prepare", "data=builtin", "model=micro",
                        f"data.tokenizer={path}", f"data.cache_dir={tmp}", f"run.out_dir={tmp}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        command = time.perf_counter() - start
    return pool, command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: the suite's BPE)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prepare", action="store_true", help="also time marin.data.prepare against the rate")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.tokenizer:
        path = Path(args.tokenizer).resolve()
    else:
        from marin.data import bpe

        path = bpe.cached(TOKENIZERS)
    from marin.data.tokenizers import load_tokenizer

    one, many = measure(path, 1), measure(path, args.cores)
    for r, mode in ((one, "parallelism off"), (many, f"parallelism on, {args.cores} threads")):
        print(f"{mode}: {r['tokens']:,} tokens in {r['seconds']:.2f} s = {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['tokens_per_core_s']:,.0f} per core ({r['characters'] / r['tokens']:.2f} characters a token)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "tokens_per_core_s": round(one["tokens_per_core_s"]), "tokenizer": load_tokenizer(str(path)).fingerprint,
        "tokenizer_path": str(path), "parallel_tokens_per_core_s": round(many["tokens_per_core_s"]),
        "parallel_cores": args.cores, "text": "marin.data.builtin pydoc_data + stdlib (train)",
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    print(f"wrote {args.out}: data.tokens_per_core_s={one['tokens_per_core_s']:.0f}")
    if not args.prepare:
        return 0
    pool, command = prepare_rate(path, args.cores)
    ceiling = one["tokens_per_core_s"] * args.cores
    ratio = pool["tokens"] / pool["seconds"] / ceiling
    print(f"prepare: {pool['tokens']:,} tokens; the pool ({pool['tasks']} tasks over {pool['groups']} file groups, "
          f"the largest source {pool['largest']:.0%} of the tokens) {pool['seconds']:.2f} s = "
          f"{pool['tokens'] / pool['seconds']:,.0f} tokens/s, {ratio:.0%} of {one['tokens_per_core_s']:,.0f} per core × "
          f"{args.cores} cores (target ≥ {TARGET:.0%}): {'OK' if ratio >= TARGET else 'BELOW'}; the whole command "
          f"{command:.2f} s ({pool['tokens'] / command / ceiling:.0%}, with its start)")
    # the cores this run actually got: on a shared machine the library's own parallel encoding shows it
    print(f"prepare against the library's own parallel encoding in this run ({many['tokens_per_s']:,.0f} tokens/s "
          f"on {args.cores} threads, {many['tokens_per_s'] / ceiling:.0%} of rate × cores): "
          f"{pool['tokens'] / pool['seconds'] / many['tokens_per_s']:.0%}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare-child"]:
        prepare_child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    if sys.argv[1:2] == ["encode-child"]:
        encode_child(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
