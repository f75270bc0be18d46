"""Per-data-shard f-gram deduplication for a training batch (SCONE.md rule 5, and one step more).

Frequent f-grams repeat heavily, so the f-gram model runs once per unique f-gram of a data
shard (the rows of the global batch one device holds), and the model gathers the results
back with `fgram_index`. Beyond the paper we also share prefixes: the f-gram model is causal
over a left-aligned f-gram, so its hidden state at position j of row (t_1..t_n) IS the output
for the prefix f-gram (t_1..t_{j+1}). A unique f-gram that is a prefix of another unique
f-gram of the shard therefore needs no row of its own; only the shard's maximal f-grams are
run, and `fgram_index` addresses (row, position) slots.

Shapes are static: every shard gets `capacity` rows (U). A shard that needs more rows than U
is an error naming the capacity needed (config key `scone.fgram_capacity`), never a silent
drop: we chose one fixed capacity over a few capacity buckets because each bucket would be
another compiled train step, and the logged statistics (stats.py) show the right U after a
few batches.
"""
from __future__ import annotations

import numpy as np

from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import PAD, FgramVocab

CAPACITY_KEY = "scone.fgram_capacity"


class FgramBatcher:
    """Adds fgram_ids, fgram_tokens, fgram_lengths, fgram_index and fgram_unique to a batch of numpy arrays.

    fgram_ids     int32 [B, T]   global f-gram id of the longest match, or -1
    fgram_tokens  int32 [N*U, K] rows s*U .. s*U+U-1: shard s's maximal unique f-grams (ascending id),
                                 PAD-padded; unused rows are all PAD
    fgram_lengths int32 [N*U]    f-gram length per row, 0 for unused rows
    fgram_index   int32 [B, T]   slot row*K + (length-1) inside the position's own shard, or -1 where
                                 unmatched: the f-gram model's output at that slot is this f-gram's
    fgram_unique  int32 [N]      unique f-grams per shard (host statistics only)
    Shard s holds batch rows s*B/N .. (s+1)*B/N - 1, N = num_shards.
    """

    def __init__(self, matcher: Matcher, vocab: FgramVocab, *, num_shards: int, capacity: int):
        if num_shards < 1 or capacity < 1:
            raise ValueError(f"num_shards={num_shards} and {CAPACITY_KEY}={capacity} must both be >= 1.")
        self.matcher, self.vocab = matcher, vocab
        self.num_shards, self.capacity = num_shards, capacity

    def __call__(self, batch: dict) -> dict:
        tokens, segment_ids = batch["inputs"], batch["segment_ids"]
        rows, length = tokens.shape
        if rows % self.num_shards:
            raise ValueError(
                f"The batch has {rows} rows, which do not split into {self.num_shards} equal data shards. "
                "Fix: make the global batch size a multiple of the number of data shards."
            )
        ids = self.matcher.match(tokens, segment_ids)
        s_count, k = self.vocab.num_fgrams, self.vocab.max_len
        shard = np.repeat(np.arange(self.num_shards), rows // self.num_shards * length)
        flat = ids.ravel()
        matched = flat >= 0
        # One sort for all shards: unique (shard, id) keys come out grouped by shard, ids ascending.
        keys, inverse = np.unique(shard[matched].astype(np.int64) * s_count + flat[matched], return_inverse=True)
        key_shard, key_id = np.divmod(keys, s_count)
        lengths = self.vocab.lengths[key_id]
        # prefix[p, j] = id of the length-(j+1) prefix of f-gram p (closure: every prefix is an f-gram).
        prefix = self.matcher.match(self.vocab.tokens[key_id], (np.arange(k) < lengths[:, None]).astype(np.int32))
        j = np.arange(k)[None]
        proper = (j >= 1) & (j < lengths[:, None] - 1)
        covered_keys = np.unique(np.broadcast_to(key_shard[:, None], prefix.shape)[proper] * s_count + prefix[proper])
        maximal = ~np.isin(keys, covered_keys)
        first = np.searchsorted(key_shard[maximal], np.arange(self.num_shards + 1))
        self._check_capacity(np.diff(first))
        row = np.arange(maximal.sum()) - first[key_shard[maximal]]  # row within its shard
        out_row = key_shard[maximal] * self.capacity + row
        fgram_tokens = np.full((self.num_shards * self.capacity, k), PAD, dtype=np.int32)
        fgram_tokens[out_row] = self.vocab.tokens[key_id[maximal]]
        fgram_lengths = np.zeros(self.num_shards * self.capacity, dtype=np.int32)
        fgram_lengths[out_row] = lengths[maximal]
        # Every unique f-gram is read at (row, position) of a maximal f-gram it begins.
        in_row = (j >= 1) & (j < lengths[maximal][:, None])
        slot_keys = (np.broadcast_to(key_shard[maximal][:, None], in_row.shape) * s_count + prefix[maximal])[in_row]
        slot_vals = (row[:, None] * k + j)[in_row]
        slot_keys, pick = np.unique(slot_keys, return_index=True)
        slot_of_key = slot_vals[pick][np.searchsorted(slot_keys, keys)]
        index = np.full(flat.shape, -1, dtype=np.int32)
        index[matched] = slot_of_key[inverse]
        unique = np.bincount(key_shard, minlength=self.num_shards).astype(np.int32)
        return batch | {"fgram_ids": ids, "fgram_tokens": fgram_tokens, "fgram_lengths": fgram_lengths,
                        "fgram_index": index.reshape(ids.shape), "fgram_unique": unique}

    def _check_capacity(self, rows_per_shard: np.ndarray) -> None:
        need = int(rows_per_shard.max(initial=0))
        if need > self.capacity:
            shard = int(np.argmax(rows_per_shard))
            raise ValueError(
                f"Data shard {shard} needs {need} f-gram rows in this batch, more than "
                f"{CAPACITY_KEY}={self.capacity}; dropping any would change the model's input. "
                f"Fix: set --config.{CAPACITY_KEY}={_round_up(need)} or more (it is per data shard)."
            )


def _round_up(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple
