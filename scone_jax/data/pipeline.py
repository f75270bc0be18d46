"""Input pipelines: packed training batches forever, and every held-out document once.

A batch is a dict of numpy arrays of shape [local_batch, seq_len]:
  inputs, targets  int32    token ids; targets are inputs shifted by one inside a document
  segment_ids      int32    1, 2, ... per document piece in the row; 0 = padding
  positions        int32    position inside the document piece, restarting at 0
  loss_mask        float32  1 where the target is a real token of the same document
packing.py defines the layout: documents become [bos] + ids + [eos] (no bos with data.add_bos=False:
data/prompt.py), rows are cut from their
concatenation, and batch b is a pure function of b; conversations (data.source='chat') fill rows whole
instead (conversation_rows.py), with the same guarantee. Training batches are built by grain:
a MapDataset over batch numbers, mapped by `_BuildBatch` (which also runs the batch
transform, e.g. f-gram matching), in `data.worker_count` processes. Batch b is the same
whichever worker builds it, so the batches do not depend on the worker count, and a run
resumes exactly by starting at the batch number it stopped at (the train step).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator

import grain
import numpy as np
from absl import logging

from scone_jax.batch import Batch
from scone_jax.data import conversation_docs, conversation_rows, documents, mixture, packing, prompt
from scone_jax.data.tokenizer import Tokenizer
from scone_jax.runtime import parent_watch

# grain's MapDataset wants a length; the stream is endless, so batch numbers just stop here.
_ENDLESS = 1 << 48
MAX_AUTO_WORKERS = 16


def _local_batch_size(data_cfg, process_index: int, process_count: int) -> int:
    """Rows per batch on one JAX process: the global batch split evenly across processes."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count}).")
    if data_cfg.global_batch_size <= 0:
        raise ValueError(f"data.global_batch_size={data_cfg.global_batch_size} must be positive.")
    if data_cfg.global_batch_size % process_count:
        raise ValueError(
            f"data.global_batch_size={data_cfg.global_batch_size} is not divisible by the "
            f"{process_count} JAX processes. Fix: use a multiple of {process_count}."
        )
    return data_cfg.global_batch_size // process_count


