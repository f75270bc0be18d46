"""Over-Encoding (Huang et al. 2025, "Over-Tokenized Transformer", arXiv 2501.16975, §3.2 and Algorithm 1): SCONE's
baseline of hashed n-gram input embeddings, the decoder's second input provider (docs/method.md §8).

The decoder's input at a position is the mean of 1 + k(n-1) rows of width d: T(token) and, for every order
i = 2..n and j = 0..k-1, table s = (i-2)k + j's row for the i tokens ending there, projected to d:
    (T(x_t) + sum_s P_s E_s[id_s(t)]) / (1 + k(n-1)),   id_s(t) = (sum_r x_{t-r} V^r) mod M_s,  M_s = m + 2s.
The host computes the ids (data/ngram_hash.py, in the loader: the device gets a static [B, T, k(n-1)] int
array); id 0 is each table's reserved "no n-gram" row (the n-gram would reach before its row or document),
a hashed n-gram reads row 1 + its hash. The tables are one [sum_s (M_s + 1), d / (k(n-1))] array, each at its
offset, its rows padded to a multiple of 128 so the tensor axis splits it as it splits T. A position's k(n-1)
rows are concatenated (width d) and projected by one [d, d] matrix: the paper's separate projection of each
table's row, summed, written as one matmul (P_s is the matrix's s-th block of rows). The tables live in the
decoder, so an export's decoder parameters hold them and serving runs them on the accelerator.
"""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scone_jax.model.layers import dtype_of, normal
from scone_jax.sharding import constrain

_MAX_MODULUS = 2**31 - 1  # the ids reach the device as int32
_ROW_MULTIPLE = 128


def tables(oe_cfg) -> list[tuple[int, int]]:
    """[(order, modulus)] of tables s = 0 .. k(n-1)-1, order-major: order 2's k tables first, modulus m + 2s."""
    return [(order, oe_cfg.m + 2 * ((order - 2) * oe_cfg.k + j))
            for order in range(2, oe_cfg.n + 1) for j in range(oe_cfg.k)]


def check(config) -> None:
    """ValueError naming the key and the fix where overencoding's settings do not fit the run: SCONE or a Hugging
    Face checkpoint beside it, a width that does not split into the k(n-1) tables, a modulus beyond int32, or a
    table's modulus m + 2s sharing a factor with the ids' base V = model.vocab_size (once it is known: 0 means the
    tokenizer's size rounded up to 128, so only an even m is refused before the tokenizer loads; run.build checks
    again after)."""
    oe, m = config.overencoding, config.model
    if not oe.enabled:
        return
    if config.scone.enabled:
        raise ValueError("overencoding.enabled and scone.enabled are both set: Over-Encoding is SCONE's baseline, "
                         "another input layer, and one run trains one of them. Fix: set one of them to False.")
    if m.get("init_from_hf", ""):
        raise ValueError(f"overencoding.enabled with model.init_from_hf={m.init_from_hf!r}: a Hugging Face "
                         "checkpoint has no n-gram tables to start from. Fix: drop one of the two.")
    count = oe.k * (oe.n - 1)
    if m.d_model % count:
        raise ValueError(f"model.d_model={m.d_model} does not split into the k(n-1) = {oe.k} x {oe.n - 1} = {count} "
                         f"tables of overencoding.k={oe.k} and overencoding.n={oe.n}. Fix: a k and n whose k(n-1) "
                         f"divides {m.d_model}.")
    largest = tables(oe)[-1][1]
    if largest > _MAX_MODULUS:
        raise ValueError(f"overencoding.m={oe.m} gives moduli up to {largest:,}, beyond the int32 ids the device "
                         f"reads. Fix: overencoding.m <= {_MAX_MODULUS - 2 * (count - 1):,}.")
    vocab = m.vocab_size
    if not vocab and oe.m % 2 == 0:  # model.vocab_size 0 becomes the tokenizer's size rounded up to 128: even
        raise ValueError(f"overencoding.m={oe.m} is even, and model.vocab_size (0: the tokenizer's size rounded up "
                         "to a multiple of 128) will be too; every table's modulus m + 2s must be coprime with it, "
                         f"the base of the n-gram ids. Fix: an odd m, e.g. overencoding.m={oe.m + 1}.")
    if vocab:
        _check_coprime(oe, count, vocab)


