"""F-gram figures for a batch (from FgramBatcher's arrays): what training logs and the extractor reports.

hit rate             matched positions / real positions (segment id != 0)
mean matched length  average f-gram length over matched positions
unique ratio         unique f-grams (summed over groups) / matched positions: the f-gram model's work
                     with per-group deduplication, relative to running it once per matched position
row ratio            f-gram model rows actually run (maximal f-grams, after prefix sharing) / matched
                     positions
capacity fill        the fullest group's rows / its capacity: how close a batch came to the limit
(a group is a data shard, or a data shard's micro-batch with gradient accumulation)
"""
from __future__ import annotations

import numpy as np


def hit_rate(fgram_slot: np.ndarray, segment_ids: np.ndarray) -> float:
    real = segment_ids != 0
    return float((fgram_slot[real] >= 0).sum() / max(1, real.sum()))


def matched_lengths(fgram_slot: np.ndarray, max_len: int) -> np.ndarray:
    """Length of the f-gram at each matched position (1-D, row-major): slots are row*K + length-1."""
    return fgram_slot[fgram_slot >= 0] % max_len + 1


def mean_matched_length(fgram_slot: np.ndarray, max_len: int) -> float:
    lengths = matched_lengths(fgram_slot, max_len)
    return float(lengths.mean()) if len(lengths) else 0.0


def unique_ratio(fgram_slot: np.ndarray, fgram_unique: np.ndarray) -> float:
    return float(fgram_unique.sum() / max(1, (fgram_slot >= 0).sum()))


def row_ratio(fgram_slot: np.ndarray, fgram_lengths: np.ndarray) -> float:
    return float((fgram_lengths > 0).sum() / max(1, (fgram_slot >= 0).sum()))


def capacity_fill(fgram_lengths: np.ndarray) -> float:
    """fgram_lengths [groups, capacity] -> the fullest group's share of its capacity."""
    return float((fgram_lengths > 0).sum(axis=1).max() / fgram_lengths.shape[1])


def batch_stats(batch) -> dict[str, float]:
    """The figures for a Batch that went through FgramBatcher."""
    index, lengths = batch.fgram_slot, batch.fgram_lengths
    return {
        "fgram/hit_rate": hit_rate(index, batch.segment_ids),
        "fgram/mean_matched_length": mean_matched_length(index, batch.fgram_tokens.shape[-1]),
        "fgram/unique_ratio": unique_ratio(index, batch.fgram_unique),
        "fgram/row_ratio": row_ratio(index, lengths),
        "fgram/capacity_fill": capacity_fill(lengths),
    }
