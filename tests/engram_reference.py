"""Engram written from the paper's formulas alone (DeepSeek-AI 2026, arXiv 2601.07372, §2.2-2.3, with docs/method.md
§9's choices), in plain Python integers and numpy float64, one position at a time. Shares no code with scone_jax/.

Hash (§2.2, multiplicative-XOR): the id of the i tokens ending at t in a head of prime modulus M is
    (x_t m_0 XOR x_{t-1} m_1 XOR ... XOR x_{t-i+1} m_{i-1}) mod M,
a token before t's document being PAD = V. Gate and fusion (§2.3), with e_t the heads' rows concatenated:
    k = e W_K, v = e W_V, alpha = sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(d)), v~ = alpha v,
    Y_t = SiLU(sum_j W_j * RMSNorm(v~)_{t - j delta}) + v~_t   (taps before t's document: 0),   h <- h + Y.
RMSNorm(x) = x / sqrt(mean(x^2) + eps) * scale.
"""
from __future__ import annotations

import math
import unicodedata

import numpy as np


def normalised(text: str) -> str:
    """§2.2's tokenizer compression: NFKC, NFD without combining marks, lower case, whitespace runs as one space,
    trimmed; a text of whitespace alone is one space."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    out = []
    for c in text:
        if unicodedata.category(c) == "Mn":
            continue
        c = " " if c in " \t\r\n" else c.lower()
        if not (c == " " and out and out[-1] == " "):
            out.append(c)
    text = "".join(out)
    return text if text == " " else text.strip(" ")


def canonical_ids(texts, spellings, vocab: int) -> list[int]:
    """Each id's canonical id: texts normalising alike share the id of the first of them; an empty decoding, one
    holding U+FFFD or one normalising to nothing is keyed by its spelling; ids past the texts keep their own."""
    seen, out = {}, []
    for text, spelling in zip(texts, spellings):
        key = normalised(text) if text and "\ufffd" not in text else ""
        key = ("text", key) if key else ("spelling", spelling)
        out.append(seen.setdefault(key, len(seen)))
    return out + [len(seen) + i for i in range(vocab - len(texts))]


def is_prime(value: int) -> bool:
    return value >= 2 and all(value % p for p in range(2, int(value ** 0.5) + 1))


def moduli(rows: int, count: int) -> list[int]:
    """The first `count` primes >= rows."""
    out, candidate = [], rows
    while len(out) < count:
        if is_prime(candidate):
            out.append(candidate)
        candidate += 1
    return out


def ngram_id(tokens, segments, t: int, order: int, mults, modulus: int, vocab: int) -> int:
    h = 0
    for r in range(order):
        inside = t - r >= 0 and segments[t - r] == segments[t]
        h ^= (int(tokens[t - r]) if inside else vocab) * int(mults[r])
    return h % modulus


def row_ids(tokens, segments, heads, mults, vocab: int) -> np.ndarray:
    """[T, H] ids of one packed row for one Engram layer's (order, modulus) heads."""
    return np.array([[ngram_id(tokens, segments, t, order, mults, modulus, vocab) for order, modulus in heads]
                     for t in range(len(tokens))], np.int64)


def rms_norm(x, scale, eps: float):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x) + eps) * scale


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def silu(x):
    return x / (1.0 + np.exp(-x))


def layer(h, ids, segments, tables, w_key, w_value, scales, conv, dilation: int, eps: float) -> np.ndarray:
    """h + Y [T, d] of one row: `tables` a list of each head's [M, width] rows, `scales` the (hidden, key, conv)
    RMSNorm scales, `conv` [w, d] (W_j weighs the position j * dilation back)."""
    h = np.asarray(h, np.float64)
    length, d = h.shape
    gated = np.zeros((length, d))
    for t in range(length):
        e = np.concatenate([table[ids[t, s]] for s, table in enumerate(tables)]).astype(np.float64)
        k, v = e @ w_key, e @ w_value
        alpha = sigmoid(float(rms_norm(h[t], scales[0], eps) @ rms_norm(k, scales[1], eps)) / math.sqrt(d))
        gated[t] = alpha * v
    normed = np.stack([rms_norm(gated[t], scales[2], eps) for t in range(length)])
    out = np.zeros((length, d))
    for t in range(length):
        c = np.zeros(d)
        for j in range(len(conv)):
            source = t - j * dilation
            if source >= 0 and segments[source] == segments[t]:
                c += conv[j] * normed[source]
        out[t] = h[t] + silu(c) + gated[t]
    return out