def _check_coprime(oe, count: int, vocab: int) -> None:
    """Every table's modulus M coprime with V: where g = gcd(M, V) > 1, V^r is a multiple of g, so an n-gram's oldest
    tokens x and x + M/g get the same id in that table (with V = 32,000 and M = 100,005: tokens 20,001 apart).
    The k(n-1) moduli m, m + 2, ... cover every residue of an odd prime p <= k(n-1), so a V with such a factor has
    no good m: the fix is then a vocabulary size."""
    bad = next(((s, modulus) for s, (_, modulus) in enumerate(tables(oe)) if math.gcd(modulus, vocab) > 1), None)
    if bad is None:
        return
    s, modulus = bad
    problem = (f"overencoding.m={oe.m} gives table {s} the modulus m + 2*{s} = {modulus:,}, which shares the factor "
               f"{math.gcd(modulus, vocab)} with model.vocab_size={vocab}, the base of the n-gram ids (id = "
               f"sum_r x[t-r] V^r mod m + 2s): that table would give an n-gram's oldest tokens x and "
               f"x + {modulus // math.gcd(modulus, vocab):,} the same id.")
    fix = coprime_m(oe.m, count, vocab)
    if fix is not None:
        raise ValueError(f"{problem} Fix: an m whose {count} moduli m, m + 2, ... are all coprime with {vocab}, e.g. "
                         f"overencoding.m={fix}.")
    blocking = next(p for p in range(3, count + 1) if vocab % p == 0 and all(p % q for q in range(2, p)))
    new_vocab = next(v for v in range(-(-vocab // 128) * 128, 2**31, 128) if coprime_m(oe.m, count, v) is not None)
    raise ValueError(f"{problem} No m avoids it: the {count} tables' moduli m, m + 2, ... always include a multiple "
                     f"of {blocking}. Fix: a model.vocab_size without a prime factor <= {count} (or fewer tables, "
                     f"overencoding.k or n), e.g. model.vocab_size={new_vocab} with "
                     f"overencoding.m={coprime_m(oe.m, count, new_vocab)}.")


def coprime_m(m: int, count: int, vocab: int) -> int | None:
    """The m' nearest above m (else below it) whose count moduli m', m' + 2, ... are all coprime with vocab and fit
    int32; None where an odd prime <= count divides vocab (count moduli spaced 2 apart cover all its residues)."""
    if any(vocab % p == 0 and all(p % q for q in range(2, p)) for p in range(3, count + 1)):
        return None
    top = _MAX_MODULUS - 2 * (count - 1)
    for candidate in itertools.chain(range(min(m, top), top + 1), range(min(m, top) - 1, 1, -1)):
        if all(math.gcd(candidate + 2 * s, vocab) == 1 for s in range(count)):
            return candidate
    return None


def parameter_rows(oe_cfg) -> int:
    """Rows of the tables' one array: every table's M_s + 1, padded to a multiple of 128."""
    rows = sum(modulus + 1 for _, modulus in tables(oe_cfg))
    return -(-rows // _ROW_MULTIPLE) * _ROW_MULTIPLE


class OverEncoding(nnx.Module):
    """The n-gram tables and their projection (module docstring). Initialisation, which the paper leaves open
    (docs/method.md §8): table rows N(0, model.init_std), as T's; the projection N(0, 1/sqrt(width)), so each
    table's projected row starts at the scale of a token row and the mean weighs its 1 + k(n-1) terms alike."""

    def __init__(self, model_cfg, oe_cfg, rngs: nnx.Rngs):
        layout = tables(oe_cfg)
        self.num_tables = len(layout)
        width = model_cfg.d_model // self.num_tables
        self.offsets = tuple(int(x) for x in np.cumsum([0] + [modulus + 1 for _, modulus in layout])[:-1])
        self.dtype = dtype_of(model_cfg.dtype)
        # An embedding by its name (model/roles.py): never weight-decayed, like T. The projection is decayed.
        self.ngram_tables = nnx.Embed(parameter_rows(oe_cfg), width, dtype=self.dtype,
                                      param_dtype=dtype_of(model_cfg.param_dtype),
                                      embedding_init=normal(model_cfg.init_std, ("vocab", None)), rngs=rngs)
        self.projection = nnx.Linear(width * self.num_tables, model_cfg.d_model, use_bias=False, dtype=self.dtype,
                                     param_dtype=dtype_of(model_cfg.param_dtype),
                                     kernel_init=normal(1.0 / math.sqrt(width), (None, "embed")), rngs=rngs)

    def __call__(self, token_rows: jax.Array, ngram_ids: jax.Array) -> jax.Array:
        """(T(x) [B, T, d], ids [B, T, k(n-1)] with 0 = no n-gram) -> the mean of T(x) and the projected rows."""
        if ngram_ids.shape[-1] != self.num_tables:
            raise ValueError(f"The batch carries {ngram_ids.shape[-1]} n-gram ids per position but the decoder has "
                             f"{self.num_tables} Over-Encoding tables: the ids were made for another overencoding "
                             "config.")
        table = constrain(self.ngram_tables.embedding[...], ("vocab", None))
        rows = jnp.take(table, ngram_ids + jnp.asarray(self.offsets, ngram_ids.dtype), axis=0).astype(self.dtype)
        rows = constrain(rows.reshape(*ngram_ids.shape[:-1], -1), ("batch",) + (None,) * (ngram_ids.ndim - 1))
        return (token_rows.astype(self.dtype) + self.projection(rows)) / (1 + self.num_tables)
