"""Per-data-shard f-gram deduplication for a training batch (SCONE.md rule 5, and one step more).

Frequent f-grams repeat heavily, so the f-gram model runs once per unique f-gram of a data
shard (the rows of the global batch one device holds), and the model gathers the results
back with `fgram_index`. Beyond the paper we also share prefixes: the f-gram model is causal
over a left-aligned f-gram, so its hidden state at position j of row (t_1..t_n) IS the output
for the prefix f-gram (t_1..t_{j+1}). A unique f-gram that is a prefix of another unique
f-gram of the shard therefore needs no row of its own; only the shard's maximal f-grams are
run, and `fgram_index` addresses (row, position) slots.

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

from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import PAD, FgramVocab

CAPACITY_KEY = "scone.fgram_capacity"


class FgramBatcher:
    """Adds fgram_ids, fgram_tokens, fgram_lengths, fgram_index and fgram_unique to a batch of numpy arrays.

    fgram_ids     int32 [B, T]     global f-gram id of the longest match, or -1
    fgram_tokens  int32 [G, C, K]  group g's maximal unique f-grams (ascending id), PAD-padded;
                                   unused rows are all PAD
    fgram_lengths int32 [G, C]     f-gram length per row, 0 for unused rows
    fgram_index   int32 [B, T]     slot row*K + (length-1) inside the position's own group, or -1 where
                                   unmatched: the f-gram model's output at that slot is this f-gram's
    fgram_unique  int32 [G]        unique f-grams per group (host statistics only)
    G = num_shards * micro_batches groups, C = capacity // micro_batches rows each; group g holds
    batch rows g*B/G .. (g+1)*B/G - 1 (module docstring).
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

    def __call__(self, batch: dict) -> dict:
        tokens, segment_ids = batch["inputs"], batch["segment_ids"]
        rows, length = tokens.shape
        if rows % self.num_groups:
            what = f"{self.num_shards} equal data shards" + (
                f" of {self.micro_batches} micro-batches each" if self.micro_batches > 1 else "")
            raise ValueError(
                f"The batch has {rows} rows, which do not split into {what}. "
                "Fix: make the global batch size a multiple of the number of data shards"
                + (" times train.grad_accum_steps." if self.micro_batches > 1 else ".")
            )
        ids = self.matcher.match(tokens, segment_ids)
        s_count, k = self.vocab.num_fgrams, self.vocab.max_len
        groups, capacity = self.num_groups, self.group_capacity
        group = np.repeat(np.arange(groups), rows // groups * length)
        flat = ids.ravel()
        matched = flat >= 0
        # One sort for all groups: unique (group, id) keys come out grouped by group, ids ascending.
        keys, inverse = np.unique(group[matched].astype(np.int64) * s_count + flat[matched], return_inverse=True)
        key_group, key_id = np.divmod(keys, s_count)
        lengths = self.vocab.lengths[key_id]
        # prefix[p, j] = id of the length-(j+1) prefix of f-gram p (closure: every prefix is an f-gram).
        prefix = self.matcher.match(self.vocab.tokens[key_id], (np.arange(k) < lengths[:, None]).astype(np.int32))
        j = np.arange(k)[None]
        proper = (j >= 1) & (j < lengths[:, None] - 1)
        covered_keys = np.unique(np.broadcast_to(key_group[:, None], prefix.shape)[proper] * s_count + prefix[proper])
        maximal = ~np.isin(keys, covered_keys)
        first = np.searchsorted(key_group[maximal], np.arange(groups + 1))
        self._check_capacity(np.diff(first))
        row = np.arange(maximal.sum()) - first[key_group[maximal]]  # row within its group
        fgram_tokens = np.full((groups, capacity, k), PAD, dtype=np.int32)
        fgram_tokens[key_group[maximal], row] = self.vocab.tokens[key_id[maximal]]
        fgram_lengths = np.zeros((groups, capacity), dtype=np.int32)
        fgram_lengths[key_group[maximal], row] = lengths[maximal]
        # Every unique f-gram is read at (row, position) of a maximal f-gram it begins.
        in_row = (j >= 1) & (j < lengths[maximal][:, None])
        slot_keys = (np.broadcast_to(key_group[maximal][:, None], in_row.shape) * s_count + prefix[maximal])[in_row]
        slot_vals = (row[:, None] * k + j)[in_row]
        slot_keys, pick = np.unique(slot_keys, return_index=True)
        slot_of_key = slot_vals[pick][np.searchsorted(slot_keys, keys)]
        index = np.full(flat.shape, -1, dtype=np.int32)
        index[matched] = slot_of_key[inverse]
        unique = np.bincount(key_group, minlength=groups).astype(np.int32)
        return batch | {"fgram_ids": ids, "fgram_tokens": fgram_tokens, "fgram_lengths": fgram_lengths,
                        "fgram_index": index.reshape(ids.shape), "fgram_unique": unique}

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


def _round_up(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple
