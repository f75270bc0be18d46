"""Over-Encoding written from the paper's formula alone (Huang et al. 2025, arXiv 2501.16975, §3.2 and Algorithm 1,
with docs/method.md §8's choices), in plain Python and numpy float64. Shares no code with scone_jax/.

Each of the k(n-1) tables s = (i-2)k + j (order i = 2..n, j = 0..k-1) has modulus M_s = m + 2s, M_s + 1 rows (row 0:
no n-gram) of width d / (k(n-1)), and its own [width, d] projection P_s. At position t of one document piece
x_0..x_L (never looking across pieces), table s's id is 0 if t < i - 1, else 1 + (sum_{r<i} x_{t-r} V^r mod M_s) in
Python's unbounded integers; the input is (T[x_t] + sum_s E_s[id_s] P_s) / (1 + k(n-1)), times the embedding
multiplier.
"""
from __future__ import annotations

import numpy as np


def layout(n: int, k: int, m: int) -> list[tuple[int, int]]:
    """[(order, modulus)] of the tables, s = (order - 2) * k + j."""
    return [(order, m + 2 * ((order - 2) * k + j)) for order in range(2, n + 1) for j in range(k)]


def ngram_id(piece, t: int, order: int, modulus: int, vocab: int) -> int:
    if t < order - 1:
        return 0
    return 1 + sum(int(piece[t - r]) * vocab ** r for r in range(order)) % modulus


def row_ids(tokens, segments, tables, vocab: int) -> np.ndarray:
    """[T, S] ids of one packed row: each document piece (a run of one segment id > 0) on its own, padding 0."""
    out = np.zeros((len(tokens), len(tables)), np.int64)
    for segment in np.unique(segments[segments > 0]):
        cols = np.flatnonzero(segments == segment)
        piece = [int(x) for x in tokens[cols]]
        for t, col in enumerate(cols):
            out[col] = [ngram_id(piece, t, order, modulus, vocab) for order, modulus in tables]
    return out


def input_rows(piece_ids, tokens, token_table, tables, projections, multiplier=1.0) -> np.ndarray:
    """[L, d] inputs of one piece: token rows and per-table rows E_s[id] P_s, averaged over 1 + S terms."""
    x = token_table[np.asarray(tokens)].astype(np.float64)
    for s, (table, projection) in enumerate(zip(tables, projections)):
        x = x + table[piece_ids[:, s]] @ projection
    return x / (1 + len(tables)) * multiplier
