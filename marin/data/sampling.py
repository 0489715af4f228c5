"""Epoch-exact sampling (`data.sampling=epoch`): which source each row reads, and where.

Two pure functions of the step, so a batch needs no state carried between steps:

**Rows per source.** In a phase with weights w, step m of the phase lays the B rows of the global
batch as points r·M + θ(m) (r = 0 … B−1) on the integer line [0, M·B), which the sources split into
intervals [Y[s−1], Y[s]) with Y[s] = ⌈M·B·(w₀+…+w_s)⌉. Source s gets the points in its interval:
⌊B·w_s⌋ or ⌈B·w_s⌉ rows. The offset θ(m) = (a·m + β) mod M steps by a golden-ratio fraction of M,
so the counts average to B·w_s with a discrepancy of a few rows over any span of steps, and the
rows a source drew before step m have a closed form (`floor_sum`, Euclid-like, O(log M)).

**Where they read.** Each source's token stream (documents back to back) is cut into K = ⌈N/T⌉
chunks of T tokens (T = seq_len; a row reads its chunk plus the next token, its last target).
Epoch e reads all K chunks in a seeded pseudo-random order (`permute`, a Feistel bijection, so no
permutation table is held: cells of billions of tokens cost no memory) from a seeded start offset
in the circular stream (so chunk edges move between epochs). The j-th row a source ever draws reads
chunk j mod K of epoch j // K: a source drawn e < 1 epochs has shown a fraction e of its tokens,
each once; e ≥ 1 has shown whole epochs, each in a new order (≤ T tokens of the wrap overlap).
"""
from __future__ import annotations

import zlib

import numpy as np

M = 1 << 24  # positions per row: weights resolve to 1 / (M·B)
A = 9_548_893  # ≈ M·(√5 − 1)/2, odd (coprime with M): θ(m) visits every residue
ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ROUND_KEYS = np.arange(1, ROUNDS + 1, dtype=np.uint64) * _GOLDEN  # arrays wrap silently


def mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective, well-mixed uint64 → uint64 (arrays: wraps silently)."""
    x = np.asarray(x, np.uint64)
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def key(seed: int, *parts) -> np.ndarray:
    """uint64 hash of (seed, parts...): broadcast over array parts."""
    h = mix(np.asarray([seed & (2**64 - 1)], np.uint64))
    for p in parts:
        h = mix(h + np.asarray(p, np.uint64) * np.asarray([_GOLDEN], np.uint64))
    return h


def name_id(name: str) -> int:
    """A stable id of a source: adding or reordering sources does not reshuffle the others."""
    return zlib.crc32(name.encode())


# ----------------------------------------------------------------------------- rows per source

def boundaries(weights, rows: int) -> np.ndarray:
    """int64 [S+1] interval edges Y on [0, M·rows) of one phase's weights (Y[0]=0, Y[-1]=M·rows)."""
    w = np.asarray(weights, np.float64)
    edges = np.minimum(np.ceil(np.cumsum(w) / w.sum() * (M * rows)).astype(np.int64), M * rows)
    edges[-1] = M * rows  # a zero weight adds nothing to the sum: its interval stays empty
    return np.concatenate([[0], edges])


def theta(m, beta: int):
    return (A * np.asarray(m, np.int64) + beta) % M


def points_below(edges: np.ndarray, th) -> np.ndarray:
    """Rows r ≥ 0 with r·M + θ < edge: ⌈(edge − θ)/M⌉, for each edge (θ < M, edges ≥ 0)."""
    return -((th - edges) // M)


def floor_sum(n: int, m: int, a: int, b: np.ndarray) -> np.ndarray:
    """Σ_{i<n} ⌊(a·i + b)/m⌋ for each b (int64 array, any sign); 0 ≤ a, m ≥ 1. AtCoder's algorithm.

    (m, a) follow Euclid's sequence whatever b is, so the loop runs in lockstep over b; a finished
    element has n = 0 and adds nothing."""
    b = np.asarray(b, np.int64)
    n = np.full(b.shape, n, np.int64)
    q = b // m
    total = n * q
    b = b - q * m
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        total += n * (b // m)
        b %= m
        y = a * n + b
        n, b = y // m, y % m
        if not n.any():
            break
        m, a = a, m
    return total


def rows_before(edges: np.ndarray, m: int, beta: int) -> np.ndarray:
    """int64 [S]: rows each source drew in steps [0, m) of a phase (closed form).

    Σ_{i<m} ⌈(Y − θ(i))/M⌉ with θ(i) = (A·i + β) mod M equals Σ ⌊(A·i + β)/M⌋ − Σ ⌊(A·i + β − Y)/M⌋;
    the first sum cancels between a source's two edges."""
    below = -floor_sum(m, M, A, beta - edges)
    return np.diff(below)


# ----------------------------------------------------------------------------- where rows read

def permute(index: np.ndarray, size: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, size), applied to `index` (int64); `size` and `keys` (uint64) are
    per element (broadcast), so rows of many sources go in one call.

    A balanced Feistel network on the smallest even power of two ≥ size, cycle-walked (re-applied
    while the value falls outside [0, size)): O(1) memory, vectorised."""
    index = np.asarray(index, np.int64)
    size = np.broadcast_to(np.asarray(size, np.int64), index.shape)
    bits = np.frexp(np.maximum(size - 1, 0).astype(np.float64))[1]  # (size − 1).bit_length(), size < 2^53
    half = np.maximum(1, (bits + 1) // 2).astype(np.uint64)
    mask = (np.uint64(1) << half) - np.uint64(1)
    keys = np.broadcast_to(np.asarray(keys, np.uint64), index.shape)
    out, limit = index.astype(np.uint64), size.astype(np.uint64)
    todo = np.arange(out.size)
    while todo.size:
        x, k, h, m = out[todo], keys[todo], half[todo], mask[todo]
        left, right = x >> h, x & m
        for r in _ROUND_KEYS:  # round function: a multiply-xorshift, enough to shuffle chunks
            f = (right + k + r) * _M1
            left, right = right, left ^ ((f ^ (f >> _S31)) & m)
        out[todo] = (left << h) | right
        todo = todo[out[todo] >= limit[todo]]
    return out.astype(np.int64)
