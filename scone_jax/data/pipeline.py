"""Grain input pipelines: packed training batches forever, and every held-out document once.

A batch is a dict of numpy arrays of shape [local_batch, seq_len]:
  inputs, targets  int32    token ids; targets are inputs shifted by one inside a document
  segment_ids      int32    1, 2, ... per document piece in the row; 0 = padding
  positions        int32    position inside the document piece, restarting at 0
  loss_mask        float32  1 where the target is a real token of the same document
Documents become [bos] + ids + [eos]; rows are filled by concatenating documents and
splitting at seq_len (grain's ConcatThenSplit), so only a stream's last row has padding.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import grain
import numpy as np

from scone_jax.data import sources
from scone_jax.data.tokenizer import Tokenizer

Batch = dict[str, np.ndarray]
DTYPES = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
          "loss_mask": np.float32}


def _local_batch_size(data_cfg, process_index: int, process_count: int) -> int:
    """Rows per batch on one JAX process: the global batch split evenly across processes."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count}).")
    if data_cfg.global_batch_size % process_count:
        raise ValueError(
            f"data.global_batch_size={data_cfg.global_batch_size} is not divisible by the "
            f"{process_count} JAX processes. Fix: use a multiple of {process_count}."
        )
    return data_cfg.global_batch_size // process_count


class _ToExample:
    """Document (text or token ids) -> {'inputs': ids[:-1], 'targets': ids[1:]} of [bos] + ids + [eos]."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def __call__(self, doc: str | np.ndarray) -> Batch:
        tok = self._tokenizer
        if isinstance(doc, str):
            ids = tok.encode(doc)
        else:
            ids = np.asarray(doc, dtype=np.int32)
            outside = ids[(ids < 0) | (ids >= tok.vocab_size)]
            if outside.size:
                raise ValueError(
                    f"A pre-tokenized document holds token id {int(outside[0])}, outside the tokenizer's "
                    f"vocabulary [0, {tok.vocab_size}) (fingerprint {tok.fingerprint}). "
                    "Fix: set data.tokenizer_path to the tokenizer that made the data."
                )
        ids = np.concatenate([[tok.bos_id], ids, [tok.eos_id]]).astype(np.int32)
        return {"inputs": ids[:-1], "targets": ids[1:]}


class _ToRow:
    """Renames ConcatThenSplit's features to the batch keys and fills padding with pad_id."""

    def __init__(self, pad_id: int):
        self._pad_id = pad_id

    def __call__(self, packed: Batch) -> Batch:
        segment_ids = packed["inputs_segment_ids"]
        real = segment_ids > 0
        return {
            "inputs": np.where(real, packed["inputs"], self._pad_id).astype(np.int32),
            "targets": np.where(real, packed["targets"], self._pad_id).astype(np.int32),
            "segment_ids": segment_ids,
            "positions": packed["inputs_positions"],
            "loss_mask": (packed["targets_segment_ids"] > 0).astype(np.float32),
        }


def _packed_rows(examples: grain.IterDataset, seq_len: int, pad_id: int) -> grain.IterDataset:
    packed = grain.experimental.ConcatThenSplitIterDataset(
        examples, length_struct={"inputs": seq_len, "targets": seq_len}
    )
    return packed.map(_ToRow(pad_id))


def make_train_dataset(
    data_cfg,
    tokenizer: Tokenizer,
    *,
    process_index: int = 0,
    process_count: int = 1,
    batch_transform: Callable[[Batch], Batch] | None = None,
) -> grain.IterDataset:
    """Endless packed training batches for one JAX process; its iterator checkpoints exactly.

    All processes shuffle the documents with the same seed (a new order each epoch)
    and take every process_count-th one, so each process reads only its own documents.
    `batch_transform` runs on every batch before prefetching (in the workers if any).
    Close iterators (`it.close()`) when done: it stops prefetch threads and worker processes.
    """
    batch_size = _local_batch_size(data_cfg, process_index, process_count)
    source = sources.open_source(data_cfg, "train")
    docs = grain.MapDataset.source(source).shuffle(seed=data_cfg.shuffle_seed)
    docs = docs[process_index::process_count]
    if len(docs) == 0:
        raise ValueError(
            f"The training data has {len(source)} documents, fewer than the {process_count} "
            "processes that each need at least one. Fix: add data or use fewer processes."
        )
    examples = docs.repeat().map(_ToExample(tokenizer)).to_iter_dataset()
    ds = _packed_rows(examples, data_cfg.seq_len, tokenizer.pad_id)
    ds = ds.batch(batch_size, drop_remainder=True)
    if batch_transform is not None:
        ds = ds.map(batch_transform)
    if data_cfg.worker_count > 0:
        options = grain.MultiprocessingOptions(
            num_workers=data_cfg.worker_count, per_worker_buffer_size=data_cfg.prefetch_buffer
        )
        return ds.mp_prefetch(options)
    return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=data_cfg.prefetch_buffer)


def _pad_batch(batch: Batch, batch_size: int) -> Batch:
    """Appends all-zero rows (segment_ids 0, loss_mask 0) up to batch_size rows."""
    missing = batch_size - len(batch["inputs"])
    return {k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}


class EvalBatches:
    """Every held-out document exactly once, as fixed-shape batches; iterable any number of times.

    Every process yields `num_batches` batches (padding with empty ones), since
    evaluation runs a collective step per batch. To know that number without
    talking to other processes, each process tokenizes the whole held-out set
    once and keeps only its own documents (every process_count-th).
    Attributes: num_batches; num_tokens (loss_mask ones over all processes);
    local_num_tokens (this process's share).
    """

    def __init__(self, data_cfg, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1):
        self._batch_size = _local_batch_size(data_cfg, process_index, process_count)
        self._seq_len = data_cfg.seq_len
        self._pad_id = tokenizer.pad_id
        source = sources.open_source(data_cfg, "eval")
        to_example = _ToExample(tokenizer)
        lengths = np.zeros(len(source), dtype=np.int64)
        self._examples = []
        for i in range(len(source)):
            example = to_example(source[i])
            lengths[i] = len(example["targets"])
            if i % process_count == process_index:
                self._examples.append(example)
        # Concat-then-split fills every row but the last, so a process needs ceil(tokens / seq_len) rows.
        rows = [math.ceil(lengths[p::process_count].sum() / self._seq_len) for p in range(process_count)]
        self.num_batches = max(math.ceil(r / self._batch_size) for r in rows)
        self.num_tokens = int(lengths.sum())
        self.local_num_tokens = int(lengths[process_index::process_count].sum())

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        count = 0
        if self._examples:
            examples = grain.MapDataset.source(self._examples).to_iter_dataset()
            rows = _packed_rows(examples, self._seq_len, self._pad_id)
            for count, batch in enumerate(rows.batch(self._batch_size), 1):
                yield _pad_batch(batch, self._batch_size)
        for _ in range(count, self.num_batches):
            yield {k: np.zeros((self._batch_size, self._seq_len), dtype) for k, dtype in DTYPES.items()}


def make_eval_batches(
    data_cfg, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1
) -> EvalBatches:
    """Held-out batches for one JAX process; see EvalBatches (no shuffle, finite, same count everywhere)."""
    return EvalBatches(data_cfg, tokenizer, process_index=process_index, process_count=process_count)
