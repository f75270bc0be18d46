"""The hash table under the matcher: both lookup paths == a Python dict, overflowing buckets included."""
import numpy as np
import pytest

from scone_jax.fgram import trie


@pytest.mark.parametrize("load", [0.6, 0.99])  # 0.99: most buckets full, many keys live one or more buckets on
def test_lookups_equal_a_dict(load):
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 2**63, size=3000, dtype=np.uint64))
    table = trie.KeyTable(len(keys), load=load)
    slots = table.insert(keys)
    assert len(set(slots.tolist())) == len(keys)
    overflowed = (slots // trie.WIDTH) != [trie.home(k, table.num_buckets) for k in keys]
    assert overflowed.mean() > (0.1 if load > 0.9 else 0.0)
    reference = dict(zip(keys.tolist(), slots.tolist()))
    absent = rng.integers(0, 2**63, size=3000, dtype=np.uint64)
    queries = np.concatenate([keys, absent, keys[overflowed]])
    want = np.array([reference.get(k, -1) for k in queries.tolist()])
    np.testing.assert_array_equal(table.lookup(queries), want)
    np.testing.assert_array_equal([table.lookup_one(k) for k in queries.tolist()], want)


def test_overflow_past_the_end_grows_the_table():
    """More keys than the table was sized for: overflow runs into the tail, which grows; every key stays found."""
    keys = np.arange(1, 41, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 % 2**40)
    table = trie.KeyTable(4, load=1.0)  # one bucket of 4 slots for 40 keys
    rows_before = table.keys.shape[0]
    slots = table.insert(keys)
    assert table.keys.shape[0] > rows_before and len(set(slots.tolist())) == len(keys)
    assert (table.keys[-2:] == trie.EMPTY).all()
    np.testing.assert_array_equal(table.lookup(keys), slots)
    assert [table.lookup_one(int(k)) for k in keys] == slots.tolist()
    assert table.lookup(np.array([7], np.uint64)).tolist() == [-1]
