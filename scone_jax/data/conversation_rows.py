"""Rows of whole conversations, computed per batch from conversation lengths alone (data.source='chat').

A conversation is never split across rows. Each conversation is one example as data/packing.py makes it
([bos] + ids with targets ids + [eos], or the ids alone with data.add_bos=False), of at most data.seq_len
positions (data/conversation_docs.py refuses or truncates longer ones). Epoch e visits the process's
conversations in its own shuffled order (drawn from (seed, e) alone, as packing.Stream's); rows are filled
greedily in that order: a row takes the next conversation while it fits, else the rest of the row is padding
(segment 0, pad ids, loss mask 0) and the conversation opens the next row. Epochs follow each other, row after
row. Row r of the stream is therefore a pure function of r and the seed: batch b is rows b*R .. b*R+R-1, any
worker builds any batch, and a resumed run starts at its step's batch, exactly as with documents.

Inside a row each conversation is a segment of its own (1, 2, ...; attention never crosses segments), its
positions count from 0, and the loss mask is its targets' mask (data/conversations.py: the assistant's tokens,
or all of them with data.loss_on='all').
"""
from __future__ import annotations

import math

import numpy as np

from scone_jax.batch import Batch
from scone_jax.data import packing


class RowLayout:
    """Which conversations each row of the endless (seed: int or tuple) or single-epoch (seed None: in the given
    order, evaluation) stream holds. `positions[i]`: conversation i's positions, each in [1, seq_len]."""

    def __init__(self, positions: np.ndarray, seq_len: int, seed):
        self.positions = np.asarray(positions, np.int64)
        if not len(self.positions) or self.positions.min() < 1 or self.positions.max() > seq_len:
            raise ValueError(f"rows of {seq_len} positions need conversations of 1 to {seq_len} positions")
        self.seq_len, self.seed = seq_len, seed
        self._first_rows = [0]  # the stream's first row of each epoch laid out so far, and of the next one
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(conversation order, bounds): row j of the epoch holds order[bounds[j]:bounds[j + 1]]."""
        if epoch not in self._epochs:
            n = len(self.positions)
            if self.seed is None:
                order = np.arange(n)
            else:
                seed = list(self.seed) if isinstance(self.seed, tuple) else [self.seed]
                order = np.random.default_rng([*seed, epoch]).permutation(n)
            ends = np.cumsum(self.positions[order])
            bounds, start, used = [0], 0, 0
            while start < n:  # one search per row: the first conversation that no longer fits
                start = int(np.searchsorted(ends, used + self.seq_len, side="right"))
                bounds.append(start)
                used = int(ends[start - 1])
            if len(self._epochs) > 2:  # a worker walks forward: keep the last few epochs only
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (order, np.asarray(bounds, np.int64))
        return self._epochs[epoch]

    def epoch_rows(self, epoch: int) -> int:
        return len(self._epoch(epoch)[1]) - 1

    def _locate(self, row: int) -> tuple[int, int]:
        """(epoch, row within it) of stream row `row`."""
        while self._first_rows[-1] <= row:
            self._first_rows.append(self._first_rows[-1] + self.epoch_rows(len(self._first_rows) - 1))
        epoch = int(np.searchsorted(self._first_rows, row, side="right")) - 1
        return epoch, row - self._first_rows[epoch]

    def rows(self, first: int, count: int) -> list[np.ndarray]:
        """The conversations of rows first .. first + count - 1, in row order."""
        out = []
        for row in range(first, first + count):
            epoch, j = self._locate(row)
            order, bounds = self._epoch(epoch)
            out.append(order[bounds[j]:bounds[j + 1]])
        return out


def build(docs, row_lists: list[np.ndarray], seq_len: int, bos: int | None, eos: int, pad: int) -> Batch:
    """The batch [len(row_lists), seq_len] whose row k holds conversations row_lists[k] of `docs`
    (data/conversation_docs.py), back to back from its start, padding after them."""
    rows = len(row_lists)
    arrays = {k: np.zeros((rows, seq_len), dtype) for k, dtype in
              (("inputs", np.int32), ("targets", np.int32), ("segment_ids", np.int32), ("positions", np.int32),
               ("loss_mask", np.float32))}
    arrays["inputs"][:] = pad
    arrays["targets"][:] = pad
    per_row = np.array([len(r) for r in row_lists], np.int64)
    if not per_row.sum():
        return Batch(**arrays)
    convs = np.concatenate(row_lists).astype(np.int64)
    ids, masks, lengths = docs.gather(convs)
    inputs, targets, _ = packing.examples(ids, lengths, bos, eos)
    sizes = packing.example_lengths(lengths, bos)
    if bos is None:  # no bos: token 0 is never a target, so its mask entry goes
        firsts = np.cumsum(lengths + 1) - (lengths + 1)
        masks = np.delete(masks, firsts)
    row_of_conv = np.repeat(np.arange(rows), per_row)
    conv_start = np.cumsum(sizes) - sizes  # in the concatenation of all examples
    first_of_row = (np.cumsum(per_row) - per_row)[row_of_conv]  # the first conversation of each one's row
    column0 = conv_start - conv_start[first_of_row]  # each conversation's first column in its row
    segment = np.arange(len(convs)) - first_of_row + 1
    if (column0 + sizes).max() > seq_len:
        raise ValueError("a row's conversations exceed data.seq_len positions")  # RowLayout never lays them so
    r = np.repeat(row_of_conv, sizes)
    within = np.arange(int(sizes.sum())) - np.repeat(conv_start, sizes)
    c = np.repeat(column0, sizes) + within
    arrays["inputs"][r, c] = inputs
    arrays["targets"][r, c] = targets
    arrays["segment_ids"][r, c] = np.repeat(segment, sizes)
    arrays["positions"][r, c] = within
    arrays["loss_mask"][r, c] = masks
    return Batch(**arrays)


class TrainRows:
    """A process's endless stream of rows of whole conversations: rows(first, count) -> Batch."""

    def __init__(self, docs, seq_len: int, tokens: tuple, seed):
        self.docs, self._seq_len = docs, seq_len
        self._bos, self._eos, self._pad = tokens
        self.layout = RowLayout(packing.example_lengths(docs.lengths, self._bos), seq_len, seed)

    def rows(self, first: int, count: int) -> Batch:
        return build(self.docs, self.layout.rows(first, count), self._seq_len, self._bos, self._eos, self._pad)


