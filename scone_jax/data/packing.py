"""Concatenate-then-split packing, computed per batch from document lengths alone.

A process's documents form one endless stream of examples: document i (token ids t_1..t_n)
becomes n+1 positions with inputs [bos, t_1..t_n] and targets [t_1..t_n, eos]; with
data.add_bos=False (models trained without a bos, as Qwen) n positions, inputs [t_1..t_n] and
targets [t_2..t_n, eos] (a document of no tokens has none). Epoch e
visits the process's documents in its own shuffled order; epochs follow each other without
a gap. Rows of seq_len positions are cut from the stream back to back, and batch b is rows
b*R .. b*R+R-1, i.e. stream positions [b*R*T, (b+1)*R*T). So a batch is a pure function of
its index: any worker can build any batch, the batches do not depend on how many workers
build them, and resuming needs only the index of the next batch.

Inside a row, each piece of a document gets segment id 1, 2, ... in order, positions count
from 0 at the start of every piece (also a document continued from the previous row), and
every position of a piece has its target (the loss mask is 1 on all of them). Only a finite
stream (evaluation) pads its last row: segment 0, pad ids, loss mask 0.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from scone_jax.batch import Batch


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The documents a window of the stream touches, in stream order: local document numbers,
    and the first position used of the first one (the others start at their beginning)."""

    docs: np.ndarray  # int64 [m]
    first_offset: int


class Stream:
    """One process's endless stream of examples over its documents (module docstring).

    `example_lengths[i]` = positions of local document i (example_lengths). Epoch e's order is a permutation
    drawn from (seed, e) alone (seed: an int, or a tuple of ints such as a mixture component's
    (shuffle_seed, component)); seed=None keeps the documents in their given order (eval)."""

    def __init__(self, example_lengths: np.ndarray, seed: int | tuple[int, ...] | None):
        self.lengths = np.asarray(example_lengths, np.int64)
        if (self.lengths < 0).any() or self.lengths.sum() < 1:
            raise ValueError("a stream needs documents of at least one position in all")
        self.seed = seed
        self.epoch_positions = int(self.lengths.sum())
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative end position of each document in that order)."""
        if epoch not in self._epochs:
            if self.seed is None:
                order = np.arange(len(self.lengths))
            else:
                seed = list(self.seed) if isinstance(self.seed, tuple) else [self.seed]
                order = np.random.default_rng([*seed, epoch]).permutation(len(self.lengths))
            if len(self._epochs) > 2:  # a worker walks forward: keep the last few epochs only
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (order, np.cumsum(self.lengths[order]))
        return self._epochs[epoch]

    def pieces(self, start: int, stop: int) -> Pieces:
        """The documents covering stream positions [start, stop)."""
        size = self.epoch_positions
        docs, first_offset = [], None
        for epoch in range(start // size, (stop - 1) // size + 1):
            lo, hi = max(start, epoch * size) - epoch * size, min(stop, (epoch + 1) * size) - epoch * size
            order, ends = self._epoch(epoch)
            first = int(np.searchsorted(ends, lo, side="right"))
            last = int(np.searchsorted(ends, hi - 1, side="right"))
            if first_offset is None:
                first_offset = lo - int(ends[first] - self.lengths[order[first]])
            docs.append(order[first:last + 1])
        return Pieces(np.concatenate(docs).astype(np.int64), first_offset)


def example_lengths(doc_lengths: np.ndarray, bos: int | None) -> np.ndarray:
    """Stream positions of documents of `doc_lengths` tokens: one more each for a bos."""
    return np.asarray(doc_lengths, np.int64) + (bos is not None)


def examples(ids: np.ndarray, lengths: np.ndarray, bos: int | None, eos: int):
    """Token ids of consecutive documents (flat, with their lengths) -> their examples back to
    back: (inputs, targets, starts), starts = True at each example's first position. bos None:
    no bos (data.add_bos=False), each document's inputs are its ids."""
    lengths = np.asarray(lengths, np.int64)
    sizes = example_lengths(lengths, bos)
    total = int(sizes.sum())
    begin = np.zeros(len(lengths), np.int64)
    np.cumsum(sizes[:-1], out=begin[1:])
    starts = np.zeros(total, bool)
    starts[begin[sizes > 0]] = True
    ends = np.zeros(total, bool)
    ends[(begin + sizes - 1)[sizes > 0]] = True
    targets = np.empty(total, np.int32)
    targets[ends] = eos
    if bos is None:
        inputs = np.asarray(ids, np.int32).copy()
        targets[:-1][~ends[:-1]] = inputs[1:][~ends[:-1]]  # the next id, inside the document
        return inputs, targets, starts
    inputs = np.empty(total, np.int32)
    inputs[starts] = bos
    inputs[~starts] = ids
    targets[~ends] = ids
    return inputs, targets, starts


def rows(inputs: np.ndarray, targets: np.ndarray, starts: np.ndarray, num_rows: int, seq_len: int,
         pad_id: int) -> Batch:
    """A window of the stream ([num_rows * seq_len] positions, or fewer at the end of a finite
    stream) -> the batch [num_rows, seq_len], padding after the last real position."""
    size = num_rows * seq_len
    real = len(inputs)
    if real < size:
        pad = size - real
        inputs = np.concatenate([inputs, np.full(pad, pad_id, np.int32)])
        targets = np.concatenate([targets, np.full(pad, pad_id, np.int32)])
        starts = np.concatenate([starts, np.zeros(pad, bool)])
    live = (np.arange(size) < real).reshape(num_rows, seq_len)
    piece_start = starts.reshape(num_rows, seq_len).copy()
    piece_start[:, 0] = True  # a document continued from the previous row is a new piece
    segment_ids = np.cumsum(piece_start, axis=1, dtype=np.int32) * live
    columns = np.arange(seq_len, dtype=np.int32)
    positions = columns - np.maximum.accumulate(np.where(piece_start, columns, 0), axis=1)
    return Batch(
        inputs=inputs.reshape(num_rows, seq_len),
        targets=targets.reshape(num_rows, seq_len),
        segment_ids=segment_ids.astype(np.int32),
        positions=(positions * live).astype(np.int32),
        loss_mask=live.astype(np.float32),
    )