def worker_count(data_cfg) -> int:
    """data.worker_count, with -1 resolved: half of this host's cores (at least 1, at most
    MAX_AUTO_WORKERS). The other half stays with the training process (dispatch, transfers,
    checkpoints); one worker builds millions of tokens per second of batches with f-grams
    (docs/benchmarks.md), so 16 feed even a small model on a large host."""
    count = data_cfg.worker_count
    if count < -1:
        raise ValueError(f"data.worker_count={count} is not valid: use -1 (one per two cores), 0 (build "
                         "batches on a thread of the training process) or a number of worker processes.")
    if count == -1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        count = max(1, min(MAX_AUTO_WORKERS, cores // 2))
    return count


class _TextRows:
    """A process's endless stream of rows cut from its documents (data/packing.py): rows(first, count) -> Batch."""

    def __init__(self, docs, stream: packing.Stream, seq_len: int, tokens: tuple):
        self._docs, self._stream, self._seq_len, self._tokens = docs, stream, seq_len, tokens

    def rows(self, first: int, count: int) -> Batch:
        return window(self._docs, self._stream, first * self._seq_len, count * self._seq_len, count, self._seq_len,
                      *self._tokens)


class _BuildBatch:
    """Batch number -> host batch (rows of the stream, then the batch transform). Runs in grain workers."""

    def __init__(self, stream, rows: int, transform: Callable[[Batch], Batch] | None):
        self._stream, self._rows, self._transform = stream, rows, transform

    def __call__(self, index: int) -> Batch:
        batch = self.untransformed(index)
        return self._transform(batch) if self._transform is not None else batch

    def untransformed(self, index: int) -> Batch:
        """Batch `index` before the batch transform."""
        return self._stream.rows(int(index) * self._rows, self._rows)


def special_ids(data_cfg, tokenizer: Tokenizer) -> tuple:
    """(bos or None, eos, pad) as packing reads them: no bos with data.add_bos=False (data/prompt.py)."""
    return prompt.document_bos(tokenizer, data_cfg.add_bos), tokenizer.eos_id, tokenizer.pad_id


def window(docs, stream: packing.Stream, start: int, size: int, rows: int, seq_len: int,
           bos: int | None, eos: int, pad: int, stream_end: int | None = None) -> Batch:
    """Stream positions [start, start + size) (cut at stream_end, if finite) as batch arrays (bos None: no bos)."""
    stop = start + size if stream_end is None else min(start + size, stream_end)
    if stop <= start:
        return packing.rows(*(np.zeros(0, t) for t in (np.int32, np.int32, bool)), rows, seq_len, pad)
    pieces = stream.pieces(start, stop)
    ids, lengths = docs.gather(pieces.docs)
    inputs, targets, starts = packing.examples(ids, lengths, bos, eos)
    cut = slice(pieces.first_offset, pieces.first_offset + stop - start)
    return packing.rows(inputs[cut], targets[cut], starts[cut], rows, seq_len, pad)


class _BuildMixtureBatch:
    """Batch number -> host batch of a training mixture (data/mixture.py): each row from its component's
    stream, at that component's next rows; `row_source` says which. Runs in grain workers."""

    def __init__(self, parts: list, schedule: mixture.Schedule, rows: int, seq_len: int,
                 transform: Callable[[Batch], Batch] | None):
        self._parts, self._schedule, self._rows, self._seq_len = parts, schedule, rows, seq_len
        self._transform = transform

    def __call__(self, index: int) -> Batch:
        batch = self.untransformed(index)
        return self._transform(batch) if self._transform is not None else batch

    def untransformed(self, index: int) -> Batch:
        """Batch `index` before the batch transform."""
        owner, rank = self._schedule.rows(int(index) * self._rows, self._rows)
        fields = {}
        for c, stream in enumerate(self._parts):
            mine = np.flatnonzero(owner == c)
            if not len(mine):
                continue
            # The component's rows in this batch have consecutive ranks: one window of its stream.
            part = stream.rows(int(rank[mine[0]]), len(mine))
            for key, array in part.arrays().items():
                if key not in fields:
                    fields[key] = np.empty((self._rows, self._seq_len), array.dtype)
                fields[key][mine] = array
        return Batch(**fields, row_source=owner.astype(np.int32))


def batch_builder(data_cfg, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1,
                  batch_transform: Callable[[Batch], Batch] | None = None):
    """batch number -> this process's training batch: its documents loaded (text tokenized, conversations
    rendered, here, once, with all cores) and their stream of rows set up; with a mixture, per component."""
    batch_size = _local_batch_size(data_cfg, process_index, process_count)
    tokens = special_ids(data_cfg, tokenizer)

    def load(cfg, seed):
        share = lambda n: documents.process_share(n, cfg.shuffle_seed, process_index, process_count)  # noqa: E731
        if cfg.source == "chat":  # rows of whole conversations (data/conversation_rows.py)
            return conversation_rows.TrainRows(conversation_docs.load(cfg, "train", tokenizer, share), cfg.seq_len,
                                               tokens, seed)
        docs = documents.load(cfg, "train", tokenizer, share)
        return _TextRows(docs, packing.Stream(packing.example_lengths(docs.lengths, tokens[0]), seed=seed),
                         cfg.seq_len, tokens)

    components = mixture.components(data_cfg)
    if components is None:
        return _BuildBatch(load(data_cfg, data_cfg.shuffle_seed), batch_size, batch_transform)
    parts = [load(mixture.component_config(data_cfg, c), (data_cfg.shuffle_seed, i)) for i, c in enumerate(components)]
    schedule = mixture.Schedule([c.weight for c in components], data_cfg.shuffle_seed)
    return _BuildMixtureBatch(parts, schedule, batch_size, data_cfg.seq_len, batch_transform)


def make_train_dataset(
    data_cfg,
    tokenizer: Tokenizer,
    *,
    process_index: int = 0,
    process_count: int = 1,
    batch_transform: Callable[[Batch], Batch] | None = None,
    start_batch: int = 0,
    check: Callable[[Callable[[int], Batch]], None] | None = None,
) -> grain.IterDataset | _Elements:
    """Endless packed training batches of one JAX process, from batch number `start_batch`.

    All processes split the documents the same way (documents.process_share) and each reads
    only its own; each process shuffles its documents anew every epoch (data.shuffle_seed).
    `batch_transform` runs on every batch inside the workers (data.worker_count; 0 = on a
    prefetch thread of this process). Close iterators (`it.close()`) when done: it stops the
    prefetch thread and worker processes. `check`, if given, is called once before any batch is
    built, with batch number -> this process's batch before the transform (to check what the
    batches need: training/capacity.py).
    """
    workers = worker_count(data_cfg)
    build = batch_builder(data_cfg, tokenizer, process_index=process_index, process_count=process_count,
                          batch_transform=batch_transform)
    if check is not None:
        check(build.untransformed)
    # One builder thread per process: a batch is numpy and numba work that holds the GIL for
    # most of its time, so grain's default (16 threads, 500 batches read ahead) only adds
    # contention with the thread that hands batches on, and memory.
    if workers == 0:
        read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=data_cfg.prefetch_buffer)
        ds = grain.MapDataset.range(start_batch, _ENDLESS).map(build).to_iter_dataset(read)
        return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=data_cfg.prefetch_buffer)
    logging.info("Input pipeline: %d worker processes build the batches", workers)
    # Workers hand over BATCHES_PER_ELEMENT consecutive batches at a time, joined into one array
    # (_BuildBatches): grain's fixed cost per element and per array (shared memory, queues) would
    # otherwise be a large share of a batch's work. data.prefetch_buffer batches per worker, in
    # whole elements, are both built ahead and queued for hand-over: batches are consumed in
    # order, so with a single element queued any hiccup of one worker stalls all the others.
    ahead = -(-data_cfg.prefetch_buffer // BATCHES_PER_ELEMENT)
    read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=ahead)
    elements = grain.MapDataset.range(_ENDLESS // BATCHES_PER_ELEMENT).map(
        _BuildBatches(build, start_batch, BATCHES_PER_ELEMENT)).to_iter_dataset(read)
    options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=ahead)
    # Workers exit within a second of this process's death (a SIGKILL leaves them no other word).
    return _Elements(elements.mp_prefetch(options, worker_init_fn=parent_watch.exit_with_parent))


