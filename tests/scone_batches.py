"""Production-layout SCONE batches for the model and training tests: planted f-grams in
packed rows, run through the real FgramBatcher for a given shard count, capacity and
number of micro-batches (the same host batch for every layout, per seed)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from test_fgram_matcher import closure, make_vocab, planted_batch

from scone_jax.batch import Batch
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.matcher import Matcher

K = 4
ROWS, SEQ = 16, 32


@functools.lru_cache(maxsize=None)
def planted_grams(seed: int = 0) -> tuple:
    """A closed f-gram set over tokens 300..339 (the model's vocabulary is 512, so rows of T
    used only inside f-grams are identifiable)."""
    rng = np.random.default_rng(seed)
    return tuple(closure([list(300 + rng.integers(40, size=rng.integers(2, K + 1))) for _ in range(14)]))


def host_batch(seed: int = 0) -> dict:
    """A pipeline-shaped batch (packed documents, padding at row ends) of planted f-grams."""
    rng = np.random.default_rng(1000 + seed)
    tokens, segments = planted_batch(rng, list(planted_grams()), 300, batch=ROWS, length=SEQ + 1)
    segments[:, 0] = np.maximum(segments[:, 0], 1)  # every row holds at least one real token
    seg_in, seg_out = segments[:, :-1], segments[:, 1:]
    start = np.concatenate([np.ones((ROWS, 1), bool), seg_in[:, 1:] != seg_in[:, :-1]], axis=1)
    positions = np.arange(SEQ)[None] - np.maximum.accumulate(np.where(start, np.arange(SEQ)[None], 0), axis=1)
    return Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg_in,
                 positions=positions.astype(np.int32),
                 loss_mask=((seg_in > 0) & (seg_out == seg_in)).astype(np.float32))


def production_batch(num_shards, capacity, micro_batches=1, seed=0):
    """host_batch(seed) through the production FgramBatcher (per-group dedup + prefix sharing).
    Returns (batch with f-gram arrays, vocabulary)."""
    vocab = make_vocab(list(planted_grams()), K, 512)
    batcher = FgramBatcher(Matcher(vocab), vocab, num_shards=num_shards, capacity=capacity,
                           micro_batches=micro_batches)
    return batcher(host_batch(seed)), vocab


def device_arrays(batch):
    """What the train step receives (host-only fields dropped), as jax arrays."""
    return jax.tree.map(jnp.asarray, batch.for_device())
