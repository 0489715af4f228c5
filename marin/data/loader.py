"""The step → batch function: packed rows of the mixture, a pure function of (seed, mixture, step).

Each source's token stream is its documents back to back, each ended by the end-of-document id,
read as a circle; a row is seq_len + 1 consecutive tokens of it (inputs and shifted targets).
`data.sampling` says which source each row of the global batch at step N reads, and where:

- ``epoch`` (default, `marin.data.sampling`): each phase's weights give every source ⌊B·w⌋ or
  ⌈B·w⌉ rows per step, so the rows a source drew before step N have a closed form; its j-th row
  reads the next chunk of its stream in a seeded order that covers every chunk once per epoch.
  A source drawn e < 1 epochs has shown a fraction e of its tokens; e ≥ 1, whole epochs.
- ``random``: counter-based hashes of (seed, N, row) pick the row's source by the weights and a
  start position in its stream (sampling with replacement: e epochs show ≈ 1 − exp(−e) of it).

Either way a run restarted at step N sees exactly the batches an uninterrupted run would, and
process p of P computes only its rows [p·B/P, (p+1)·B/P).

**Read positions live in the checkpoint** (`position(step)`, restored by `resume(step, meta)`): the
rows each source drew, per phase. A resume whose mixture differs (the hero's swap at step 108,000)
continues every source where it was: rows drawn before step N ≥ R (the restored step) are the
saved rows at R plus what the *current* weights draw over [R, N) (their closed form at N minus at
R). With an unchanged mixture the saved rows equal the closed form, so the batches are the
uninterrupted run's; either way a batch is a pure function of (seed, mixture history, step).
Positions saved at another seq_len (a context-extension stage, `train.init_from_mode=continue`)
continue each source at its next whole chunk of the new length; with `data.shuffle_window` (windows
shuffled, their chunks read in order; a multiple of both lengths) that is exactly the next text of
its window (`_rows_at`).

NumPy only (no JAX). Batch arrays: ``inputs``/``targets`` int32 [b, T], ``segment_ids`` int32
[b, T] (documents numbered from 1 in each row, 0 = padding), ``loss_mask`` float32 [b, T] (which
targets the loss scores, by `data.loss_targets`: `scored_targets`), and ``source_counts``
int64 [S]: tokens each source (`Loader.source_names`) contributes to the *global* batch at this
step (identical on every process; the loop sums them for ``data/tokens/<source>/<phase>``).
"""
from __future__ import annotations

import logging

import numpy as np

from marin.config import derive
from marin.data import mixture, sampling
from marin.data.prepare import open_prepared, prepare
from marin.data.tokenizers import check_vocab, load_tokenizer

log = logging.getLogger("marin.data")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_mix = sampling.mix
SOURCE_STREAM, POSITION_STREAM = 1, 2  # data.sampling=random
ROW_STREAM, PHASE_STREAM, ORDER_STREAM, OFFSET_STREAM = 3, 4, 5, 6  # data.sampling=epoch


def row_hash(seed: int, steps, rows, stream: int) -> np.ndarray:
    """uint64 hash of (seed, step, row, stream), broadcast over `steps` and `rows`."""
    # Arrays throughout: NumPy wraps uint64 array arithmetic silently (scalars would warn).
    base = _mix(np.asarray([seed & (2**64 - 1)], np.uint64) + np.asarray([stream], np.uint64) * _GOLDEN)
    h = _mix(base + np.atleast_1d(np.asarray(steps, np.uint64)) * _GOLDEN)
    return _mix(h + np.asarray(rows, np.uint64))


