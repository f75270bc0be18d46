"""Tokenized documents by number: what the packer reads.

Two kinds, both picklable (grain ships them to its worker processes):
  InMemoryDocuments   text corpora (kjv, text, jsonl), tokenized once when the pipeline is
                      built (all cores) and kept as one flat int32 array plus offsets: 4 bytes
                      per token, so the embedded corpus costs ~4 MB. Larger text corpora
                      belong in ArrayRecord shards (tools/pretokenize.py).
  RecordDocuments     pre-tokenized ArrayRecord shards, read record by record on demand; the
                      lengths come from the shards' sidecar files (sources.py).
Either way a process keeps only its own documents: every process_count-th one of a fixed
shuffle of the corpus (data.shuffle_seed), so each process reads a disjoint share.
"""
from __future__ import annotations

import numpy as np

from scone_jax.data import shards, sources, tokenize
from scone_jax.data.tokenizer import Tokenizer

PARALLEL_TOKENIZE_DOCS = 20_000


class InMemoryDocuments:
    """Documents as one flat token array; document i is tokens[offsets[i]:offsets[i+1]]."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
        self.tokens, self.offsets = tokens, offsets
        self.lengths = np.diff(offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def gather(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids of `docs` back to back, their lengths)."""
        lengths = self.lengths[docs]
        starts = np.repeat(self.offsets[docs] - np.cumsum(lengths) + lengths, lengths)
        return self.tokens[starts + np.arange(len(starts))], lengths


class RecordDocuments:
    """A subset of the records of a TokenArrayRecordSource: local document i is record ids[i]."""

    def __init__(self, source: sources.TokenArrayRecordSource, ids: np.ndarray, lengths: np.ndarray,
                 vocab_size: int, fingerprint: str):
        self._source, self._ids = source, ids
        self.lengths = lengths
        self._vocab_size, self._fingerprint = vocab_size, fingerprint

    def __len__(self) -> int:
        return len(self._ids)

    def gather(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lengths = self.lengths[docs]
        ids = self._source.read_concatenated(self._ids[docs])
        if ids.size != lengths.sum():
            raise ValueError(
                f"Pre-tokenized documents {self._ids[docs][:8].tolist()}... hold {ids.size} tokens but their "
                f"lengths sidecar ({shards.LENGTHS_SUFFIX}) says {int(lengths.sum())}: the shards changed "
                "after the sidecars were written. Fix: re-run tools/pretokenize.py, or delete the sidecars.")
        if ids.size and (ids.min() < 0 or ids.max() >= self._vocab_size):
            at = int(np.flatnonzero((ids < 0) | (ids >= self._vocab_size))[0])
            record = int(self._ids[docs][np.searchsorted(np.cumsum(lengths), at, side="right")])
            raise ValueError(
                f"Pre-tokenized document {record} (record number over all shards) holds token id {int(ids[at])}, "
                f"outside the tokenizer's vocabulary [0, {self._vocab_size}) (fingerprint {self._fingerprint}). "
                "Fix: set data.tokenizer_path to the tokenizer that made the data, or repair that document."
            )
        return ids, lengths


def process_share(num_docs: int, seed: int, process_index: int, process_count: int) -> np.ndarray:
    """The document numbers this process reads: a fixed shuffle of all, every process_count-th."""
    if num_docs < process_count:
        raise ValueError(
            f"The training data has {num_docs} documents, fewer than the {process_count} processes that "
            "each need at least one. Fix: add data or use fewer processes."
        )
    order = np.random.default_rng([seed, 0x5C0E]).permutation(num_docs)
    return np.sort(order[process_index::process_count])


def load(data_cfg, split: str, tokenizer: Tokenizer, share) -> InMemoryDocuments | RecordDocuments:
    """This process's documents of `split`: `share(num_docs)` names which (sorted numbers).
    ArrayRecord shards are checked against the tokenizer's fingerprint (sources.py)."""
    source = sources.open_source(data_cfg, split, tokenizer_fingerprint=tokenizer.fingerprint)
    ids = share(len(source))
    if isinstance(source, sources.TokenArrayRecordSource):
        return RecordDocuments(source, ids, source.document_lengths()[ids], tokenizer.vocab_size,
                               tokenizer.fingerprint)
    # Spawning tokenizer processes costs about a second; below this many documents one is faster.
    workers = tokenize.default_workers() if len(ids) >= PARALLEL_TOKENIZE_DOCS else 1
    tokens, offsets = tokenize.encode_all(_Subset(source, ids), tokenizer, workers=workers)
    return InMemoryDocuments(tokens, offsets)


class _Subset:
    """Documents ids[0], ids[1], ... of a source, as a source (picklable)."""

    def __init__(self, source, ids: np.ndarray):
        self._source, self._ids = source, ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: int):
        return self._source[int(self._ids[index])]
