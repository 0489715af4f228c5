"""Tokenizers: the built-in byte tokenizer (the default; nothing downloaded) and any
`tokenizer.json` through the `tokenizers` library.

Both expose `vocab_size`, `eos_id` (appended after every document; None = none), `fingerprint`
(part of the preparation cache key), `encode_batch(texts) -> list of uint32 arrays` and
`decode(ids) -> str` (for `marin.generate`).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from marin.config.paths import PROJECT_ROOT

BYTE = "byte"
# Names a tokenizer.json commonly gives its end-of-document token, in order of preference.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes are ids 0–255; 256 ends a document, 257 pads (never a target)."""

    vocab_size = 258
    eos_id = 256
    pad_id = 257
    fingerprint = "byte-v1"
    name = BYTE

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids) -> str:
        """Text of byte ids; the end-of-document and pad ids are left out, broken UTF-8 is replaced."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers` format), encoded without special tokens."""

    pad_id = 0  # padded positions carry loss_mask 0 and segment id 0: the id itself is unused

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.eos_id = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
        self.fingerprint = "json-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encoded]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_path(spec: str) -> Path:
    """Where a tokenizer.json named in `data.tokenizer` lives (relative: the project root)."""
    path = Path(spec).expanduser()
    return path if path.is_absolute() else PROJECT_ROOT / path


def load_tokenizer(spec: str) -> ByteTokenizer | JsonTokenizer:
    """`data.tokenizer`: ``byte`` or a path to a tokenizer.json."""
    if spec == BYTE:
        return ByteTokenizer()
    path = tokenizer_path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer: no tokenizer file at {path}")
    try:
        return JsonTokenizer(path)
    except Exception as err:  # the tokenizers library raises its own exception type
        raise ValueError(f"data.tokenizer: {path} is not a readable tokenizer.json ({err})") from err


def token_dtype(vocab_size: int):
    """The smallest unsigned dtype that holds every id (halves the cache for small vocabularies)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


VOCAB_MULTIPLE = 128  # embeddings are padded to a multiple of this (Marin's 128,256 = 1,002 × 128)


def vocab_range(tokenizer_vocab: int) -> tuple[int, int]:
    """The `model.vocab_size` values that fit a tokenizer with this many ids, both ends included:
    at least every id, at most the ids rounded up to a multiple of 128, plus 128 (padding for the
    matmul shapes, and one spare block; more would be unused rows of the embedding and the head,
    a sign the model and the tokenizer are not meant for each other). Byte (258 ids): 258–512;
    Marin's tokenizer (128,256): 128,256–128,384."""
    top = -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE + VOCAB_MULTIPLE
    return tokenizer_vocab, top


def check_vocab(tokenizer, model_vocab_size: int, spec: str, *, refuse_padding: bool = False) -> str | None:
    """A message if the tokenizer's ids do not fit the model's embedding; else None.

    A model vocabulary below the tokenizer's is always refused (ids past the embedding). With
    `refuse_padding` (the launch checks, unless `data.allow_vocab_mismatch`), so is one above
    `vocab_range`'s top."""
    low, high = vocab_range(tokenizer.vocab_size)
    if model_vocab_size < low:
        return (f"data.tokenizer ({spec}) has {tokenizer.vocab_size} ids but model.vocab_size is "
                f"{model_vocab_size}: raise model.vocab_size to at least {tokenizer.vocab_size} "
                "or use a smaller tokenizer")
    if refuse_padding and model_vocab_size > high:
        return (f"data.tokenizer ({spec}) has {tokenizer.vocab_size:,} ids but model.vocab_size is "
                f"{model_vocab_size:,}: it must be {low:,}–{high:,} (the ids rounded up to a multiple of "
                f"{VOCAB_MULTIPLE}, plus {VOCAB_MULTIPLE}); use the model's tokenizer (a path to its "
                "tokenizer.json), fit model.vocab_size, or set data.allow_vocab_mismatch=true")
    return None
