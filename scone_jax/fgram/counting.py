"""Exact counting of uint64 keys with bounded memory: sorted runs spilled to disk, merged per partition.

A worker counts chunk after chunk in memory; once it holds more than `limit`
distinct keys it writes them out as a run, split into `NUM_PARTITIONS` hash
partitions. The reduce step then merges one partition of every run at a time.
So memory is at most ~`limit` keys per worker while counting and one partition
of all runs while reducing (partitions are grouped into reduce tasks of about
`limit` entries), whatever the corpus size; disk holds the runs.
"""
from __future__ import annotations

import os

import numpy as np

NUM_PARTITIONS = 256
_PARTITION_SHIFT = np.uint64(64 - 8)  # log2(NUM_PARTITIONS) high bits of the mixed key
_MIX = np.uint64(0xD6E8FEB86659FD93)  # odd constant, unrelated to the hash-table one


def merge_counts(keys: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sums the counts of equal keys across arrays; returns (sorted unique keys, counts int64)."""
    all_keys = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    if not len(all_keys):
        return all_keys, np.zeros(0, np.int64)
    order = np.argsort(all_keys)
    all_keys = all_keys[order]
    all_counts = np.concatenate(counts).astype(np.int64)[order]
    starts = np.flatnonzero(np.r_[True, all_keys[1:] != all_keys[:-1]])
    return all_keys[starts], np.add.reduceat(all_counts, starts)


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
    """Total counts of the keys in partitions [lo, hi) over all runs, keeping counts >= threshold."""
    keys, counts = [], []
    for run in runs:
        start, stop = np.load(run + ".bounds.npy")[[lo, hi]]
        keys.append(np.load(run + ".keys.npy", mmap_mode="r")[start:stop])
        counts.append(np.load(run + ".counts.npy", mmap_mode="r")[start:stop])
    keys, counts = merge_counts(keys, counts)
    keep = counts >= threshold
    return keys[keep], counts[keep]


def remove_runs(runs: list[str]) -> None:
    for run in runs:
        for part in ("keys", "counts", "bounds"):
            os.remove(f"{run}.{part}.npy")
