"""A small byte-level BPE tokenizer trained on the built-in text: the suite's and the benchmarks'
real tokenizer (the hero's stays a site file, `tokenizer.json` of 128,256 ids).

Byte-level: every UTF-8 byte is an id before any merge, so any text encodes (no unknown token)
and decoding gives its bytes back (bits per byte counts them). Trained with the `tokenizers`
library on `marin.data.builtin` (nothing downloaded); its ids fit `model.vocab_size=512`
(model=tiny / micro). Training takes seconds, so `cached` keeps one file per (built-in text,
library version, vocabulary) and reuses it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from marin.data import builtin

VOCAB = 512  # 256 bytes, the end-of-document token, 255 merges
EOS = "<|endoftext|>"  # one of tokenizers.EOS_NAMES: the JsonTokenizer appends it after documents
SOURCES = ("pydoc_data", "stdlib")


def key(vocab_size: int = VOCAB) -> str:
    """What the trained file depends on: the built-in text, the library, the vocabulary."""
    import tokenizers

    blob = "|".join([*(builtin.fingerprint(s) for s in SOURCES), tokenizers.__version__, str(vocab_size)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train(path: Path, vocab_size: int = VOCAB) -> Path:
    """Train on the built-in training text and save `path` (tokenizer.json); returns `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (doc for s in SOURCES for doc in builtin.documents(s))
    tok.train_from_iterator(texts, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tok.save(str(tmp))
    tmp.replace(path)  # atomic: a concurrent reader sees no file or a whole one
    return path


def cached(folder: Path, vocab_size: int = VOCAB) -> Path:
    """`<folder>/bpe-<key>/tokenizer.json`, trained first if absent."""
    path = Path(folder) / f"bpe-{key(vocab_size)}" / "tokenizer.json"
    return path if path.is_file() else train(path, vocab_size)
