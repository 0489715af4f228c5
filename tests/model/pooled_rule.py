"""A NumPy model of the pooled-wave transport's drop rule (spec §9), and of the rule it replaced,
counted over every sender of an expert-parallel group: what tests/model/test_pooled_rule.py
holds the JAX transport to, and what compares the two rules on the same routing.

    expert_idx [senders, T, k] (token-major rows); both return (send drops, receive drops).
"""
from __future__ import annotations

import math

import numpy as np


def _ranks_within(groups: np.ndarray, num_groups: int) -> np.ndarray:
    """Rank of each entry among the entries of its group, in array order."""
    order = np.argsort(groups, kind="stable")
    counts = np.bincount(groups, minlength=num_groups)
    starts = np.cumsum(counts) - counts
    rank = np.empty_like(groups)
    rank[order] = np.arange(groups.size) - starts[groups[order]]
    return rank


def pooled_drops(expert_idx: np.ndarray, num_experts: int, peers: int, waves: int, send_cap: int,
                 recv_cap: int) -> tuple[int, int]:
    """Spec §9: a destination's assignments ranked in token-major order (t·k + j); rank r in wave
    r % waves, kept at the sender while r // waves < S; each (expert, wave) keeps R rows."""
    local = num_experts // peers
    send, arrived = 0, np.zeros(num_experts * waves, np.int64)
    for idx in expert_idx:
        flat = idx.reshape(-1).astype(np.int64)                  # token-major
        rank = _ranks_within(flat // local, peers)
        sent = rank // waves < send_cap
        send += int(flat.size - sent.sum())
        arrived += np.bincount(flat[sent] * waves + rank[sent] % waves, minlength=num_experts * waves)
    return send, int(np.maximum(arrived - recv_cap, 0).sum())


def _rows8(value: float) -> int:
    return 8 * math.ceil(math.ceil(value) / 8)


def stripe_capacities(tokens: int, top_k: int, num_experts: int, peers: int, waves: int,
                      send_factor: float, recv_factor: float) -> tuple[int, int]:
    """(S, R) of the rule replaced (the project until issue 40): a chunk of S rows per (wave,
    peer), R rows per expert, both multiples of 8."""
    local = num_experts // peers
    stripe = local // waves
    n = tokens * top_k
    send = max(1, min(_rows8(send_factor * n / (waves * peers)), tokens * min(top_k, stripe)))
    return send, max(1, min(_rows8(recv_factor * n / local), peers * min(send, tokens)))


def stripe_drops(expert_idx: np.ndarray, num_experts: int, peers: int, waves: int, send_cap: int,
                 recv_cap: int) -> tuple[int, int]:
    """The replaced rule: wave i carries stripe i (local / waves experts) of every destination;
    a (wave, destination) chunk keeps its first S assignments in choice-major order (every
    token's first choice before any second choice); each expert keeps R rows."""
    local = num_experts // peers
    stripe = local // waves
    send, arrived = 0, np.zeros(num_experts, np.int64)
    for idx in expert_idx:
        flat = idx.T.reshape(-1).astype(np.int64)                # choice-major: a = j·T + t
        group = (flat % local // stripe) * peers + flat // local
        sent = _ranks_within(group, waves * peers) < send_cap
        send += int(flat.size - sent.sum())
        arrived += np.bincount(flat[sent], minlength=num_experts)
    return send, int(np.maximum(arrived - recv_cap, 0).sum())


def sample_routing(rng: np.random.Generator, senders: int, rows: int, seq: int, num_experts: int, top_k: int,
                   skew: float) -> np.ndarray:
    """Routings [senders, rows·seq, k] with per-sequence expert preferences: each sequence (a
    row of `seq` tokens) draws logits skew · N(0, 1) over the experts, and each token takes k
    distinct experts by sampling without replacement from their softmax (as a Gumbel top-k of
    those logits would). skew 0: uniform routing; larger: the document-level imbalance that QB
    cannot remove inside one device's batch."""
    out = np.empty((senders, rows * seq, top_k), np.int16)
    for s in range(senders):
        logits = skew * rng.standard_normal((rows, num_experts))
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
        cdf[:, -1] = 1.0
        flat_cdf = (cdf + np.arange(rows)[:, None]).reshape(-1)     # row r's cdf shifted to [r, r + 1]
        row = np.repeat(np.arange(rows), seq)
        picked = np.empty((rows * seq, top_k), np.int64)
        for j in range(top_k):
            todo = np.arange(rows * seq)
            while todo.size:                                         # redraw a repeat until it is new
                draw = np.searchsorted(flat_cdf, row[todo] + rng.random(todo.size)) - row[todo] * num_experts
                picked[todo, j] = np.minimum(draw, num_experts - 1)
                todo = todo[(picked[todo, :j] == picked[todo, j:j + 1]).any(axis=1)]
        out[s] = picked
    return out