def _unit(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


class Loader:
    """Batches of the mixture in `cfg.data` for one process; see the module docstring."""

    def __init__(self, cfg, process_index: int = 0, process_count: int = 1, progress: bool = True,
                 prepared: tuple | None = None):
        """`prepared`: (sources, eval sets) as `prepare(cfg)` returns them (default: prepared now).
        Opening a source reads its index alone; a row's shard is memory-mapped when a row reads it."""
        t = cfg.train
        self.cfg = cfg
        self.seq_len, self.global_batch, self.seed = t.seq_len, t.global_batch, t.seed
        if t.global_batch % process_count:
            raise ValueError(f"train.global_batch ({t.global_batch}) must be divisible by the "
                             f"process count ({process_count})")
        per = t.global_batch // process_count
        self.row_start, self.row_stop = process_index * per, (process_index + 1) * per
        self.process_index, self.process_count = process_index, process_count
        self.loss_targets = cfg.data.loss_targets

        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        if msg := check_vocab(self.tokenizer, cfg.model.vocab_size, cfg.data.tokenizer):
            raise ValueError(msg)
        self.vocab_size = self.tokenizer.vocab_size

        self.sources = mixture.sources(cfg)
        self.source_names = [s.name for s in self.sources]
        self.phase_names = [mixture.phase_name(cfg, p) for p in range(mixture.num_phases(cfg))]
        self.boundaries = mixture.boundary_steps(cfg)
        self.shards, self.eval_shards = prepared or self._open_sources(progress)
        weights = np.asarray([s.weights for s in self.sources], np.float64).T  # [phases, S]
        self._cdf = np.cumsum(weights, axis=1) / weights.sum(axis=1, keepdims=True)
        self._last_positive = [int(np.flatnonzero(w > 0)[-1]) for w in weights]
        self.sampling = cfg.data.sampling
        self._num_tokens = np.asarray([0 if s is None else s.num_tokens for s in self.shards], np.int64)
        if self.sampling == "epoch":
            self._plan_epochs(weights)
        self._warn_epochs()
        self._eval = self._eval_bpt = None
        self._seen = (0, {})  # (step, totals): tokens_seen is incremental for increasing steps
        self._anchor = None  # data.sampling=epoch after `resume`: (step, saved rows, rows offset [S])

    def _open_sources(self, progress: bool) -> tuple:
        """The prepared sources: with `data.verify_inputs` (auto: a one-process run) planned from the
        input files (`prepare`: changed or missing ones tokenized now); without, opened through their
        config's pointers to the last preparation, reading no input file (`open_prepared`), or
        prepared when one has none."""
        if not derive.verify_inputs(self.cfg.data.verify_inputs, self.process_count):   # resolved: a bool
            opened = open_prepared(self.cfg, self.tokenizer)
            if opened is not None:
                log.info("data: opened the last preparation of each source without checking its input files "
                         "(data.verify_inputs=false; run python -m marin.data.prepare after changing them)")
                return opened
        return prepare(self.cfg, progress=progress)

    def _plan_epochs(self, weights: np.ndarray) -> None:
        """What `data.sampling=epoch` derives once: each phase's row intervals and the rows every
        source drew before each phase starts."""
        B = self.global_batch
        # K = ⌈N / T⌉ chunks per epoch (or whole shuffle windows of them); simulated epoching
        # (data.simulated_epoching) keeps the run's share of them, read from one seeded start every
        # epoch: the same tokens repeat, as the target run repeats its whole cells (levanter slices
        # each cell once, then epochs over it).
        self._fraction = fraction = mixture.simulated_fraction(self.cfg)
        self._chunks = self._chunks_per_epoch(self.seq_len)
        self._offset_moves = np.uint64(fraction is None)  # 0: every epoch starts where the first did
        self._epoch_tokens = np.minimum(self._chunks * self.seq_len, self._num_tokens)
        self._ids = np.asarray([sampling.name_id(n) for n in self.source_names], np.uint64)
        self._edges = [sampling.boundaries(w, B) for w in weights]
        self._beta = [int(sampling.key(self.seed, PHASE_STREAM, p)[0] % np.uint64(sampling.M))
                      for p in range(len(weights))]
        self._starts = [0, *self.boundaries]
        self._phase_rows = [np.zeros(len(self.sources), np.int64)]
        for p, (a, b) in enumerate(zip(self._starts, self._starts[1:])):
            self._phase_rows.append(self._phase_rows[-1] + self._rows_in_phase(p, b - a))
        self._memo = (-2, None, None)  # (step, rows before it, rows at it): consecutive steps are O(S)

    def _chunks_per_epoch(self, T: int, W: int | None = None) -> np.ndarray:
        """K per source: ⌈N / T⌉ chunks, or with a shuffle window W (`data.shuffle_window`), ⌈N / W⌉
        windows of W / T chunks (the last window wraps the circular stream: ≤ W tokens twice an epoch);
        under simulated epoching, the run's share of them."""
        W = self.cfg.data.shuffle_window if W is None else W
        units = -(-self._num_tokens // (W or T))  # windows (or chunks) of a whole epoch
        kept = np.asarray([derive.simulated_chunks(int(k), self._fraction) for k in units], np.int64)
        return kept * (W // T if W else 1)

    def _shuffled(self, chunk: np.ndarray, K: np.ndarray, ident: np.ndarray, epoch: np.ndarray) -> np.ndarray:
        """The epoch's read order: the chunk the `chunk`-th row of an epoch reads. W = 0: every chunk
        shuffled alone; else the windows shuffled, the chunks of each read in order (so a stage of
        another seq_len dividing W continues each source's text where it was: `_rows_at`)."""
        per = self.cfg.data.shuffle_window // self.seq_len or 1
        window, within = np.divmod(chunk, per)
        return sampling.permute(window, K // per, sampling.key(self.seed, ORDER_STREAM, ident, epoch)) * per + within

    def _rows_in_phase(self, p: int, steps: int) -> np.ndarray:
        return sampling.rows_before(self._edges[p], max(0, steps), self._beta[p])

    def _warn_epochs(self) -> None:
        """The config check refuses known counts over the cap; here the prepared counts are known."""
        available = {s.name: s.num_tokens for s in self.shards if s is not None}
        epochs = mixture.epochs_per_source(self.cfg, available)
        over = {n: sum(e) for n, e in epochs.items() if sum(e) > self.cfg.data.max_epochs}
        if over:
            log.warning("these sources repeat more than data.max_epochs=%g epochs: %s", self.cfg.data.max_epochs,
                        ", ".join(f"{n} {e:.1f}" for n, e in over.items()))

    # ----------------------------------------------------------------------------- training

    def phase(self, step: int) -> int:
        return sum(step >= b for b in self.boundaries)

    def _choose_sources(self, steps: np.ndarray, phases: np.ndarray) -> np.ndarray:
        """Source index of every global row at each step: [len(steps), B]."""
        u = _unit(row_hash(self.seed, steps[:, None], np.arange(self.global_batch)[None, :], SOURCE_STREAM))
        out = np.empty(u.shape, np.int64)
        for p in np.unique(phases):
            sel = phases == p
            idx = np.searchsorted(self._cdf[p], u[sel], side="right")
            out[sel] = np.minimum(idx, self._last_positive[p])  # rounding: never a zero-weight source
        return out

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows per source in the global batch [S], source [b] and start in its stream [b] of
        this process's rows) at `step`: what `batch` reads."""
        if self.sampling == "epoch":
            return self._epoch_rows(step)
        src = self._choose_sources(np.asarray([step]), np.asarray([self.phase(step)]))[0]
        mine = src[self.row_start:self.row_stop]
        starts = row_hash(self.seed, step, np.arange(self.row_start, self.row_stop), POSITION_STREAM)
        start = (starts % self._num_tokens[mine].astype(np.uint64)).astype(np.int64)
        return np.bincount(src, minlength=len(self.sources)), mine, start

    def _epoch_rows(self, step: int):
        """`rows` for data.sampling=epoch (see `marin.data.sampling`)."""
        p, B = self.phase(step), self.global_batch
        before = self._rows_before(step)
        first = sampling.points_below(self._edges[p], sampling.theta(step - self._starts[p], self._beta[p]))
        counts = np.diff(first)  # slots [first[s], first[s+1]) of the global batch are source s's
        self._memo = (step, before, counts)
        slot_source = np.repeat(np.arange(len(self.sources)), counts)
        slot_rank = np.arange(B) - first[slot_source]
        # Batch row i holds slot order[i]: a seeded shuffle, so no process gets one source only.
        order = np.argsort(row_hash(self.seed, step, np.arange(B), ROW_STREAM), kind="stable")
        mine = order[self.row_start:self.row_stop]
        src = slot_source[mine]
        drawn = before[src] + slot_rank[mine]  # this is the source's drawn-th row, ever
        K, N, ident = self._chunks[src], self._num_tokens[src], self._ids[src]
        epoch, chunk = np.divmod(drawn, K)
        chunk = self._shuffled(chunk, K, ident, epoch)
        offset = sampling.key(self.seed, OFFSET_STREAM, ident, epoch.astype(np.uint64) * self._offset_moves)
        offset = (offset % N.astype(np.uint64)).astype(np.int64)
        start = (offset + chunk * self.seq_len) % N
        return counts, src, start

    def _rows_before(self, step: int) -> np.ndarray:
        """int64 [S]: rows each source drew in the global batches of steps [0, step)."""
        last, before, counts = self._memo
        if last == step:
            return before
        if last == step - 1 and (self._anchor is None or step != self._anchor[0]):
            return before + counts
        p = self.phase(step)
        rows = self._phase_rows[p] + self._rows_in_phase(p, step - self._starts[p])
        if self._anchor is not None and step >= self._anchor[0]:
            rows = rows + self._anchor[2]  # the saved positions, moved on by the current weights
        return rows

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global batch at `step`."""
        T = self.seq_len
        counts, mine, start = self.rows(step)
        window = np.empty((len(mine), T + 1), np.int64)
        doc = np.empty((len(mine), T + 1), np.int64)
        span = np.arange(T + 1, dtype=np.int64)
        for s in np.unique(mine):
            shard = self.shards[s]  # a prepared source: `tokens` (array-like) and its documents
            sel = mine == s
            idx = (start[sel][:, None] + span) % shard.num_tokens
            window[sel] = shard.tokens[idx]
            doc[sel] = document_of(shard, idx)
        batch = _pack(window, doc, T, self.loss_targets)
        batch["source_counts"] = counts.astype(np.int64) * T
        return batch

    def tokens_seen(self, step: int) -> dict[str, int]:
        """{"<source>/<phase>": tokens} over the global batches of steps [0, step).

        `data.sampling=epoch`: a closed form. `random`: incremental, a call costs only the steps
        since the previous one (a first call at step N replays N steps' source choices,
        vectorised; `resume_tokens_seen` skips that)."""
        if self.sampling == "epoch":
            return self._epoch_tokens_seen(step)
        done, totals = self._seen
        if step < done:
            done, totals = 0, {}
        totals = dict(totals)
        for lo in range(done, step, 4096):
            steps = np.arange(lo, min(step, lo + 4096))
            phases = np.asarray([self.phase(int(s)) for s in steps])
            src = self._choose_sources(steps, phases)
            for p in np.unique(phases):
                counts = np.bincount(src[phases == p].ravel(), minlength=len(self.sources)) * self.seq_len
                for i in np.flatnonzero(counts):
                    key = f"{self.source_names[i]}/{self.phase_names[p]}"
                    totals[key] = totals.get(key, 0) + int(counts[i])
        self._seen = (step, totals)
        return dict(totals)

    def _epoch_tokens_seen(self, step: int) -> dict[str, int]:
        return {k: rows * self.seq_len for k, rows in self._epoch_rows_seen(step).items()}

    def _closed_rows(self, step: int) -> dict[str, int]:
        """{"<source>/<phase>": rows} the current mixture's closed form draws over [0, step)."""
        rows = {}
        for p, start in enumerate(self._starts):
            stop = self._starts[p + 1] if p + 1 < len(self._starts) else step
            drawn = self._rows_in_phase(p, min(step, stop) - start)
            for i in np.flatnonzero(drawn):
                rows[f"{self.source_names[i]}/{self.phase_names[p]}"] = int(drawn[i])
        return rows

    def _epoch_rows_seen(self, step: int) -> dict[str, int]:
        """{"<source>/<phase>": rows drawn over [0, step)}: after `resume` at R ≤ step, the saved
        rows at R plus the current mixture's rows over [R, step)."""
        now = self._closed_rows(step)
        if self._anchor is None or step < self._anchor[0]:
            return now
        at, saved, _ = self._anchor
        then = self._closed_rows(at)
        rows = dict(saved)
        for k in set(now) | set(then):
            if extra := now.get(k, 0) - then.get(k, 0):
                rows[k] = rows.get(k, 0) + extra
        return {k: v for k, v in rows.items() if v}

    def position(self, step: int) -> dict:
        """What a checkpoint at `step` keeps of the data: each source's rows drawn, per phase
        (`data.sampling=epoch`: its read position is their sum), with the row length they count."""
        if self.sampling == "epoch":
            rows = self._epoch_rows_seen(step)
        else:
            rows = {k: v // self.seq_len for k, v in self.tokens_seen(step).items()}
        return {"sampling": self.sampling, "seq_len": self.seq_len, "shuffle_window": self.cfg.data.shuffle_window,
                "rows": rows}

    def resume(self, step: int, meta: dict) -> None:
        """Continue from a checkpoint's `meta` (its `tokens_seen` and `data` = `position(step)`).

        `data.sampling=epoch`: every source continues from its saved read position whatever the
        current weights, which apply from `step` on. A checkpoint without positions, or with
        another row length or sampling, continues from the current mixture's closed form (the
        behaviour before positions were saved).

        Positions saved at another `seq_len` (a context-extension stage) continue each source at its
        next whole chunk of the new length (`_rows_at`); tokens_seen then counts new-length rows."""
        self.resume_tokens_seen(step, meta.get("tokens_seen", {}))
        data = meta.get("data") or {}
        if self.sampling != "epoch":
            return
        if data.get("sampling") != "epoch" or not isinstance(data.get("seq_len"), int):
            if data:
                log.warning("the checkpoint's read positions (sampling %s, seq_len %s) do not apply to "
                            "sampling epoch: positions follow the current mixture",
                            data.get("sampling"), data.get("seq_len"))
            return
        saved = {k: int(v) for k, v in data.get("rows", {}).items()}
        drawn = np.zeros(len(self.sources), np.int64)
        index = {n: i for i, n in enumerate(self.source_names)}
        for k, v in saved.items():
            if (i := index.get(k.rsplit("/", 1)[0])) is not None:
                drawn[i] += v
        if data["seq_len"] != self.seq_len:
            saved, drawn = self._rows_at(step, saved, drawn, data["seq_len"], int(data.get("shuffle_window") or 0))
        self._anchor = None
        self._memo = (-2, None, None)
        closed = self._rows_before(step)
        self._anchor = (step, saved, drawn - closed)
        if (moved := int(np.abs(drawn - closed).sum())):
            log.info("data: read positions restored at step %d (%d rows away from the current "
                     "mixture's closed form): each source continues where it was", step, moved)

    def _rows_at(self, step: int, saved: dict[str, int], drawn: np.ndarray, old_len: int, old_window: int):
        """Rows drawn at `old_len` → rows at this seq_len: each source's next row starts where its
        last one ended, rounded up to a whole chunk of the new length (epoch e, in-epoch tokens
        P = i·T_old → row ⌈P / T⌉ of epoch e; past the epoch's end, the next epoch's first). With a
        `data.shuffle_window` both lengths divide, that is the next text of its window: nothing read
        twice, nothing skipped beyond the rounding. With none (or another window before), the
        epoch's remaining share continues, in the new length's order. Returns (saved rows per key,
        drawn per source)."""
        k_old, k_new = self._chunks_per_epoch(old_len, old_window), self._chunks
        epoch, within = np.divmod(drawn, np.maximum(k_old, 1))
        row = -(-(within * old_len) // self.seq_len)
        epoch, row = np.where(row >= k_new, epoch + 1, epoch), np.where(row >= k_new, 0, row)
        new = np.where(self._num_tokens > 0, epoch * k_new + row, 0)
        window = self.cfg.data.shuffle_window
        if not window or window != old_window:
            log.warning("data: read positions saved at seq_len %d continue at seq_len %d by each source's share "
                        "of its epoch; data.shuffle_window (a multiple of both) continues each one's text exactly",
                        old_len, self.seq_len)
        # The per-key rows (tokens_seen's accounting): each scaled down, the rounding on the current phase.
        rows = {k: v * old_len // self.seq_len for k, v in saved.items()}
        now = self.phase_names[self.phase(step)]
        for i, name in enumerate(self.source_names):
            keys = [k for k in rows if k.rsplit("/", 1)[0] == name]
            if keys:
                key = f"{name}/{now}" if f"{name}/{now}" in rows else keys[-1]
                rows[key] += int(new[i]) - sum(rows[k] for k in keys)
        log.info("data: read positions saved at seq_len %d continue at seq_len %d (each source at its next whole "
                 "chunk)", old_len, self.seq_len)
        return {k: v for k, v in rows.items() if v > 0}, new.astype(np.int64)

    def epochs_seen(self, step: int) -> dict[str, float]:
        """{source: epochs drawn over steps [0, step)} = its tokens drawn / its prepared tokens
        (under simulated epoching its share of them; sources of zero weight in every phase are not
        prepared, and not listed)."""
        drawn = dict.fromkeys(self.source_names, 0)
        for key, tokens in self.tokens_seen(step).items():
            drawn[key.rsplit("/", 1)[0]] += tokens
        sizes = self._epoch_tokens if self.sampling == "epoch" else self._num_tokens
        return {n: drawn[n] / int(t) for n, t in zip(self.source_names, sizes) if t}

    def resume_tokens_seen(self, step: int, totals: dict[str, int]) -> None:
        """Start the count at `step` from totals saved earlier (e.g. in a checkpoint)."""
        self._seen = (step, dict(totals))

    # ----------------------------------------------------------------------------- evaluation

    def eval_batches(self) -> dict[str, list[dict[str, np.ndarray]]]:
        """{set: [batch, ...]}: each held-out set cut into consecutive rows, the same every call.

        Batches of `train.eval_batch_size` rows (this process's share), every batch of the set or
        the first `train.eval_batches`; the last one is filled up with padding rows (document
        index -1: segment id 0, loss mask 0, tokens the tokenizer's padding id), which the model
        treats as invalid tokens (no routing).
        """
        if self._eval is None:
            self._eval = {name: self._eval_set(shard) for name, shard in self.eval_shards.items()}
        return self._eval

    def eval_bytes_per_token(self) -> dict[str, float]:
        """{set: UTF-8 bytes per scored token} of the eval batches (all processes' rows): the
        targets the loss counts (loss mask 1), their bytes as the tokenizer decodes them (the
        end-of-document id: none). bits per byte = loss (nats per token) / ln 2 / this."""
        if self._eval_bpt is None:
            self._eval_bpt = {name: self._bytes_per_token(shard) for name, shard in self.eval_shards.items()}
        return self._eval_bpt

    def _eval_layout(self, shard: Shard) -> tuple[int, int]:
        """(rows per eval batch, all processes; batches) of a held-out set."""
        T, B = self.cfg.train.eval_seq_len, self.cfg.train.eval_batch_size  # a context stage scores at pretraining's length
        if B % self.process_count:
            raise ValueError(f"train.eval_batch_size ({B}) must be divisible by the process count ({self.process_count})")
        rows_available = max(1, -(-(shard.num_tokens - 1) // T))
        count = -(-rows_available // B)
        if self.cfg.train.eval_batches is not None:
            count = min(count, self.cfg.train.eval_batches)
        return B, max(1, count)

    def _eval_window(self, shard: Shard, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[rows, T+1] tokens and document indices (-1 past the set's end: padding) of eval rows
        (T = train.eval_seq_len)."""
        T = self.cfg.train.eval_seq_len
        idx = rows[:, None] * T + np.arange(T + 1)
        valid = idx < shard.num_tokens
        safe = np.where(valid, idx, 0)
        window = np.where(valid, shard.tokens[safe], self.tokenizer.pad_id)
        doc = np.where(valid, document_of(shard, safe), -1)
        return window, doc

    def _bytes_per_token(self, shard: Shard) -> float:
        B, count = self._eval_layout(shard)
        window, doc = self._eval_window(shard, np.arange(count * B))
        targets = np.asarray(window[:, 1:][scored_targets(doc, self.loss_targets)], np.int64)
        if not targets.size:
            return float("nan")
        return _utf8_bytes(self.tokenizer, targets) / targets.size

    def _eval_set(self, shard: Shard) -> list[dict[str, np.ndarray]]:
        B, count = self._eval_layout(shard)
        per = B // self.process_count
        start, stop = self.process_index * per, (self.process_index + 1) * per
        return [_pack(*self._eval_window(shard, np.arange(b * B + start, b * B + stop)),
                      self.cfg.train.eval_seq_len,
                      self.loss_targets) for b in range(count)]


def document_of(shard, idx: np.ndarray) -> np.ndarray:
    """1 + the document index of each token position (only what tells documents apart matters).
    A sharded source searches only the shards the positions fall in (their offsets memory-mapped:
    a binary search touches O(log n) pages), never the whole source's document table."""
    if hasattr(shard, "document_of"):
        return shard.document_of(idx)
    return np.searchsorted(shard.offsets, idx, side="right")


def _utf8_bytes(tokenizer, ids: np.ndarray) -> int:
    """UTF-8 bytes of token ids (special ids — end of document, padding — count none)."""
    if getattr(tokenizer, "name", None) == "byte":
        return int((ids < 256).sum())  # one byte each, exactly
    ids = ids[ids != tokenizer.eos_id] if tokenizer.eos_id is not None else ids
    return len(tokenizer.decode(ids).encode("utf-8"))  # one decode: multi-token characters stay whole


def scored_targets(doc: np.ndarray, rule: str = "causal") -> np.ndarray:
    """bool [b, T]: which targets of [b, T+1] windows the loss scores, from each token's document
    index (-1 = padding), by `data.loss_targets`:

    - ``causal`` (Levanter's `LmExample.causal`, production's): a row is its T inputs; every
      target is scored, the next document's first token after an end-of-document included,
      except the row's last position (its target is the next row's first token) and padding
      targets: T-1 per full row.
    - ``document``: only targets in the input's document (the end-of-document that closes it
      included, the next document's first token not), at all T positions.
    """
    valid_in, valid_out = doc[:, :-1] >= 0, doc[:, 1:] >= 0
    if rule == "document":
        return valid_in & (doc[:, 1:] == doc[:, :-1])
    if rule != "causal":
        raise ValueError(f"data.loss_targets must be causal or document; got {rule!r}")
    scored = valid_in & valid_out
    scored[:, -1] = False
    return scored


def _pack(window: np.ndarray, doc: np.ndarray, T: int, rule: str = "causal") -> dict[str, np.ndarray]:
    """Model inputs from [b, T+1] token windows and their document index (-1 = padding: segment
    id 0, loss mask 0)."""
    new_doc = np.concatenate([np.ones_like(doc[:, :1], bool), doc[:, 1:] != doc[:, :-1]], axis=1)
    segment = np.where(doc >= 0, np.cumsum(new_doc & (doc >= 0), axis=1), 0)
    return {
        "inputs": window[:, :T].astype(np.int32),
        "targets": window[:, 1:].astype(np.int32),
        "segment_ids": segment[:, :T].astype(np.int32),
        "loss_mask": scored_targets(doc, rule).astype(np.float32),
    }
