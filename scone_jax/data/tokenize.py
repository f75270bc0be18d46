"""Tokenize many documents with all cores, in document order.

Shared by the input pipeline (text corpora are tokenized once when it is built), f-gram
extraction (the run's own and tools/extract_fgrams.py) and tools/pretokenize.py. Work is cut
into contiguous chunks of documents and each chunk is encoded on its own, so the result does
not depend on the worker count. Workers are
spawned, not forked: the parent may be running JAX, whose threads make fork unsafe.
Every worker receives the source and the tokenizer once; both pickle small (file names
and offsets, the model bytes).
"""
from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures

import numpy as np

from scone_jax.runtime import parent_watch

# ~50k tokens of typical paragraphs: big enough to hide the per-task overhead, small
# enough that progress moves and workers finish together.
DEFAULT_CHUNK_DOCS = 512


def default_workers() -> int:
    """Processes to use for workers=-1: every core this process may run on.

    The CPU affinity, not os.cpu_count(): containers, taskset and batch schedulers shrink
    it, and starting more processes than usable cores only adds switching. Tokenizing is
    CPU-bound and the parent merely waits, so it gets no core of its own.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int, name: str = "workers") -> int:
    """`workers` with -1 replaced by default_workers(); anything else below 1 is an error naming `name`."""
    if workers == -1:
        return default_workers()
    if workers < 1:
        raise ValueError(f"{name}={workers} is not valid: use -1 (all cores) or a number of processes >= 1.")
    return workers


def iter_encoded(source, tokenizer, start: int, stop: int, batch_docs: int = 64) -> Iterator[np.ndarray]:
    """int32 token ids of documents start..stop-1, in order; no bos/eos. Memory: `batch_docs` documents.

    Text items go through tokenizer.encode_batch, `batch_docs` consecutive texts per call (the
    libraries' batch encoders beat one call per document); token-id arrays (pre-tokenized sources)
    pass through.
    """
    texts = []
    for index in range(start, stop):
        item = source[index]
        if isinstance(item, str):
            texts.append(item)
            if len(texts) >= batch_docs:
                yield from tokenizer.encode_batch(texts)
                texts = []
            continue
        if texts:
            yield from tokenizer.encode_batch(texts)
            texts = []
        if isinstance(item, np.ndarray) and item.dtype.kind in "iu":
            yield item.astype(np.int32, copy=False)
        else:
            raise TypeError(f"Document {index} is a {type(item).__name__}; expected str or an int32 token array.")
    if texts:
        yield from tokenizer.encode_batch(texts)


def encode_documents(source, tokenizer, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of documents start..stop-1 back to back, int32 length of each); no bos/eos.
    The whole chunk is one encode_batch: its documents are held in memory anyway."""
    pieces = list(iter_encoded(source, tokenizer, start, stop, batch_docs=max(1, stop - start)))
    lengths = np.array([len(p) for p in pieces], np.int32)
    tokens = np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, np.int32)
    return tokens, lengths


def encode_all(source, tokenizer, *, workers: int, progress: Callable[[int, int], None] | None = None,
               chunk_docs: int = DEFAULT_CHUNK_DOCS) -> tuple[np.ndarray, np.ndarray]:
    """(all token ids int32, offsets int64 [N+1]) of the whole source in document order.

    Document i is tokens[offsets[i]:offsets[i+1]]. `workers` processes (-1: default_workers(),
    1: this process) encode chunks of `chunk_docs` documents; `progress(docs_done, tokens_done)`
    is called after each chunk, in order.
    """
    if chunk_docs < 1:
        raise ValueError(f"chunk_docs={chunk_docs} must be >= 1.")
    num_docs = len(source)
    bounds = [(s, min(s + chunk_docs, num_docs)) for s in range(0, num_docs, chunk_docs)]
    processes = min(resolve_workers(workers), max(1, len(bounds)))
    tokens, lengths, docs_done, tokens_done = [], [], 0, 0
    for chunk_tokens, chunk_lengths in _chunks(source, tokenizer, bounds, processes):
        tokens.append(chunk_tokens)
        lengths.append(chunk_lengths)
        docs_done, tokens_done = docs_done + len(chunk_lengths), tokens_done + len(chunk_tokens)
        if progress is not None:
            progress(docs_done, tokens_done)
    offsets = np.zeros(num_docs + 1, np.int64)
    if lengths:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    return (np.concatenate(tokens) if tokens else np.zeros(0, np.int32)), offsets


def _chunks(source, tokenizer, bounds, processes: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    if processes == 1:
        for start, stop in bounds:
            yield encode_documents(source, tokenizer, start, stop)
        return
    yield from run_pool(_encode_chunk, bounds, processes, _init_worker, (source, tokenizer))


def _init_pool_worker(initializer, initargs) -> None:
    """Every pool worker exits when its parent dies (parent_watch), then runs the pool's own initializer."""
    parent_watch.exit_with_parent()
    initializer(*initargs)


def run_pool(function, tasks: Iterable, processes: int, initializer, initargs, ahead: int = 4) -> Iterator:
    """function(task) for every task on `processes` spawned workers; results in task order.

    At most `ahead` tasks per process are queued or done-but-unread, so a consumer that reads
    slowly (or stops early) holds a bounded number of results in memory. A worker that dies
    (e.g. killed for memory) raises BrokenProcessPool instead of hanging, and an error or an
    early stop cancels the tasks not yet started.
    """
    context = multiprocessing.get_context("spawn")
    tasks = iter(tasks)
    with futures.ProcessPoolExecutor(processes, mp_context=context, initializer=_init_pool_worker,
                                     initargs=(initializer, initargs)) as pool:
        pending = collections.deque(pool.submit(function, task) for task in itertools.islice(tasks, ahead * processes))
        try:
            while pending:
                result = pending.popleft().result()
                for task in itertools.islice(tasks, 1):  # keep the workers busy while the consumer reads
                    pending.append(pool.submit(function, task))
                yield result
        finally:
            for future in pending:
                future.cancel()


def model_documents(source, tokenizer, *, bos_id: int | None, max_tokens: int = 0, workers: int = 1,
                    chunk_docs: int = DEFAULT_CHUNK_DOCS) -> Iterator[np.ndarray]:
    """Each document as the model reads it, [bos] + ids (no bos if `bos_id` is None: data.add_bos=False, or ids
    without a tokenizer; data/prompt.document_bos), in corpus order, until
    `max_tokens` tokens (0: all; the last document is cut): the token stream f-gram extraction counts
    (docs/method.md §1), the same for the training run's own extraction and tools/extract_fgrams.py.

    `workers` processes (-1: all cores) tokenize chunks of `chunk_docs` documents a bounded number ahead.
    """
    bounds = ((s, min(s + chunk_docs, len(source))) for s in range(0, len(source), chunk_docs))
    processes = resolve_workers(workers)
    chunks = _chunks(source, tokenizer, bounds, processes)
    prefix = np.array([] if bos_id is None else [bos_id], np.int32)
    budget = max_tokens or float("inf")
    for tokens, lengths in chunks:
        for doc in np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else ():
            doc = np.concatenate([prefix, doc])[: int(min(len(doc) + len(prefix), budget))]
            yield doc
            budget -= len(doc)
            if budget <= 0:
                chunks.close()  # cancels the chunks not yet tokenized
                return


_worker_state = None


def _init_worker(source, tokenizer) -> None:
    global _worker_state
    _worker_state = (source, tokenizer)


def _encode_chunk(bound: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(*_worker_state, *bound)
