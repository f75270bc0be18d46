"""Spilled counting == collections.Counter: merges, spills into runs, and the per-partition reduce."""
from collections import Counter

import numpy as np
import pytest

from scone_jax.fgram import counting


def test_merge_counts_sums_equal_keys_and_sorts():
    rng = np.random.default_rng(0)
    keys, counts, want = [], [], Counter()
    for size in (0, 1, 7, 40, 40, 300):  # an odd number of inputs and an empty one
        k = np.unique(rng.integers(0, 200, size=size).astype(np.uint64))
        c = rng.integers(1, 9, size=len(k))
        keys.append(k)
        counts.append(c)
        want.update(dict(zip(k.tolist(), c.tolist())))
    got_keys, got_counts = counting.merge_counts(keys, counts)
    assert got_keys.tolist() == sorted(want) and got_counts.tolist() == [want[k] for k in sorted(want)]
    assert (got_keys.dtype, got_counts.dtype) == (np.uint64, np.int64)
    empty = counting.merge_counts([], [])
    assert len(empty[0]) == len(empty[1]) == 0


@pytest.mark.parametrize("limit", [50, 400, 10**6])  # many spills, a few, none
def test_runs_reduce_to_exact_counts(tmp_path, limit):
    rng = np.random.default_rng(limit)
    writer = counting.RunWriter(str(tmp_path / "run"), limit)
    want = Counter()
    for _ in range(12):
        keys = (rng.zipf(1.3, size=997) * 0x9E3779B9).astype(np.uint64)  # skewed, spread over 64 bits
        want.update(keys.tolist())
        writer.add(keys)
    runs = writer.flush()
    assert (len(runs) == 1) == (limit == 10**6)
    threshold = 3
    groups = counting.group_partitions(runs, limit)
    assert groups[0][0] == 0 and groups[-1][1] == counting.NUM_PARTITIONS
    parts = [counting.reduce_partitions(runs, lo, hi, threshold) for lo, hi in groups]
    keys, counts = counting.merge_counts([k for k, _ in parts], [c for _, c in parts])
    expected = sorted(k for k, c in want.items() if c >= threshold)
    assert keys.tolist() == expected and counts.tolist() == [want[k] for k in expected]
    counting.remove_runs(runs)
    assert not list(tmp_path.iterdir())
