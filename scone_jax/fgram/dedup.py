"""Per-data-shard f-gram deduplication for a training batch (SCONE.md rule 5).

Frequent f-grams repeat heavily, so the f-gram model runs once per unique f-gram
of a data shard (the rows of the global batch one device holds), and the model
gathers the results back with `fgram_index`. Shapes are static: every shard gets
`capacity` rows (U). A shard with more unique f-grams than U is an error naming
the capacity needed (config key `scone.fgram_capacity`), never a silent drop: we
chose one fixed capacity over a few capacity buckets because each bucket would be
another compiled train step, and hit-rate statistics (stats.py) show the right U
after a few batches.
"""
from __future__ import annotations

import numpy as np

from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import PAD, FgramVocab

CAPACITY_KEY = "scone.fgram_capacity"


class FgramBatcher:
    """Adds fgram_ids, fgram_tokens, fgram_lengths and fgram_index to a batch dict of numpy arrays.

    fgram_ids     int32 [B, T]   global f-gram id of the longest match, or -1
    fgram_tokens  int32 [N*U, K] rows s*U .. s*U+U-1: shard s's unique f-grams (ascending id), PAD-padded;
                                 unused rows are all PAD
    fgram_lengths int32 [N*U]    f-gram length per row, 0 for unused rows
    fgram_index   int32 [B, T]   row within the position's own shard (0..U-1), or -1 where unmatched
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
        shard = np.repeat(np.arange(self.num_shards), rows // self.num_shards * length)
        flat = ids.ravel()
        matched = flat >= 0
        # One sort for all shards: unique (shard, id) pairs come out grouped by shard, ids ascending.
        pairs, inverse = np.unique(shard[matched].astype(np.int64) * self.vocab.num_fgrams + flat[matched],
                                   return_inverse=True)
        pair_shard, pair_id = np.divmod(pairs, self.vocab.num_fgrams)
        first = np.searchsorted(pair_shard, np.arange(self.num_shards + 1))
        self._check_capacity(np.diff(first))
        row = np.arange(len(pairs)) - first[pair_shard]  # row within its shard
        index = np.full(flat.shape, -1, dtype=np.int32)
        index[matched] = row[inverse]
        out_row = pair_shard * self.capacity + row
        fgram_tokens = np.full((self.num_shards * self.capacity, self.vocab.max_len), PAD, dtype=np.int32)
        fgram_tokens[out_row] = self.vocab.tokens[pair_id]
        fgram_lengths = np.zeros(self.num_shards * self.capacity, dtype=np.int32)
        fgram_lengths[out_row] = self.vocab.lengths[pair_id]
        return batch | {"fgram_ids": ids, "fgram_tokens": fgram_tokens, "fgram_lengths": fgram_lengths,
                        "fgram_index": index.reshape(ids.shape)}

    def _check_capacity(self, unique_per_shard: np.ndarray) -> None:
        need = int(unique_per_shard.max(initial=0))
        if need > self.capacity:
            shard = int(np.argmax(unique_per_shard))
            raise ValueError(
                f"Data shard {shard} holds {need} unique f-grams in this batch, more than "
                f"{CAPACITY_KEY}={self.capacity}; dropping any would change the model's input. "
                f"Fix: set --config.{CAPACITY_KEY}={_round_up(need)} or more (it is per data shard)."
            )


def _round_up(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple
