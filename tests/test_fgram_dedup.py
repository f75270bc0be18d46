"""FgramBatcher against a plain per-shard reference, and the batch statistics on hand-checked values."""
import numpy as np
import pytest
from test_fgram_matcher import closure, make_vocab, planted_batch

from scone_jax.batch import Batch
from scone_jax.fgram import stats
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.matcher import Matcher


def reference_dedup(ids, vocab, num_groups, capacity):
    """Plain dicts: per group of contiguous rows, the unique f-grams that are no proper prefix of
    another one get rows; every matched position reads (row, length-1) of the first row that
    begins with it."""
    k = vocab.max_len
    rows = ids.shape[0] // num_groups
    tokens = np.zeros((num_groups, capacity, k), np.int32)
    lengths = np.zeros((num_groups, capacity), np.int32)
    index = np.full(ids.shape, -1, np.int32)
    as_tuple = {f: vocab.fgram(f) for f in range(vocab.num_fgrams)}
    for s in range(num_groups):
        block = ids[s * rows : (s + 1) * rows]
        unique = sorted(set(block[block >= 0].tolist()))
        grams = {as_tuple[f] for f in unique}
        maximal = [f for f in unique if not any(g != as_tuple[f] and g[: len(as_tuple[f])] == as_tuple[f] for g in grams)]
        slot = {}
        for u, fgram in enumerate(maximal):
            tokens[s, u] = vocab.tokens[fgram]
            lengths[s, u] = vocab.lengths[fgram]
        for f in unique:
            u = next(u for u, m in enumerate(maximal) if as_tuple[m][: len(as_tuple[f])] == as_tuple[f])
            slot[f] = u * k + len(as_tuple[f]) - 1
        for (b, t), fgram in np.ndenumerate(block):
            if fgram >= 0:
                index[s * rows + b, t] = slot[fgram]
    return tokens, lengths, index


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(3)
    grams = closure([list(rng.integers(12, size=rng.integers(2, 6))) for _ in range(30)])
    vocab = make_vocab(grams, 5, 12)
    tokens, segments = planted_batch(rng, grams, 12, batch=8, length=40)
    return vocab, Matcher(vocab), Batch(inputs=tokens, segment_ids=segments)


@pytest.mark.parametrize("num_shards,micro_batches", [(1, 1), (2, 1), (4, 1), (8, 1), (1, 4), (2, 2), (4, 2)])
def test_matches_reference(setup, num_shards, micro_batches):
    """Catches a slot pointing at the next row of its group, groups cut per shard instead of per
    (shard, micro-batch), a prefix read one position early from the matcher's suffixes, and rows'
    tokens not written (all seen to fail here)."""
    vocab, matcher, batch = setup
    capacity = 200 * micro_batches
    out = FgramBatcher(matcher, vocab, num_shards=num_shards, capacity=capacity, micro_batches=micro_batches)(batch)
    groups = num_shards * micro_batches
    ids = matcher.match(batch.inputs, batch.segment_ids)
    np.testing.assert_array_equal(out.fgram_ids, ids)
    tokens, lengths, index = reference_dedup(ids, vocab, groups, 200)
    np.testing.assert_array_equal(out.fgram_tokens, tokens)
    np.testing.assert_array_equal(out.fgram_lengths, lengths)
    np.testing.assert_array_equal(out.fgram_slot, index)
    assert out.inputs is batch.inputs and (out.fgram_ids >= 0).mean() > 0.3
    assert (out.fgram_lengths > 0).sum() < (tokens_unique := out.fgram_unique.sum())  # prefixes shared
    per = 8 // groups
    assert tokens_unique == sum(len(set(ids[g * per:(g + 1) * per][ids[g * per:(g + 1) * per] >= 0].tolist()))
                                for g in range(groups))
    # What the model will see: each matched position's slot starts the tokens that end there.
    for (b, t), slot in np.ndenumerate(out.fgram_slot):
        if slot >= 0:
            group, row, n = b // per, slot // 5, slot % 5 + 1
            assert n <= out.fgram_lengths[group, row]
            assert out.fgram_tokens[group, row, :n].tolist() == batch.inputs[b, t - n + 1 : t + 1].tolist()


