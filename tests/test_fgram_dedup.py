"""FgramBatcher against a plain per-shard reference, and the batch statistics on hand-checked values."""
import numpy as np
import pytest

from test_fgram_matcher import closure, make_vocab, planted_batch
from scone_jax.fgram import stats
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.matcher import Matcher


def reference_dedup(ids, vocab, num_shards, capacity):
    """Plain dicts: per shard, the unique f-grams that are no proper prefix of another one get
    rows; every matched position reads (row, length-1) of the first row that begins with it."""
    k = vocab.max_len
    rows = ids.shape[0] // num_shards
    tokens = np.zeros((num_shards * capacity, k), np.int32)
    lengths = np.zeros(num_shards * capacity, np.int32)
    index = np.full(ids.shape, -1, np.int32)
    as_tuple = {f: vocab.fgram(f) for f in range(vocab.num_fgrams)}
    for s in range(num_shards):
        block = ids[s * rows : (s + 1) * rows]
        unique = sorted(set(block[block >= 0].tolist()))
        grams = {as_tuple[f] for f in unique}
        maximal = [f for f in unique if not any(g != as_tuple[f] and g[: len(as_tuple[f])] == as_tuple[f] for g in grams)]
        slot = {}
        for u, fgram in enumerate(maximal):
            tokens[s * capacity + u] = vocab.tokens[fgram]
            lengths[s * capacity + u] = vocab.lengths[fgram]
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
    return vocab, Matcher(vocab), {"inputs": tokens, "segment_ids": segments}


@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_matches_reference(setup, num_shards):
    vocab, matcher, batch = setup
    out = FgramBatcher(matcher, vocab, num_shards=num_shards, capacity=200)(batch)
    ids = matcher.match(batch["inputs"], batch["segment_ids"])
    np.testing.assert_array_equal(out["fgram_ids"], ids)
    tokens, lengths, index = reference_dedup(ids, vocab, num_shards, 200)
    np.testing.assert_array_equal(out["fgram_tokens"], tokens)
    np.testing.assert_array_equal(out["fgram_lengths"], lengths)
    np.testing.assert_array_equal(out["fgram_index"], index)
    assert out["inputs"] is batch["inputs"] and (out["fgram_ids"] >= 0).mean() > 0.3
    assert (out["fgram_lengths"] > 0).sum() < (tokens_unique := out["fgram_unique"].sum())  # prefixes shared
    assert tokens_unique == sum(len(set(ids[s * (8 // num_shards):(s + 1) * (8 // num_shards)][
        ids[s * (8 // num_shards):(s + 1) * (8 // num_shards)] >= 0].tolist())) for s in range(num_shards))
    # What the model will see: each matched position's slot starts the tokens that end there.
    rows_per_shard = 8 // num_shards
    for (b, t), slot in np.ndenumerate(out["fgram_index"]):
        if slot >= 0:
            row, n = (b // rows_per_shard) * 200 + slot // 5, slot % 5 + 1
            assert n <= out["fgram_lengths"][row]
            assert out["fgram_tokens"][row, :n].tolist() == batch["inputs"][b, t - n + 1 : t + 1].tolist()


def test_capacity_overflow_names_the_fix(setup):
    vocab, matcher, batch = setup
    need = max((FgramBatcher(matcher, vocab, num_shards=2, capacity=200)(batch)["fgram_lengths"]
                .reshape(2, 200) > 0).sum(1))
    FgramBatcher(matcher, vocab, num_shards=2, capacity=need)(batch)  # exactly enough is fine
    with pytest.raises(ValueError, match=rf"needs {need} f-gram rows.*scone.fgram_capacity={need - 1}.*"
                                         rf"--config.scone.fgram_capacity=128 or more"):
        FgramBatcher(matcher, vocab, num_shards=2, capacity=need - 1)(batch)


def test_bad_shapes(setup):
    vocab, matcher, batch = setup
    with pytest.raises(ValueError, match="8 rows, which do not split into 3 equal data shards"):
        FgramBatcher(matcher, vocab, num_shards=3, capacity=10)(batch)
    with pytest.raises(ValueError, match="must both be >= 1"):
        FgramBatcher(matcher, vocab, num_shards=2, capacity=0)


def test_stats_by_hand():
    vocab = make_vocab([(1, 2), (2, 3), (1, 2, 3)], 3, 5)
    batch = {"inputs": np.array([[1, 2, 3, 1], [1, 2, 0, 0]], np.int32),
             "segment_ids": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)}
    out = FgramBatcher(Matcher(vocab), vocab, num_shards=2, capacity=4)(batch)
    # Row 0 matches (1 2) and (1 2 3); row 1 matches (1 2): 3 matched of 6 real positions.
    assert out["fgram_ids"].tolist() == [[-1, 0, 2, -1], [-1, 0, -1, -1]]
    assert stats.batch_stats(out, num_shards=2) == {
        "fgram/hit_rate": 0.5,
        "fgram/mean_matched_length": (2 + 3 + 2) / 3,
        "fgram/unique_ratio": 1.0,  # shard 0: 2 unique of 2 matched; shard 1: 1 of 1
        "fgram/row_ratio": 2 / 3,  # shard 0 runs only (1 2 3): (1 2) is its prefix
        "fgram/capacity_fill": 0.25,
    }
    assert out["fgram_index"].tolist() == [[-1, 1, 2, -1], [-1, 1, -1, -1]]  # slots row*3 + length-1
    out = FgramBatcher(Matcher(vocab), vocab, num_shards=1, capacity=4)(batch)
    assert stats.unique_ratio(out["fgram_index"], out["fgram_unique"]) == 2 / 3
    assert stats.row_ratio(out["fgram_index"], out["fgram_lengths"]) == 1 / 3
