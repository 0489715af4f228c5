"""Small mixtures for the data tests: files written under a test's tmp_path, configs built on the
composed default (model=tiny) with `data` replaced, validated by `marin.config.validate.load`."""
from __future__ import annotations

import json
from pathlib import Path

from marin.config.schema import DataConfig, EvalSetConfig, SourceConfig
from marin.config.validate import to_config
from marin.launch.checks import load
from tests.helpers import compose_dict


def write_jsonl(path: Path, texts, corrupt_at=()) -> Path:
    lines = [json.dumps({"text": t}) for t in texts]
    for i in corrupt_at:
        lines.insert(i, '{"text": "unterminated')
    path.write_text("\n".join(lines) + "\n")
    return path


def composed(tmp_path: Path, sources: list[dict], eval_sets=(), boundaries=(), names=None,
             overrides=(), **data):
    """The composed `Config` (with `auto` leaves) of a test mixture; `load` it to validate."""
    cfg = to_config(compose_dict("model=tiny", "train.steps=20", "train.seq_len=32",
                                 "train.global_batch=8", "train.eval_batches=2", *overrides))
    phases = len(boundaries) + 1
    cfg.data = DataConfig(
        name="test", root=str(tmp_path), cache_dir=str(tmp_path / "cache"),
        sources=[SourceConfig(**s) for s in sources], eval_sets=[EvalSetConfig(**e) for e in eval_sets],
        phase_boundaries=list(boundaries), phase_names=names or [f"p{i}" for i in range(phases)], **data)
    return cfg


def resolved(tmp_path: Path, sources: list[dict], **kw):
    return load(composed(tmp_path, sources, **kw))[1]