def test_capacity_overflow_names_the_fix(setup):
    vocab, matcher, batch = setup
    need = max((FgramBatcher(matcher, vocab, num_shards=2, capacity=200)(batch).fgram_lengths > 0).sum(1))
    FgramBatcher(matcher, vocab, num_shards=2, capacity=need)(batch)  # exactly enough is fine
    with pytest.raises(ValueError, match=rf"needs {need} f-gram rows.*scone.fgram_capacity={need - 1}.*"
                                         rf"--config.scone.fgram_capacity=128 or more"):
        FgramBatcher(matcher, vocab, num_shards=2, capacity=need - 1)(batch)


def test_capacity_overflow_of_a_micro_batch_names_the_per_step_fix(setup):
    vocab, matcher, batch = setup
    out = FgramBatcher(matcher, vocab, num_shards=2, capacity=400, micro_batches=2)(batch)
    need = (out.fgram_lengths > 0).sum(1)
    group = int(np.argmax(need))
    with pytest.raises(ValueError, match=rf"Data shard {group // 2}, micro-batch {group % 2}, needs {need.max()} "
                                         rf"f-gram rows.*fgram_capacity={2 * need.max() - 2} / 2 micro-batches"):
        FgramBatcher(matcher, vocab, num_shards=2, capacity=2 * need.max() - 2, micro_batches=2)(batch)


def test_bad_shapes(setup):
    vocab, matcher, batch = setup
    with pytest.raises(ValueError, match="8 rows, which do not split into 3 equal data shards"):
        FgramBatcher(matcher, vocab, num_shards=3, capacity=10)(batch)
    with pytest.raises(ValueError, match="8 rows, which do not split into 2 equal data shards of 3 micro-batches"):
        FgramBatcher(matcher, vocab, num_shards=2, capacity=30, micro_batches=3)(batch)
    with pytest.raises(ValueError, match="must all be >= 1"):
        FgramBatcher(matcher, vocab, num_shards=2, capacity=0)
    with pytest.raises(ValueError, match="capacity=10 does not split into 4 equal micro-batches"):
        FgramBatcher(matcher, vocab, num_shards=2, capacity=10, micro_batches=4)


def test_stats_by_hand():
    vocab = make_vocab([(1, 2), (2, 3), (1, 2, 3)], 3, 5)
    batch = Batch(inputs=np.array([[1, 2, 3, 1], [1, 2, 0, 0]], np.int32),
                  segment_ids=np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32))
    out = FgramBatcher(Matcher(vocab), vocab, num_shards=2, capacity=4)(batch)
    # Row 0 matches (1 2) and (1 2 3); row 1 matches (1 2): 3 matched of 6 real positions.
    assert out.fgram_ids.tolist() == [[-1, 0, 2, -1], [-1, 0, -1, -1]]
    assert stats.batch_stats(out) == {
        "fgram/hit_rate": 0.5,
        "fgram/mean_matched_length": (2 + 3 + 2) / 3,
        "fgram/unique_ratio": 1.0,  # shard 0: 2 unique of 2 matched; shard 1: 1 of 1
        "fgram/row_ratio": 2 / 3,  # shard 0 runs only (1 2 3): (1 2) is its prefix
        "fgram/capacity_fill": 0.25,
    }
    assert out.fgram_slot.tolist() == [[-1, 1, 2, -1], [-1, 1, -1, -1]]  # slots row*3 + length-1
    out = FgramBatcher(Matcher(vocab), vocab, num_shards=1, capacity=4)(batch)
    assert stats.unique_ratio(out.fgram_slot, out.fgram_unique) == 2 / 3
    assert stats.row_ratio(out.fgram_slot, out.fgram_lengths) == 1 / 3


def test_a_batch_without_matches_has_no_rows_and_no_slots():
    """A batch in which no f-gram occurs (the old code crashed here: an empty prefix lookup)."""
    vocab = make_vocab([(1, 2), (2, 3), (1, 2, 3)], 3, 5)
    batch = Batch(inputs=np.array([[4, 4, 4, 4], [0, 0, 0, 0]], np.int32),
                  segment_ids=np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32))
    out = FgramBatcher(Matcher(vocab), vocab, num_shards=2, capacity=4)(batch)
    assert (out.fgram_ids == -1).all() and (out.fgram_slot == -1).all()
    assert out.fgram_tokens.shape == (2, 4, 3) and not out.fgram_lengths.any()
    assert out.fgram_unique.tolist() == [0, 0]
