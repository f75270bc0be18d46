"""Exact counting of uint64 keys with bounded memory: sorted runs spilled to disk, merged per partition.

A worker counts chunk after chunk in memory (a sort per chunk, then linear
merges of sorted arrays); once it holds more than `limit` distinct keys it writes
them out as a run, split into `NUM_PARTITIONS` hash partitions, sorted inside
each. The reduce step then merges one partition of every run at a time.
So memory is at most ~`limit` keys per worker while counting and one partition
of all runs while reducing (partitions are grouped into reduce tasks of about
`limit` entries), whatever the corpus size; disk holds the runs.
"""
from __future__ import annotations

import os

import numpy as np

from scone_jax.fgram.numba_loops import compiled

NUM_PARTITIONS = 256
_PARTITION_SHIFT = np.uint64(64 - 8)  # log2(NUM_PARTITIONS) high bits of the mixed key
_MIX = np.uint64(0xD6E8FEB86659FD93)  # odd constant, unrelated to the hash-table one


@compiled
def _merge_two(keys_a, counts_a, keys_b, counts_b, keys_out, counts_out):
    """Merges two sorted key arrays with counts, summing equal keys; returns the length written."""
    i = j = written = 0
    while i < len(keys_a) and j < len(keys_b):
        if keys_a[i] < keys_b[j]:
            keys_out[written], counts_out[written] = keys_a[i], counts_a[i]
            i += 1
        elif keys_b[j] < keys_a[i]:
            keys_out[written], counts_out[written] = keys_b[j], counts_b[j]
            j += 1
        else:
            keys_out[written], counts_out[written] = keys_a[i], counts_a[i] + counts_b[j]
            i += 1
            j += 1
        written += 1
    for k in range(i, len(keys_a)):
        keys_out[written], counts_out[written] = keys_a[k], counts_a[k]
        written += 1
    for k in range(j, len(keys_b)):
        keys_out[written], counts_out[written] = keys_b[k], counts_b[k]
        written += 1
    return written


def merge_counts(keys: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sums the counts of equal keys across arrays, each sorted with distinct keys; returns (sorted
    distinct keys, counts int64). Merges pairwise in rounds (like merge sort): linear per round."""
    pairs = [(np.ascontiguousarray(k, np.uint64), np.ascontiguousarray(c, np.int64)) for k, c in zip(keys, counts)]
    if not pairs:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    while len(pairs) > 1:
        merged = []
        for (keys_a, counts_a), (keys_b, counts_b) in zip(pairs[::2], pairs[1::2]):
            keys_out = np.empty(len(keys_a) + len(keys_b), np.uint64)
            counts_out = np.empty(len(keys_out), np.int64)
            written = _merge_two(keys_a, counts_a, keys_b, counts_b, keys_out, counts_out)
            merged.append((keys_out[:written], counts_out[:written]))
        pairs = merged + pairs[len(merged) * 2:]
    merged_keys, merged_counts = pairs[0]
    if len(keys) > 1 and merged_keys.size < merged_keys.base.size:
        # A prefix of the last merge buffer (equal keys were summed): copying it frees the rest, or
        # the counts a RunWriter holds could take up to twice their size.
        merged_keys, merged_counts = merged_keys.copy(), merged_counts.copy()
    return merged_keys, merged_counts


def partition_of(keys: np.ndarray) -> np.ndarray:
    return ((keys * _MIX) >> _PARTITION_SHIFT).astype(np.uint8)


class RunWriter:
    """Counts keys chunk by chunk; spills partitioned runs `<prefix>-<k>.{keys,counts,bounds}.npy`."""

    def __init__(self, prefix: str, limit: int):
        self._prefix, self._limit = prefix, limit
        self._keys: list[np.ndarray] = []
        self._counts: list[np.ndarray] = []
        self._held = 0
        self.runs: list[str] = []

    def add(self, keys: np.ndarray) -> None:
        unique, counts = np.unique(keys, return_counts=True)
        self._keys.append(unique)
        self._counts.append(counts.astype(np.int64))
        self._held += len(unique)
        if self._held > self._limit:
            merged = merge_counts(self._keys, self._counts)
            self._keys, self._counts, self._held = [merged[0]], [merged[1]], len(merged[0])
            if self._held > self._limit // 2:
                self.flush()

    def flush(self) -> list[str]:
        """Writes what is held as one run; returns all run paths so far."""
        if self._held:
            keys, counts = merge_counts(self._keys, self._counts)
            part = partition_of(keys)
            order = np.argsort(part, kind="stable")  # keeps keys sorted inside each partition
            bounds = np.r_[0, np.cumsum(np.bincount(part, minlength=NUM_PARTITIONS))]
            path = f"{self._prefix}-{len(self.runs)}"
            np.save(path + ".keys.npy", keys[order])
            np.save(path + ".counts.npy", counts[order])
            np.save(path + ".bounds.npy", bounds)
            self.runs.append(path)
        self._keys, self._counts, self._held = [], [], 0
        return self.runs


def group_partitions(runs: list[str], limit: int) -> list[tuple[int, int]]:
    """Consecutive partition ranges [lo, hi) holding about `limit` spilled entries each (one reduce task each)."""
    sizes = sum(np.diff(np.load(run + ".bounds.npy")) for run in runs) if runs else np.zeros(NUM_PARTITIONS, int)
    groups, lo, held = [], 0, 0
    for p, size in enumerate(sizes):
        if held and held + size > limit:
            groups.append((lo, p))
            lo, held = p, 0
        held += int(size)
    return groups + [(lo, NUM_PARTITIONS)]


def reduce_partitions(runs: list[str], lo: int, hi: int, threshold: int) -> tuple[np.ndarray, np.ndarray]:
    """Total counts of the keys in partitions [lo, hi) over all runs, keeping counts >= threshold;
    returns (sorted keys, counts)."""
    bounds = [np.load(run + ".bounds.npy") for run in runs]
    files = [(np.load(run + ".keys.npy", mmap_mode="r"), np.load(run + ".counts.npy", mmap_mode="r")) for run in runs]
    kept_keys, kept_counts = [], []
    for p in range(lo, hi):  # a run is sorted inside each partition only
        keys, counts = merge_counts([k[b[p]:b[p + 1]] for (k, _), b in zip(files, bounds)],
                                    [c[b[p]:b[p + 1]] for (_, c), b in zip(files, bounds)])
        keep = counts >= threshold
        kept_keys.append(keys[keep])
        kept_counts.append(counts[keep])
    keys = np.concatenate(kept_keys) if kept_keys else np.zeros(0, np.uint64)
    counts = np.concatenate(kept_counts) if kept_counts else np.zeros(0, np.int64)
    order = np.argsort(keys)
    return keys[order], counts[order]


def remove_runs(runs: list[str]) -> None:
    for run in runs:
        for part in ("keys", "counts", "bounds"):
            os.remove(f"{run}.{part}.npy")