class _Share:
    """Conversations ids[0], ids[1], ... of a conversation store."""

    def __init__(self, docs, ids: np.ndarray):
        self._docs, self._ids = docs, ids
        self.lengths = docs.lengths[ids]

    def __len__(self) -> int:
        return len(self._ids)

    def gather(self, local: np.ndarray):
        return self._docs.gather(self._ids[np.asarray(local, np.int64)])


def _targets_counted(docs, bos: int | None) -> int:
    """The loss-masked targets of all conversations of `docs`."""
    if not len(docs):
        return 0
    _, masks, lengths = docs.gather(np.arange(len(docs)))
    if bos is None:  # token 0's entry is no target
        masks = np.delete(masks, np.cumsum(lengths + 1) - (lengths + 1))
    return int(masks.sum())


class EvalBatches:
    """Every held-out conversation exactly once, whole, as fixed-shape batches; iterable any number of times
    (pipeline.EvalBatches' interface). Process p evaluates every process_count-th conversation, in order; every
    process yields `num_batches` batches (padding with empty ones). num_tokens: the loss-masked targets over
    all processes (what held-out loss and perplexity average over); local_num_tokens: this process's."""

    def __init__(self, docs, batch_rows: int, seq_len: int, tokens: tuple, process_index: int, process_count: int):
        self._batch_rows, self._seq_len, self._tokens = batch_rows, seq_len, tokens
        bos = tokens[0]
        shares = [_Share(docs, np.arange(p, len(docs), process_count)) for p in range(process_count)]
        rows = [RowLayout(packing.example_lengths(s.lengths, bos), seq_len, None).epoch_rows(0) if len(s) else 0
                for s in shares]
        self.num_batches = max(math.ceil(r / batch_rows) for r in rows)
        self.num_tokens = _targets_counted(docs, bos)
        self.local_num_tokens = _targets_counted(shares[process_index], bos)
        mine = shares[process_index]
        self._rows = TrainRows(mine, seq_len, tokens, seed=None) if len(mine) else None
        self._num_rows = rows[process_index]

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        for b in range(self.num_batches):
            first = b * self._batch_rows
            real = max(0, min(self._batch_rows, self._num_rows - first))
            if not real:
                yield Batch.empty(self._batch_rows, self._seq_len)
                continue
            lists = self._rows.layout.rows(first, real) + [np.zeros(0, np.int64)] * (self._batch_rows - real)
            yield build(self._rows.docs, lists, self._seq_len, *self._tokens)