BATCHES_PER_ELEMENT = 4
_ALIGN = 64  # byte alignment of each array inside a joined element


class _BuildBatches:
    """Element j -> batches start + j*n .. start + j*n + n-1, joined into one byte array.

    grain hands each numpy array of an element over in a shared-memory segment of its own:
    creating, filling (page faults), attaching and unlinking one. Ten arrays per batch cost the
    worker measurably more than one array of the same bytes (tools/bench_pipeline.py), so an
    element travels as one segment: {"bytes": uint8 array, "layout": JSON} (join_batches).
    """

    def __init__(self, build: _BuildBatch, start: int, n: int):
        self._build, self._start, self._n = build, start, n

    def __call__(self, element: int) -> dict:
        first = self._start + int(element) * self._n
        return join_batches([self._build(b) for b in range(first, first + self._n)])


def join_batches(batches: list[Batch]) -> dict:
    """Batches as one uint8 array and a JSON layout (a worker's element); `split_element` inverts it."""
    layout, offset = [], 0
    for batch in batches:
        entries = []
        for key, array in batch.arrays().items():
            entries.append((key, array.dtype.str, list(array.shape), offset))
            offset += -(-array.nbytes // _ALIGN) * _ALIGN
        layout.append(entries)
    joined = np.empty(offset, np.uint8)
    for batch, entries in zip(batches, layout):
        for (key, _, _, start), array in zip(entries, batch.arrays().values()):
            joined[start:start + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return {"bytes": joined, "layout": json.dumps(layout)}


def split_element(element: dict) -> list[Batch]:
    """The batches of a joined element, as views into its one array (no copy)."""
    joined = element["bytes"]
    batches = []
    for entries in json.loads(element["layout"]):
        arrays = {}
        for key, dtype, shape, start in entries:
            dtype = np.dtype(dtype)
            size = math.prod(shape) * dtype.itemsize
            arrays[key] = joined[start:start + size].view(dtype).reshape(shape)
        batches.append(Batch.from_arrays(arrays))
    return batches


class _Elements:
    """Iterates the batches inside grain's joined elements, in order; `it.close()` stops grain."""

    def __init__(self, elements: grain.IterDataset):
        self._elements = elements

    def __iter__(self) -> Iterator[Batch]:
        return _ElementsIterator(iter(self._elements))


class _ElementsIterator:
    def __init__(self, elements):
        self._elements, self._ready = elements, []

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if not self._ready:
            self._ready = split_element(next(self._elements))
        return self._ready.pop(0)

    def close(self) -> None:
        self._elements.close()


def first_batches(dataset, count: int) -> list[Batch]:
    """The first `count` batches of `dataset`, its iterator closed afterwards (worker processes
    stopped: an iterator left open ends the interpreter with grain's tracebacks)."""
    it = iter(dataset)
    try:
        return [next(it) for _ in range(count)]
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class EvalBatches:
    """Every held-out document exactly once, as fixed-shape batches; iterable any number of times.

    Every process yields `num_batches` batches (padding with empty ones), since evaluation runs
    a collective step per batch. Each process tokenizes the held-out set once, here, and keeps
    its own documents (every process_count-th); the document lengths of all processes give
    the common batch count. Attributes: num_batches; num_tokens (loss_mask ones over all
    processes); local_num_tokens (this process's share).
    """

    def __init__(self, data_cfg, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1):
        self._rows = _local_batch_size(data_cfg, process_index, process_count)
        self._seq_len = data_cfg.seq_len
        self._tokens = special_ids(data_cfg, tokenizer)
        everything = documents.load(data_cfg, "eval", tokenizer, np.arange)
        positions = packing.example_lengths(everything.lengths, self._tokens[0])
        # Concat-then-split fills every row but the last, so a process needs ceil(positions / seq_len) rows.
        rows = [math.ceil(positions[p::process_count].sum() / self._seq_len) for p in range(process_count)]
        self.num_batches = max(math.ceil(r / self._rows) for r in rows)
        self.num_tokens = int(positions.sum())
        self.local_num_tokens = int(positions[process_index::process_count].sum())
        mine = np.arange(process_index, len(positions), process_count)
        held = positions[mine].sum() > 0  # this process holds a position (documents without bos may have none)
        self._docs = _Slice(everything, mine) if held else None
        self._stream = packing.Stream(positions[mine], seed=None) if held else None

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        size = self._rows * self._seq_len
        end = self._stream.epoch_positions if self._stream is not None else 0
        for b in range(self.num_batches):
            if b * size < end:
                yield window(self._docs, self._stream, b * size, size, self._rows, self._seq_len, *self._tokens,
                             stream_end=end)
            else:
                yield Batch.empty(self._rows, self._seq_len)


class _Slice:
    """Documents ids[0], ids[1], ... of a document store."""

    def __init__(self, docs, ids: np.ndarray):
        self._docs, self._ids = docs, ids
        self.lengths = docs.lengths[ids]

    def gather(self, local: np.ndarray):
        return self._docs.gather(self._ids[local])


def make_eval_batches(
    data_cfg, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1
) -> EvalBatches | conversation_rows.EvalBatches:
    """Held-out batches for one JAX process; see EvalBatches (no shuffle, finite, same count everywhere);
    conversations whole, the loss on their masked tokens (data/conversation_rows.py)."""
    if data_cfg.source == "chat":
        return conversation_rows.EvalBatches(
            conversation_docs.held_out(data_cfg, tokenizer), _local_batch_size(data_cfg, process_index, process_count),
            data_cfg.seq_len, special_ids(data_cfg, tokenizer), process_index, process_count)
    return EvalBatches(data_cfg, tokenizer, process_index=process_index, process_count=process_count)
