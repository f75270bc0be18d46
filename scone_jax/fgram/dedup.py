"""Per-data-shard f-gram deduplication for a training batch (docs/method.md §5, and one step more).

Frequent f-grams repeat heavily, so the f-gram model runs once per unique f-gram of a data
shard (the rows of the global batch one device holds), and the model gathers the results
back with `fgram_slot`. Beyond the paper we also share prefixes: the f-gram model is causal
over a left-aligned f-gram, so its hidden state at position j of row (t_1..t_n) IS the output
for the prefix f-gram (t_1..t_{j+1}). A unique f-gram that is a prefix of another unique
f-gram of the shard therefore needs no row of its own; only the shard's maximal f-grams are
run, and `fgram_slot` addresses (row, position) slots.

With gradient accumulation over A micro-batches, each shard's rows are split into A
contiguous blocks, and every (shard, micro-batch) pair is a *group* with its own f-grams:
a micro-batch then carries exactly the f-gram rows its positions point at, whatever rows of
the batch the train step hands it (steps.split_micro_batches). Groups are numbered shard-major
(group g = s*A + a holds batch rows g*B/(N*A) .. (g+1)*B/(N*A) - 1), so the arrays need no
reordering: a plain batch (A = 1) is the special case of one group per shard.

Shapes are static: every group gets capacity U/A rows (U = `scone.fgram_capacity`, per data
shard and step). A group that needs more rows is an error naming the capacity needed, never a
silent drop: we chose one fixed capacity over a few capacity buckets because each bucket would
be another compiled train step, and the logged statistics (stats.py) show the right U after a
few batches. Splitting U across micro-batches keeps the f-gram model's rows per step (its
FLOPs) and its activation memory per micro-batch in step with the decoder's; the price is
that dedup finds fewer repeats in a smaller group.
"""
from __future__ import annotations

import numpy as np

from scone_jax.batch import Batch
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.numba_loops import compiled
from scone_jax.fgram.vocab import PAD, FgramVocab

CAPACITY_KEY = "scone.fgram_capacity"


class FgramBatcher:
    """Adds the trained provider's f-gram arrays to a host Batch (scone_jax/batch.py): fgram_ids, fgram_tokens
    (group g's maximal unique f-grams in ascending id; unused rows all PAD), fgram_lengths, fgram_slot (the
    slot row*K + (length-1) inside the position's own group whose f-gram model output is this position's
    f-gram's) and fgram_unique. G = num_shards * micro_batches groups, C = capacity // micro_batches rows
    each; group g holds batch rows g*B/G .. (g+1)*B/G - 1 (module docstring).
    """

    def __init__(self, matcher: Matcher, vocab: FgramVocab, *, num_shards: int, capacity: int,
                 micro_batches: int = 1):
        if num_shards < 1 or capacity < 1 or micro_batches < 1:
            raise ValueError(f"num_shards={num_shards}, {CAPACITY_KEY}={capacity} and "
                             f"micro_batches={micro_batches} must all be >= 1.")
        if capacity % micro_batches:
            raise ValueError(f"{CAPACITY_KEY}={capacity} does not split into {micro_batches} equal micro-batches; "
                             f"use a multiple of {micro_batches}.")
        self.matcher, self.vocab = matcher, vocab
        self.num_shards, self.capacity, self.micro_batches = num_shards, capacity, micro_batches
        self.num_groups = num_shards * micro_batches
        self.group_capacity = capacity // micro_batches

    def __call__(self, batch: Batch) -> Batch:
        tokens, segment_ids = batch.inputs, batch.segment_ids
        rows, length = tokens.shape
        if rows % self.num_groups:
            what = f"{self.num_shards} equal data shards" + (
                f" of {self.micro_batches} micro-batches each" if self.micro_batches > 1 else "")
            raise ValueError(
                f"The batch has {rows} rows, which do not split into {what}. "
                "Fix: make the global batch size a multiple of the number of data shards"
                + (" times train.grad_accum_steps." if self.micro_batches > 1 else ".")
            )
        ids, suffixes = self.matcher.match_with_suffixes(tokens, segment_ids)
        k, groups, capacity = self.vocab.max_len, self.num_groups, self.group_capacity
        # Compiled pass 1: each group's unique f-grams (ascending), a position where each is the
        # longest match, and each position's entry among them.
        unique, group_start, entry, first = _unique_per_group(ids.ravel(), groups)
        lengths = self.vocab.lengths[unique]
        # Compiled pass 2: rows (tokens and lengths written in place) for the maximal ones, a
        # (row, position) slot for every one.
        fgram_tokens = np.full((groups, capacity, k), PAD, dtype=np.int32)
        fgram_lengths = np.zeros((groups, capacity), dtype=np.int32)
        slot, rows_per_group = _rows_and_slots(unique, group_start, lengths, first, suffixes.reshape(-1, k - 1),
                                               self.vocab.tokens, fgram_tokens, fgram_lengths)
        self._check_capacity(rows_per_group)
        slots = np.full(entry.shape, -1, np.int32)
        matched = entry >= 0
        slots[matched] = slot[entry[matched]]
        return batch.replace(fgram_ids=ids, fgram_tokens=fgram_tokens, fgram_lengths=fgram_lengths,
                             fgram_slot=slots.reshape(ids.shape), fgram_unique=np.diff(group_start).astype(np.int32))

    def _check_capacity(self, rows_per_group: np.ndarray) -> None:
        need = int(rows_per_group.max(initial=0))
        if need > self.group_capacity:
            group = int(np.argmax(rows_per_group))
            a = self.micro_batches
            where = f"Data shard {group // a}" + (f", micro-batch {group % a}," if a > 1 else "")
            share = f" / {a} micro-batches = {self.group_capacity}" if a > 1 else ""
            raise ValueError(
                f"{where} needs {need} f-gram rows in this batch, more than "
                f"{CAPACITY_KEY}={self.capacity}{share}; dropping any would change the model's input. "
                f"Fix: set --config.{CAPACITY_KEY}={_round_up(need * a, 128 * a)} or more (it is per data "
                "shard and step)."
            )


