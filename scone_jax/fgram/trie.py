"""N-gram sets as tries in one open-addressing hash table of uint64 keys.

An n-gram (n >= 2) is the key `code(prefix) * V + last_token`, where V is the
tokenizer's vocabulary size and code(prefix) is the first token for a 2-gram,
else V + an id of the (n-1)-token prefix (its slot in the matcher, its row
during extraction). The f-gram set is closed under prefixes (SCONE.md), so every
prefix has such an id, and n-grams can be looked up one token at a time without
storing tokens in the table. Keys fit in 64 bits while (V + ids) * V < 2^64.

Lookups are vectorized over all queries: each round gathers one bucket row per
pending query, so a lookup costs one random memory access in the common case,
hit or miss.
"""
from __future__ import annotations

import numpy as np

EMPTY = np.uint64(np.iinfo(np.uint64).max)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant (golden ratio) for multiplicative hashing
_MIX_INT, _MASK64, _EMPTY_INT = int(_MIX), 2**64 - 1, int(EMPTY)
WIDTH = 4  # slots per bucket (a row of 4 bools is read as one uint32 below): one 32-byte row, gathered with a single np.take
LOAD = 0.6  # keys per slot; lower costs memory, higher sends more lookups to a second bucket


class KeyTable:
    """Distinct uint64 keys in buckets of WIDTH slots; a key's slot (bucket * WIDTH + column) never changes.

    Buckets fill left to right and keys are never removed, so a bucket with an
    empty last column ends every probe sequence that reaches it. A full bucket
    overflows into the next one; the table keeps empty buckets at its end so
    probing never runs off it.
    """

    def __init__(self, expected: int, load: float = LOAD):
        self.num_buckets = max(1, int(np.ceil(expected / (load * WIDTH))))
        if self.num_buckets * WIDTH >= 2**32:
            raise ValueError(f"{expected} keys need {self.num_buckets * WIDTH} slots; the limit is 2^32.")
        self.keys = np.full((self.num_buckets + 2, WIDTH), EMPTY, dtype=np.uint64)

    @classmethod
    def from_buckets(cls, keys: np.ndarray, num_buckets: int) -> KeyTable:
        """A table around existing bucket rows (e.g. a memory-mapped copy in a worker process)."""
        table = cls.__new__(cls)
        table.keys, table.num_buckets = keys, num_buckets
        return table

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """Bucket of each key: the high 32 bits of a multiplicative hash, scaled to num_buckets."""
        mixed = (keys * _MIX) >> np.uint64(32)
        mixed *= np.uint64(self.num_buckets)
        mixed >>= np.uint64(32)
        return mixed.view(np.int64)

    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Inserts distinct keys not yet present; returns their slots (int64)."""
        keys = np.asarray(keys, dtype=np.uint64)
        slots = np.empty(len(keys), dtype=np.int64)
        bucket = self._home(keys)
        pending = np.arange(len(keys))
        while len(pending):
            order = np.argsort(bucket[pending], kind="stable")
            pending = pending[order]
            target = bucket[pending]
            starts = np.flatnonzero(np.r_[True, target[1:] != target[:-1]])
            rank = np.arange(len(target)) - np.repeat(starts, np.diff(np.r_[starts, len(target)]))
            used = WIDTH - (self.keys[target] == EMPTY).sum(axis=1)
            fits = used + rank < WIDTH
            rows, cols = target[fits], (used + rank)[fits]
            self.keys[rows, cols] = keys[pending[fits]]
            slots[pending[fits]] = rows * WIDTH + cols
            pending = pending[~fits]
            bucket[pending] += 1
            self._keep_empty_tail()
        return slots

    def _keep_empty_tail(self) -> None:
        if self.keys[-2, 0] != EMPTY:
            self.keys = np.concatenate([self.keys, np.full((2, WIDTH), EMPTY, np.uint64)])

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Slots of `keys` (int64), -1 where absent."""
        keys = np.asarray(keys, dtype=np.uint64)
        bucket = self._home(keys)
        slots, go_on = self._probe(keys, bucket)
        # Rare: the home bucket was full and did not hold the key; keep probing the following buckets.
        pending = np.flatnonzero(go_on)
        bucket = bucket[pending]
        while len(pending):
            bucket += 1
            found, go_on = self._probe(keys[pending], bucket)
            slots[pending] = found
            pending, bucket = pending[go_on], bucket[go_on]
        return slots

    def lookup_one(self, key: int) -> int:
        """lookup() of one key as a Python int (decoding: K-1 keys per token). Plain Python: each numpy
        call of the vectorized path costs microseconds, ~15 of them per lookup."""
        bucket = ((((key * _MIX_INT) & _MASK64) >> 32) * self.num_buckets) >> 32
        while True:
            row = self.keys[bucket].tolist()
            if key in row:
                return bucket * WIDTH + row.index(key)
            if row[-1] == _EMPTY_INT:
                return -1
            bucket += 1

    def _probe(self, keys: np.ndarray, bucket: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot of each key in its bucket or -1, whether to try the next bucket)."""
        rows = np.take(self.keys, bucket, axis=0)
        # One bool per column, read as one little-endian uint32 per row: byte c is set <=> column c holds
        # the key, so the row reads 2^(8c); as a float32 its exponent field is 127 + 8c, i.e. (bits >> 26) = 15 + c.
        hit = (rows == keys[:, None]).view(np.uint32).ravel()
        column = (hit.astype(np.float32).view(np.int32) >> 26) - 15
        slots = bucket * WIDTH + column
        missing = hit == 0
        slots[missing] = -1
        return slots, missing & (rows[:, -1] != EMPTY)


def pair_keys(first: np.ndarray, last: np.ndarray, vocab_size: int) -> np.ndarray:
    """Keys of 2-grams (first, last)."""
    return first.astype(np.uint64) * np.uint64(vocab_size) + last.astype(np.uint64)


def extend_keys(prefix_id: np.ndarray, last: np.ndarray, vocab_size: int) -> np.ndarray:
    """Keys of (n+1)-grams: the n-gram with id `prefix_id` followed by `last`."""
    v = np.uint64(vocab_size)
    return (prefix_id.astype(np.uint64) + v) * v + last.astype(np.uint64)
