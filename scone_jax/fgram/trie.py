"""N-gram sets as tries in one open-addressing hash table of uint64 keys.

An n-gram (n >= 2) is the key `code(prefix) * V + last_token`, where V is the
tokenizer's vocabulary size and code(prefix) is the first token for a 2-gram,
else V + an id of the (n-1)-token prefix (its slot in the matcher, its row
during extraction). The f-gram set is closed under prefixes (docs/method.md §1), so every
prefix has such an id, and n-grams can be looked up one token at a time without
storing tokens in the table. Keys fit in 64 bits while (V + ids) * V < 2^64.

The loops over keys are compiled (numba_loops.py; `probe` is also called from the
matcher's and extraction's own compiled loops): a lookup costs one random memory access
(one 32-byte bucket) in the common case, hit or miss, and no temporary arrays.
"""
from __future__ import annotations

import numpy as np

from scone_jax.fgram.numba_loops import compiled

EMPTY = np.uint64(np.iinfo(np.uint64).max)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant (golden ratio) for multiplicative hashing
_MIX_INT, _MASK64, _EMPTY_INT = int(_MIX), 2**64 - 1, int(EMPTY)
_32 = np.uint64(32)
WIDTH = 4  # slots per bucket: 32 bytes, half a cache line
LOAD = 0.6  # keys per slot; lower costs memory, higher sends more lookups to a second bucket
_TAIL = 2  # empty buckets kept after the last used one, so probing never runs off the table


@compiled
def home(key, num_buckets):
    """Bucket of a key: the high 32 bits of a multiplicative hash, scaled to num_buckets."""
    return np.int64((((key * _MIX) >> _32) * np.uint64(num_buckets)) >> _32)


@compiled
def probe(keys, num_buckets, key):
    """Slot of `key` in bucket rows `keys` [num_buckets + tail, WIDTH], or -1. Buckets fill left to
    right and keys are never removed, so the first empty column ends the search."""
    bucket = home(key, num_buckets)
    while True:
        for column in range(WIDTH):
            held = keys[bucket, column]
            if held == key:
                return bucket * WIDTH + column
            if held == EMPTY:
                return -1
        bucket += 1


@compiled
def _lookup_all(keys, num_buckets, queries, out):
    for i in range(len(queries)):
        out[i] = probe(keys, num_buckets, queries[i])


@compiled
def _insert_all(keys, num_buckets, new, slots, start):
    """Inserts new[start:] until done (returns len(new)) or a key would land in the tail (returns its index)."""
    last = keys.shape[0] - _TAIL
    for i in range(start, len(new)):
        bucket = home(new[i], num_buckets)
        while keys[bucket, WIDTH - 1] != EMPTY:
            bucket += 1
        if bucket >= last:
            return i
        column = 0
        while keys[bucket, column] != EMPTY:
            column += 1
        keys[bucket, column] = new[i]
        slots[i] = bucket * WIDTH + column
    return len(new)


class KeyTable:
    """Distinct uint64 keys in buckets of WIDTH slots; a key's slot (bucket * WIDTH + column) never changes.

    A full bucket overflows into the next one; the table keeps _TAIL empty
    buckets at its end (growing if an overflow reaches them).
    """

    def __init__(self, expected: int, load: float = LOAD):
        self.num_buckets = max(1, int(np.ceil(expected / (load * WIDTH))))
        if self.num_buckets * WIDTH >= 2**32:
            raise ValueError(f"{expected} keys need {self.num_buckets * WIDTH} slots; the limit is 2^32.")
        self.keys = np.full((self.num_buckets + _TAIL, WIDTH), EMPTY, dtype=np.uint64)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes

    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Inserts distinct keys not yet present; returns their slots (int64)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        slots = np.empty(len(keys), dtype=np.int64)
        done = 0
        while (done := _insert_all(self.keys, self.num_buckets, keys, slots, done)) < len(keys):
            self.keys = np.concatenate([self.keys, np.full((_TAIL, WIDTH), EMPTY, np.uint64)])
        return slots

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Slots of `keys` (int64), -1 where absent."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        slots = np.empty(len(keys), dtype=np.int64)
        _lookup_all(self.keys, self.num_buckets, keys, slots)
        return slots

    def lookup_one(self, key: int) -> int:
        """lookup() of one key as a Python int, for decoding a few sequences (K-1 keys per token): plain
        Python is cheaper than a call into compiled code with array arguments."""
        bucket = ((((key * _MIX_INT) & _MASK64) >> 32) * self.num_buckets) >> 32
        while True:
            row = self.keys[bucket].tolist()
            if key in row:
                return bucket * WIDTH + row.index(key)
            if row[-1] == _EMPTY_INT:
                return -1
            bucket += 1


def pair_keys(first: np.ndarray, last: np.ndarray, vocab_size: int) -> np.ndarray:
    """Keys of 2-grams (first, last)."""
    return first.astype(np.uint64) * np.uint64(vocab_size) + last.astype(np.uint64)


def extend_keys(prefix_id: np.ndarray, last: np.ndarray, vocab_size: int) -> np.ndarray:
    """Keys of (n+1)-grams: the n-gram with id `prefix_id` followed by `last`."""
    v = np.uint64(vocab_size)
    return (prefix_id.astype(np.uint64) + v) * v + last.astype(np.uint64)