@compiled
def _unique_per_group(flat, groups):
    """flat [N]: f-gram id per position (-1 none), N/groups positions per group. Returns
    (unique ids, each group's ascending; group_start [groups+1] into them; entry [N]: the
    position's index into unique, -1 where unmatched; first [U]: a position where unique[u] is
    the longest match)."""
    per = len(flat) // groups
    unique = np.empty(len(flat), np.int32)
    first = np.empty(len(flat), np.int64)
    entry = np.full(len(flat), -1, np.int32)
    group_start = np.zeros(groups + 1, np.int64)
    count = 0
    for g in range(groups):
        block = flat[g * per:(g + 1) * per]
        previous = -1
        for i in np.argsort(block):
            if block[i] < 0:
                continue
            if block[i] != previous:
                previous = block[i]
                unique[count] = previous
                first[count] = g * per + i
                count += 1
            entry[g * per + i] = count - 1
        group_start[g + 1] = count
    return unique[:count].copy(), group_start, entry, first[:count].copy()


@compiled
def _find(unique, start, stop, value):
    """Index of value in the ascending unique[start:stop], or -1."""
    at = start + np.searchsorted(unique[start:stop], value)
    return at if at < stop and unique[at] == value else -1


@compiled
def _prefix(suffixes, first, lengths, u, n):
    """Id of the n-token prefix of unique f-gram u: it ends n-1 tokens after u's start, at a
    position where it is a suffix of the longest match (by closure), so the matcher recorded it."""
    return suffixes[first[u] - lengths[u] + n, n - 2]


@compiled
def _rows_and_slots(unique, group_start, lengths, first, suffixes, vocab_tokens, fgram_tokens, fgram_lengths):
    """Per group: the unique f-grams that are no proper prefix of another unique f-gram of the
    group (maximal) get rows 0, 1, ... in ascending id order, their tokens and lengths written to
    fgram_tokens/fgram_lengths [G, C(, K)] while rows remain; every unique f-gram's slot is
    row*K + length-1 of the first row whose f-gram begins with it. Returns (slot per unique
    f-gram; rows each group needs, which may exceed C: the caller raises)."""
    max_len, capacity = vocab_tokens.shape[1], fgram_tokens.shape[1]
    covered = np.zeros(len(unique), np.bool_)
    slot = np.full(len(unique), -1, np.int32)
    rows_per_group = np.zeros(len(group_start) - 1, np.int64)
    for g in range(len(group_start) - 1):
        start, stop = group_start[g], group_start[g + 1]
        for u in range(start, stop):
            for n in range(2, lengths[u]):  # proper prefixes of 2 .. length-1 tokens
                at = _find(unique, start, stop, _prefix(suffixes, first, lengths, u, n))
                if at >= 0:
                    covered[at] = True
        rows = 0
        for u in range(start, stop):
            if covered[u]:
                continue
            if rows < capacity:
                fgram_tokens[g, rows, :] = vocab_tokens[unique[u], :]
                fgram_lengths[g, rows] = lengths[u]
            for n in range(2, lengths[u] + 1):  # its prefixes of 2 .. length (itself) tokens
                at = _find(unique, start, stop, _prefix(suffixes, first, lengths, u, n))
                if at >= 0 and slot[at] < 0:
                    slot[at] = rows * max_len + n - 1
            rows += 1
        rows_per_group[g] = rows
    return slot, rows_per_group


def _round_up(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple
