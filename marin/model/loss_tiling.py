"""How the fused head + cross-entropy (marin/model/loss.py) tiles its work; pure Python, so the
memory plan (marin/model/accounting.py) sizes the same tiles without importing JAX."""
from __future__ import annotations

import math

# Tokens per row chunk on one device. With VOCAB_TILE this bounds the fp32 tile [rows, cols]
# (8192 × 16384 × 4 B = 512 MiB) while each GEMM stays large enough to run at full rate.
ROW_TOKENS = 8192
# Columns per vocabulary tile: 128,256 → 8 tiles of 16,128. A multiple of TILE_ALIGN, so that
# every tile but possibly the last is all real columns (the online max never meets a tile of
# padding only).
VOCAB_TILE = 16384
TILE_ALIGN = 128   # tile widths are rounded up to this (tensor-core friendly GEMM shapes)


def vocab_tiling(vocab: int, tile: int | None = None) -> tuple[int, int]:
    """(tiles, columns per tile) covering `vocab`: one exact tile when it fits, else equal tiles
    of at most `tile` (default VOCAB_TILE) columns rounded up to TILE_ALIGN (the excess is zero
    padding, masked)."""
    tile = tile or VOCAB_TILE
    if vocab <= tile:
        return 1, vocab
    assert tile % TILE_ALIGN == 0, f"a vocabulary tile of {tile} is not a multiple of {TILE_ALIGN}"
    n = math.ceil(vocab / tile)
    return n, math.ceil(math.ceil(vocab / n) / TILE_ALIGN) * TILE_ALIGN


def row_chunks(batch: int, seq: int, batch_shards: int = 1, tokens: int | None = None) -> int:
    """How many chunks the sequence axis is cut into: the fewest (a divisor of `seq`) whose
    chunk holds at most `tokens` (default ROW_TOKENS) tokens on one device (batch / batch_shards
    rows); every position its own chunk when even that is more."""
    tokens = tokens or ROW_TOKENS
    rows = max(1, batch // batch_shards)
    return next(n for n in range(1, seq + 1) if seq % n == 0 and (rows * seq // n <= tokens or n == seq))
