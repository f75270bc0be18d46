"""The batch every stage passes on: one typed record of arrays, declared once.

B rows of T positions; with SCONE, G groups (a data shard, or a data shard's micro-batch) of C f-gram
rows of K tokens each (fgram/dedup.py). Host batches hold numpy arrays, device batches jax.Arrays;
Batch is a jax pytree (absent fields are None and carry no leaves), so jit, tree maps and shardings
take it whole.

  inputs        int32 [B, T]      token ids the model reads ([bos] + ids of each document, packed; ids alone
                                  with data.add_bos=False)
  targets       int32 [B, T]      the next token of each position (ids + [eos])
  segment_ids   int32 [B, T]      1, 2, ... per document piece in a row; 0 = padding (never attended to)
  positions     int32 [B, T]      position inside the piece, from 0
  loss_mask     float32 [B, T]    1 where the target counts

  row_source    int32 [B]         the training mixture's component of each row (data/mixture.py; host only:
                                  per-component token counts); absent without a mixture

  F-gram arrays, from one of the two providers of f-gram embeddings (model/scone.py):
  fgram_ids     int32 [B, T]      vocabulary id of the longest f-gram ending at each position, -1 none
                                  (host only: statistics and table gathers; never sent to the device)
  trained f-gram model (training, docs/method.md §5):
  fgram_tokens  int32 [G, C, K]   each group's maximal unique f-grams, left-aligned, PAD-padded
  fgram_lengths int32 [G, C]      their lengths (0 = unused row)
  fgram_slot    int32 [B, T]      where each position's embedding is in its group's f-gram model output:
                                  row * K + (length - 1); -1 = no match (a slot, not a vocabulary id)
  fgram_unique  int32 [G]         unique f-grams per group (host only: statistics)
  exported table (serving, docs/method.md §7):
  fgram_rows    [B, T, d]         each position's table row (zeros where none), gathered on the host
  fgram_matched bool [B, T]       whether a row replaces T(token) there

  Over-Encoding's hashed n-gram ids (model/overencoding.py, docs/method.md §8; never beside f-gram arrays):
  ngram_ids     int32 [B, T, S]   table s's id of the n-gram ending at each position (S = k(n-1) tables), 0 = no
                                  n-gram there (it would reach before the row or the document), computed on the
                                  host (data/ngram_hash.py)
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

HOST_ONLY = ("row_source", "fgram_ids", "fgram_unique")
BASE_DTYPES = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
               "loss_mask": np.float32}


@dataclasses.dataclass(frozen=True)
class Batch:
    inputs: object
    targets: object = None
    segment_ids: object = None
    positions: object = None
    loss_mask: object = None
    row_source: object = None
    fgram_ids: object = None
    fgram_tokens: object = None
    fgram_lengths: object = None
    fgram_slot: object = None
    fgram_unique: object = None
    fgram_rows: object = None
    fgram_matched: object = None
    ngram_ids: object = None

    @classmethod
    def empty(cls, rows: int, seq_len: int) -> "Batch":
        """A batch of padding only (segment 0, loss mask 0): what a process without data evaluates."""
        return cls(**{k: np.zeros((rows, seq_len), dtype) for k, dtype in BASE_DTYPES.items()})

    @classmethod
    def from_arrays(cls, arrays: dict) -> "Batch":
        return cls(**arrays)

    def arrays(self) -> dict:
        """{field: array} of the fields present, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def replace(self, **fields) -> "Batch":
        return dataclasses.replace(self, **fields)

    def for_device(self) -> "Batch":
        """The fields the device steps read: the host-only ones (HOST_ONLY) dropped."""
        return self.replace(**{k: None for k in HOST_ONLY})


jax.tree_util.register_dataclass(Batch, data_fields=[f.name for f in dataclasses.fields(Batch)], meta_fields=[])
