"""Engram's n-gram ids, computed on the host (docs/method.md §9; the tables: model/engram.py).

Each Engram layer l has its own odd multipliers m_{l,0..n-1} (`multipliers`) and, for every order i = 2..n and head
k, a prime modulus M (model/engram.py `heads`). The id of the i tokens ending at position t in that head is the
paper's multiplicative-XOR hash taken modulo M:
    id = (x[t] m_0  XOR  x[t-1] m_1  XOR ...  XOR  x[t-i+1] m_{i-1}) mod M,
where a token before the position's document (or row) counts as PAD = V = model.vocab_size, an id no token has, as
DeepSeek's demo pads the row's start; our rule beyond it: a document of a packed row is padded at its own start, so
no n-gram reaches into another document (docs/method.md §2), and every position has a row (no reserved one). Each
product is below 2^63 (x <= V and m <= (2^63 - 1) / V), so int64 holds it exactly; an int32 product, the arithmetic a
GPU kernel might use, would wrap. The multipliers come from SHA-256 of (seed, layer, r), not from a random generator
whose stream a library update could change: an exported model's ids must stay the ids it was trained on.

With engram.compress_tokens (the paper's tokenizer compression, §2.2), the tokens are first mapped to canonical ids
(`compression`): tokens whose texts normalise alike (NFKC, accents stripped, lower case, whitespace collapsed and
trimmed) share one, so "The", " the" and "the" are one token to the hash.

Only token ids and segment ids are read, so a batch's ids are known before the device needs them: EngramHasher is a
batch transform of the loader and of serving, with Over-Encoding's interface (data/ngram_hash.py NgramHasher); the
ids travel in the same Batch field, `ngram_ids` [B, T, sum over Engram layers of (n-1)K].
"""
from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np

from scone_jax.batch import Batch
from scone_jax.data.ngram_hash import check_token_range

_INT64_MAX = 2**63 - 1


def multipliers(seed: int, layer: int, n: int, vocab_size: int) -> list[int]:
    """The odd multipliers m_0..m_{n-1} of the Engram at block `layer`, each at most (2^63 - 1) / (V + 1), so a
    token (or PAD = V) times one stays below 2^63."""
    half = (_INT64_MAX // (vocab_size + 1) + 1) // 2  # m = 2r + 1 <= 2 half - 1 <= bound
    out = []
    for r in range(n):
        digest = hashlib.sha256(f"engram/{seed}/{layer}/{r}".encode()).digest()
        out.append(2 * (int.from_bytes(digest[:8], "little") % half) + 1)
    return out


def canonical(text: str) -> str:
    """A token's text normalised as the paper's compression does: NFKC, then NFD with the combining marks (accents)
    dropped, lower case, runs of whitespace as one space, trimmed (whitespace alone stays one space)."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = re.sub(r"[ \t\r\n]+", " ", "".join(c for c in text if unicodedata.category(c) != "Mn").lower())
    return " " if text == " " else text.strip()


def compression(texts: list[str], spellings: list[str], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: each token id's canonical id, numbered by first appearance. `texts` are the tokenizer's
    decodings of its ids one at a time, `spellings` its vocabulary entries; a token whose decoding is empty, holds
    U+FFFD (a byte piece) or normalises to nothing keeps its own spelling as its key, so control tokens (<s>, </s>)
    and byte pieces stay apart. Ids past the tokenizer's (model.vocab_size rounds up) keep ids of their own."""
    keys, out = {}, np.arange(vocab_size, dtype=np.int64)
    for i, (text, spelling) in enumerate(zip(texts, spellings)):
        norm = canonical(text) if text and "\ufffd" not in text else ""
        out[i] = keys.setdefault(norm or "\0" + spelling, len(keys))
    for i in range(len(texts), vocab_size):
        out[i] = len(keys) + i - len(texts)
    return out


def tokenizer_compression(tokenizer, vocab_size: int) -> np.ndarray:
    """`compression` of a scone_jax Tokenizer's ids."""
    ids = range(tokenizer.vocab_size)
    return compression([tokenizer.decode([i]) for i in ids], [tokenizer.id_to_token(i) for i in ids], vocab_size)


def engram_ids(tokens: np.ndarray, segment_ids: np.ndarray | None, heads: list[tuple[int, int]],
               mults: list[int], vocab_size: int) -> np.ndarray:
    """int32 [B, T, len(heads)]: one Engram layer's id in each (order, modulus) head (module docstring);
    segment_ids None: every row one document."""
    tokens = check_token_range(tokens, vocab_size, "Engram")
    x = tokens.astype(np.int64)
    segments = np.ones_like(x) if segment_ids is None else np.asarray(segment_ids)
    rows, length = x.shape
    max_order = max(order for order, _ in heads)
    mixed = {}  # order -> the XOR of its products [B, T]
    h = np.zeros((rows, length), np.int64)
    for r in range(max_order):  # token t - r, PAD where it is outside t's row or document
        shifted = np.full((rows, length), vocab_size, np.int64)
        same = np.zeros((rows, length), bool)
        if r < length:
            shifted[:, r:] = x[:, : length - r]
            same[:, r:] = segments[:, : length - r] == segments[:, r:]
        h = h ^ (np.where(same, shifted, vocab_size) * np.int64(mults[r]))
        mixed[r + 1] = h
    out = np.empty((rows, length, len(heads)), np.int32)
    for s, (order, modulus) in enumerate(heads):
        out[..., s] = mixed[order] % modulus
    return out


class EngramHasher:
    """The host side of Engram: adds every Engram layer's ids to a Batch's `ngram_ids`, layer after layer (the
    decoder's Engram layers in block order). Plain attributes, so grain's workers take it by pickle."""

    def __init__(self, layer_heads: list[list[tuple[int, int]]], layer_multipliers: list[list[int]], vocab_size: int,
                 compress: np.ndarray | None = None):
        self.layer_heads = [[(int(i), int(m)) for i, m in heads] for heads in layer_heads]
        self.layer_multipliers = [[int(m) for m in mults] for mults in layer_multipliers]
        self.vocab_size = int(vocab_size)
        self.max_order = max(order for heads in self.layer_heads for order, _ in heads)
        self.compress = compress  # [vocab_size] canonical ids (`compression`), None: the tokens themselves

    def __call__(self, batch: Batch) -> Batch:
        return batch.replace(ngram_ids=self.ids(batch.inputs, batch.segment_ids))

    def ids(self, tokens: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
        tokens = np.asarray(tokens)
        if self.compress is not None:
            if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
                engram_ids(tokens, segment_ids, self.layer_heads[0], self.layer_multipliers[0], self.vocab_size)
            tokens = self.compress[tokens]
        return np.concatenate([engram_ids(tokens, segment_ids, heads, mults, self.vocab_size)
                               for heads, mults in zip(self.layer_heads, self.layer_multipliers)], axis=-1)

    def next_ids(self, history: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One generated token per row: (its ids [B, S], the history to pass next time). `history` [B, h] holds the
        row's previous tokens (at most the last n-1 matter), all of one document; fewer than n-1 of them: the
        document starts there, so the missing ones are PAD, as in `ids` of the whole sequence."""
        window = np.concatenate([np.asarray(history)[:, -(self.max_order - 1):], np.asarray(new)[:, None]], axis=1)
        return self.ids(window)[:, -1], window[:, 1:] if window.shape[1] == self.max_order else window
