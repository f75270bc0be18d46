"""The f-gram rows per data shard and step (scone.fgram_capacity) a run's batches need, measured from its data.

The capacity is a static shape (fgram/dedup.py), so a batch that needs more rows stops the run. Found at the batch
that overflows, that stop came minutes or hours in (after compiling, and with a checkpoint the user then had to
resume with a changed key); so before the first step the loop builds a sample of the batches it will train on,
spread over its steps, and refuses a capacity that one of them overflows in one line naming the value to set
(SAMPLE batches from the first to the last; the rest are still checked as they are built). The capacity changes
no value the model computes (dedup.py pads the unused rows), so a resume may raise it freely
(config_keys: a SETTING).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from scone_jax.batch import Batch
from scone_jax.fgram.dedup import CAPACITY_KEY, FgramBatcher

SAMPLE = 64  # batches checked before the first step
HEADROOM = 1.25  # the suggested capacity over the sample's largest need: batches outside the sample may need more


def sample_batches(first: int, last: int, sample: int = SAMPLE) -> list[int]:
    """Up to `sample` batch numbers spread evenly over first..last (both included), the first and last among them."""
    if last < first:
        return []
    return sorted({int(b) for b in np.linspace(first, last, min(sample, last - first + 1)).round()})


def needed(batcher: FgramBatcher, rows_of: Callable[[int], Batch], batch_numbers: list[int]) -> tuple[int, int]:
    """(the most f-gram rows one group of `batcher` needs in the batches `batch_numbers`, the first batch that needs
    them); rows_of(b) is batch b before any transform. Measured with the batcher's own matching and dedup at a
    capacity no group can overflow."""
    per_group = None
    worst, where = 0, batch_numbers[0] if batch_numbers else 0
    for b in batch_numbers:
        batch = rows_of(b)
        if per_group is None:  # every position of a group as its own row: more than any group can need
            positions = batch.inputs.size // batcher.num_groups
            per_group = FgramBatcher(batcher.matcher, batcher.vocab, num_shards=batcher.num_shards,
                                     capacity=positions * batcher.micro_batches, micro_batches=batcher.micro_batches)
        need = int((per_group(batch).fgram_lengths > 0).sum(axis=1).max(initial=0))
        if need > worst:
            worst, where = need, b
    return worst, where


def suggested(need: int, micro_batches: int = 1) -> int:
    """A capacity for groups that need `need` rows: HEADROOM more, split evenly into micro-batches, rounded up to
    a multiple of 128 per micro-batch."""
    step = 128 * micro_batches
    return int(math.ceil(need * HEADROOM * micro_batches / step) * step)


def check(batcher: FgramBatcher, rows_of: Callable[[int], Batch], first: int, last: int) -> None:
    """ValueError in one line if a sampled batch of first..last needs more rows than the batcher holds."""
    batches = sample_batches(first, last)
    need, where = needed(batcher, rows_of, batches)
    if need > batcher.group_capacity:
        a = batcher.micro_batches
        share = f" / {a} micro-batches" if a > 1 else ""
        raise ValueError(
            f"{CAPACITY_KEY}={batcher.capacity}{share} is too small for this run's data: batch {where} (one of "
            f"{len(batches)} checked before the first step, spread over batches {first}..{last}) needs {need} f-gram "
            f"rows in one data shard{' and micro-batch' if a > 1 else ''}. Fix: rerun with "
            f"--config.{CAPACITY_KEY}={suggested(need, a)} (a resume accepts the new value).")
