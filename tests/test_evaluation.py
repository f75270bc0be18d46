"""training/evaluation.py, the one held-out loop of training and serving, on hand-made batches: sums in float64 in
batch order, at most max_batches, hit rate over real positions only, bits per byte only with the byte count.
(That it gives the training graph's perplexity from table rows: tests/test_evaluate.py.)"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scone_jax import sharding
from scone_jax.batch import Batch
from scone_jax.training import evaluation
from tests.common import small_config

ROWS, LENGTH = 8, 4


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(small_config().mesh)


def make_batch(value: float, real: int) -> Batch:
    """A batch whose first `real` positions of each row are a document (the rest padding), with inputs 1..."""
    segment_ids = (np.arange(LENGTH) < real).astype(np.int32)[None].repeat(ROWS, 0)
    inputs = (np.arange(ROWS * LENGTH, dtype=np.int32).reshape(ROWS, LENGTH) + 1) * segment_ids
    loss_mask = np.where(segment_ids > 0, np.float32(value), np.float32(0))  # each position's "loss", summed below
    return Batch(inputs=inputs, targets=inputs, segment_ids=segment_ids, positions=np.zeros_like(inputs),
                 loss_mask=loss_mask)


@jax.jit
def step(batch):
    """A stand-in eval step: (sum of the mask as the loss sum, number of real positions as the token count)."""
    return jnp.sum(batch.loss_mask), jnp.sum(batch.segment_ids > 0).astype(jnp.float32)


def matches(batch: Batch) -> Batch:
    """A row provider: an f-gram id at every position whose input is not 1 modulo 3 (padding's 0 included)."""
    return batch.replace(fgram_ids=np.where(batch.inputs % 3 == 1, -1, batch.inputs).astype(np.int32))


def test_sums_are_float64_in_batch_order_and_stop_at_max_batches(mesh):
    """Loss sums 2**25 and 1 per batch: float64 keeps the 1 that a float32 total loses, and the third batch is
    not read with max_batches=2. Catches (tried): totals added as float32 (a loss of 2**25 / 48); range(count + 1)
    feeding one batch too many (3 batches, 56 tokens)."""
    batches = [make_batch(2.0 ** 25 / (ROWS * 4), 4), make_batch(1 / (ROWS * 2), 2), make_batch(5.0, 1)]
    result = evaluation.evaluate(step, batches, mesh, max_batches=2)
    assert (result["batches"], result["tokens"]) == (2, ROWS * 4 + ROWS * 2)
    assert result["loss"] == (2 ** 25 + 1) / 48
    assert result["perplexity"] == math.exp(50)  # capped (model/losses.py)
    assert result["hit_rate"] is None and result["bytes"] == 0 and result["bits_per_byte"] is None
    assert result["tokens_per_s"] > 0  # timed from the second batch
    everything = evaluation.evaluate(step, batches, mesh)
    assert (everything["batches"], everything["tokens"]) == (3, ROWS * 7)


def test_hit_rate_counts_real_positions_and_bits_per_byte_needs_the_byte_count(mesh):
    """Rows from a provider: the hit rate is the share of real positions (not padding) with an f-gram id; bits per
    byte is the total loss in bits over the bytes given. Catches (tried): hits counted over every position
    (padding's 16 positions match too: 27 hits over 16 real positions)."""
    batch = make_batch(0.5, 2)
    ids = matches(batch).fgram_ids[batch.segment_ids > 0]
    result = evaluation.evaluate(step, [batch], mesh, rows=matches, num_bytes=40)
    assert result["hit_rate"] == np.mean(ids >= 0) == 11 / 16
    assert (result["tokens"], result["loss"], result["bytes"]) == (16, 0.5, 40)
    assert result["bits_per_byte"] == pytest.approx(0.5 * 16 / math.log(2) / 40)
    assert result["tokens_per_s"] is None  # one batch: it compiled, nothing left to time


def test_an_error_preparing_a_batch_reaches_the_caller(mesh):
    """A row provider that fails (a worker's bad document, a damaged table block) raises in the caller, as
    training's EvaluationError and serving's one-line error need. Catches (tried): Prefetcher swallowing the
    error (the loop ending early with the batches before it)."""
    def broken(batch):
        if batch.loss_mask.max() == 3.0:
            raise ValueError("table rows 64..127 are damaged")
        return matches(batch)

    with pytest.raises(ValueError, match="table rows 64..127 are damaged"):
        evaluation.evaluate(step, [make_batch(1.0, 4), make_batch(3.0, 4)], mesh, rows=broken)
