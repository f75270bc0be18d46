"""Over-Encoding's n-gram ids, computed on the host (docs/method.md §8; the tables: model/overencoding.py).

For table s of order i and modulus M (model/overencoding.py `tables` gives the (i, M) of each), the id at position
t is the paper's hash of the i tokens ending there, shifted by one so that 0 stays free for "no n-gram":
    id = 1 + (sum_{r=0}^{i-1} x[t-r] * V^r) mod M,       V = model.vocab_size (every token id is below it),
computed exactly: Horner's scheme in int64 with the modulus taken at every step (h < M < 2^31 and x < V < 2^31,
so h * V + x < 2^62 never overflows; the int32 sums a GPU kernel might use would). The id is 0 where the
n-gram would reach before the row's first position or into another document of the packed row (segment ids
differ; padding, segment 0, has none), our rule beyond the paper, as SCONE's matching never crosses a document
(docs/method.md §2). Only token ids and segment ids are read, so the ids of a batch are known before the device
needs them, like f-gram matches: NgramHasher is a batch transform of the loader (training/assets.py) and of
serving (serving/inference.py), and `next_ids` extends a generation by one token from the last n-1 tokens.
"""
from __future__ import annotations

import numpy as np

from scone_jax.batch import Batch

NO_NGRAM = 0  # every table's reserved row


def check_token_range(tokens, vocab_size: int, what: str) -> np.ndarray:
    """`tokens` as an array, ValueError in one line if one lies outside [0, vocab_size), the range `what` ids are
    computed over (Over-Encoding's here, Engram's in data/engram_hash.py)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
        raise ValueError(f"Token id {bad} is outside [0, {vocab_size}) (model.vocab_size), the range the {what} ids "
                         "are computed over: the tokens and the model do not belong together.")
    return tokens


def ngram_ids(tokens: np.ndarray, segment_ids: np.ndarray | None, tables: list[tuple[int, int]],
              vocab_size: int) -> np.ndarray:
    """int32 [B, T, len(tables)]: each position's id in each (order, modulus) table (module docstring);
    segment_ids None: every row one document."""
    tokens = check_token_range(tokens, vocab_size, "n-gram")
    x = tokens.astype(np.int64)
    segments = np.ones_like(x) if segment_ids is None else np.asarray(segment_ids)
    rows, length = x.shape
    out = np.zeros((rows, length, len(tables)), np.int32)
    for s, (order, modulus) in enumerate(tables):
        if order > length:
            continue  # no position has order - 1 tokens before it in the row
        span = length - order + 1  # positions t = order-1 .. length-1 have a whole n-gram inside the row
        h = np.zeros((rows, span), np.int64)
        for r in range(order - 1, -1, -1):  # the oldest token first: h = h * V + x[t - r], mod M each step
            h = (h * vocab_size + x[:, order - 1 - r: length - r]) % modulus
        inside = (segments[:, : span] == segments[:, order - 1:]) & (segments[:, order - 1:] != 0)
        out[:, order - 1:, s] = np.where(inside, h + 1, NO_NGRAM)
    return out


class NgramHasher:
    """The host side of Over-Encoding: adds `ngram_ids` to a Batch (its inputs and segment ids read), as the
    f-gram batcher adds its arrays (fgram/dedup.py). Plain attributes, so grain's workers take it by pickle."""

    def __init__(self, tables: list[tuple[int, int]], vocab_size: int):
        self.tables, self.vocab_size = [(int(i), int(m)) for i, m in tables], int(vocab_size)
        self.max_order = max(order for order, _ in self.tables)

    def __call__(self, batch: Batch) -> Batch:
        return batch.replace(ngram_ids=self.ids(batch.inputs, batch.segment_ids))

    def ids(self, tokens: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
        return ngram_ids(tokens, segment_ids, self.tables, self.vocab_size)

    def next_ids(self, history: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One generated token per row: (its ids [B, S], the history to pass next time). `history` [B, h] holds the
        row's previous tokens (at most the last n-1 matter; a prompt whole is fine), all of one document."""
        window = np.concatenate([np.asarray(history)[:, -(self.max_order - 1):], np.asarray(new)[:, None]], axis=1)
        return self.ids(window)[:, -1], window[:, 1:] if window.shape[1] == self.max_order else window
