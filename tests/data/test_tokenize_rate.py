"""`data.tokens_per_core_s: auto` reads the rate benchmarks/tokenizer_rate.py measured (issue 41)."""
from __future__ import annotations

import json

from marin.config import derive
from marin.config.store import compose
from marin.config.validate import load
from marin.data import prepare


def test_auto_reads_the_measured_rate_else_the_stated_default(tmp_path):
    bench = tmp_path / "tokenize.json"
    rate, how = derive.tokenize_rate("auto", bench)
    assert rate == derive.DEFAULT_TOKENS_PER_CORE_S and how.startswith("default")
    bench.write_text(json.dumps({"tokens_per_core_s": 2_345_678, "tokenizer_path": "/x/tokenizer.json",
                                 "measured": "2026-12-04T19:00:00Z"}))
    rate, how = derive.tokenize_rate("auto", bench)
    assert rate == 2_345_678 and str(bench) in how and "/x/tokenizer.json" in how
    assert derive.tokenize_rate(5e5, bench) == (5e5, "data.tokens_per_core_s")   # a configured figure wins
    assert derive.tokenize_rate(2_345_678.0, bench).source == how   # the resolved auto: still said measured
    bench.write_text("{not json")
    assert derive.tokenize_rate("auto", bench).tokens_per_core_s == derive.DEFAULT_TOKENS_PER_CORE_S


def test_the_plan_uses_and_names_the_measured_rate(tmp_path, monkeypatch, capsys):
    bench = tmp_path / "tokenize.json"
    bench.write_text(json.dumps({"tokens_per_core_s": 3_000_000}))
    monkeypatch.setattr(derive, "TOKENIZE_BENCH", bench)
    cfg = load(compose(["data=builtin", "model=micro", f"data.cache_dir={tmp_path}/c", f"run.out_dir={tmp_path}"]))[1]
    assert cfg.data.tokens_per_core_s == 3_000_000   # auto, resolved
    prepare.describe(prepare.plan(cfg, here=False), cfg)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("run:"))
    assert "3,000,000 tokens/s per core" in line and f"measured: {bench}" in line, line
