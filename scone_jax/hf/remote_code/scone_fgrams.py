"""The host side of a SCONE export for transformers, with numpy alone: the f-gram table's rows, read where they lie on
disk, and the longest f-gram ending at each position (scone_jax's docs/method.md §2).

Files (safetensors: an 8-byte little-endian header length, a JSON header, then each tensor's raw bytes):
  fgram_table.safetensors  "rows"    [S, d]  the decoder's input at a position where f-gram r is the longest match
                                             (BF16 or F32), row r = f-gram r
  fgram_vocab.safetensors  "tokens"  [S, K]  int32, f-gram r's token ids, right-padded
                           "lengths" [S]     int32, its number of tokens (2..K)
Both are memory-mapped, never read whole: a 10M x 2560 bf16 table is 51 GB. `FgramTable.gather` reads the rows a
batch needs (each distinct row once, through the page cache: a few microseconds a row from RAM, one read from disk);
the vocabulary is read once, to build the matcher.

The matcher keeps one sorted int64 array of keys and the f-gram id of each. An f-gram of n tokens is keyed by its
last token and the id of its first n-1 tokens, which are an f-gram too (the vocabulary is closed under prefixes):
  n = 2: t1 * V + t2        n >= 3: (V + id(t1 .. t_{n-1})) * V + t_n        (V: the tokenizer's vocabulary size)
so the n-gram ending at position e is found from the (n-1)-gram ending at e-1 with one binary search. Host memory:
16 bytes per f-gram (160 MB for 10M); building it sorts S keys K-1 times (seconds for 10M). Matching a batch of N
positions costs at most K-1 binary searches per position: O(N K log S).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

TABLE_FILE = "fgram_table.safetensors"
VOCAB_FILE = "fgram_vocab.safetensors"
# numpy's view of each stored dtype: bf16 rows are read as their 16 bits (numpy has no bfloat16; torch views them).
STORED = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "I32": np.dtype("<i4")}
_FIX = "Fix: copy the export directory again, whole, from where scone_jax.serving.export wrote it."


class SconeExportError(ValueError):
    """A SCONE export whose files disagree with its config.json; the message is one line naming the file and the fix."""


def open_tensor(path: str, name: str, dtype: str, shape: tuple[int, ...]) -> np.memmap | np.ndarray:
    """Tensor `name` of the safetensors file `path`, memory-mapped, after checking that it has `dtype` and `shape`
    and that the file's size is exactly its header plus its tensors (a truncated or padded file is refused)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + header_len > size:
                raise SconeExportError(f"{path} is {size} bytes, too short for its header: not a complete safetensors "
                                       f"file. {_FIX}")
            header = json.loads(f.read(header_len).decode("utf-8"))
    except OSError as e:
        raise SconeExportError(f"{path} cannot be read ({e.strerror or e}): config.json's fgrams section names it. "
                               f"{_FIX}") from None
    except (UnicodeDecodeError, ValueError):
        raise SconeExportError(f"{path} has a header that is not JSON: not a safetensors file. {_FIX}") from None
    header.pop("__metadata__", None)
    try:
        data_bytes = sum(int(e["data_offsets"][1]) - int(e["data_offsets"][0]) for e in header.values())
    except (KeyError, TypeError, IndexError, ValueError):
        raise SconeExportError(f"{path} has a malformed header: not a safetensors file. {_FIX}") from None
    entry = header.get(name)
    want = math.prod(shape) * STORED[dtype].itemsize
    if entry is None or entry.get("dtype") != dtype or list(entry.get("shape", ())) != list(shape):
        found = None if entry is None else f"{entry.get('dtype')} {entry.get('shape')}"
        raise SconeExportError(f"{path} holds {name} as {found}, but config.json's fgrams section says {dtype} "
                               f"{list(shape)}: the file belongs to another export. {_FIX}")
    if size != 8 + header_len + data_bytes or entry["data_offsets"][1] - entry["data_offsets"][0] != want:
        raise SconeExportError(f"{path} is {size} bytes, but config.json's fgrams section ({name}: {dtype} "
                               f"{list(shape)}) needs {8 + header_len + data_bytes}: it is truncated or damaged. {_FIX}")
    if want == 0:
        return np.zeros(shape, STORED[dtype])
    return np.memmap(path, dtype=STORED[dtype], mode="r", offset=8 + header_len + entry["data_offsets"][0],
                     shape=tuple(shape))


class FgramTable:
    """The exported rows [S, d], memory-mapped; `gather` returns the rows of given f-gram ids (stored dtype)."""

    def __init__(self, path: str, num_fgrams: int, width: int, dtype: str):
        if dtype not in ("BF16", "F16", "F32"):
            raise SconeExportError(f"config.json's fgrams.dtype={dtype!r} is not one of BF16, F16, F32. {_FIX}")
        self.dtype = dtype
        self.rows = open_tensor(path, "rows", dtype, (num_fgrams, width))

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Rows [len(ids), d] of the f-grams `ids` (each >= 0); in a large batch each distinct row is read once."""
        ids = np.asarray(ids, np.int64)
        if len(ids) <= 64:  # decoding: sorting costs more than reading a row twice
            return np.asarray(self.rows[ids])
        unique, inverse = np.unique(ids, return_inverse=True)
        return np.asarray(self.rows[unique])[inverse.reshape(-1)]


class FgramMatcher:
    """Longest f-gram ending at each position, within each row's real tokens (module docstring)."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, vocab_size: int):
        tokens, lengths = np.asarray(tokens, np.int64), np.asarray(lengths, np.int64)
        self.vocab_size, self.max_len = int(vocab_size), int(tokens.shape[1])
        v = self.vocab_size
        if (v + len(lengths) + 1) * v >= 2**63:
            raise SconeExportError(f"{len(lengths)} f-grams over a vocabulary of {v} tokens do not fit 64-bit keys.")
        self.keys, self.ids = np.zeros(0, np.int64), np.zeros(0, np.int64)
        for n in range(2, self.max_len + 1):
            rows = np.flatnonzero(lengths == n)
            grams = tokens[rows, :n]
            if n == 2:
                keys = grams[:, 0] * v + grams[:, 1]
            else:
                prefix = self._ids_of(grams[:, :-1])
                if (prefix < 0).any():
                    r = int(rows[np.argmax(prefix < 0)])
                    raise SconeExportError(f"f-gram {r} {tokens[r, :n].tolist()} has a prefix that is no f-gram: the "
                                           f"vocabulary is not closed under prefixes. {_FIX}")
                keys = (v + prefix) * v + grams[:, -1]
            keys, ids = np.concatenate([self.keys, keys]), np.concatenate([self.ids, rows])
            order = np.argsort(keys, kind="stable")
            self.keys, self.ids = keys[order], ids[order]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The f-gram id of each key, -1 where there is none."""
        if len(self.keys) == 0:
            return np.full(keys.shape, -1, np.int64)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[at] == keys, self.ids[at], -1)

    def _ids_of(self, grams: np.ndarray) -> np.ndarray:
        """Ids of n-gram rows [m, n] (n >= 2), -1 where one (or a prefix of it) is no f-gram."""
        v = self.vocab_size
        ids = self.lookup(grams[:, 0] * v + grams[:, 1])
        for j in range(2, grams.shape[1]):
            ids = np.where(ids >= 0, self.lookup((v + np.maximum(ids, 0)) * v + grams[:, j]), -1)
        return ids

    def longest(self, tokens: np.ndarray, real: np.ndarray) -> np.ndarray:
        """int64 [B, L]: the id of the longest f-gram ending at each position whose tokens are all real (`real`
        [B, L], e.g. the attention mask: a match never reaches across padding, left or right), -1 where none.
        Tokens outside [0, V) belong to no f-gram."""
        tokens = np.asarray(tokens, np.int64)
        ok = np.asarray(real, bool) & (tokens >= 0) & (tokens < self.vocab_size)
        best = np.full(tokens.shape, -1, np.int64)
        if tokens.shape[1] < 2:
            return best
        v = self.vocab_size
        # current[:, e] = id of the n-gram ending at e (n = 2 first), -1 if none
        current = np.full(tokens.shape, -1, np.int64)
        pair = ok[:, :-1] & ok[:, 1:]
        current[:, 1:][pair] = self.lookup(tokens[:, :-1][pair] * v + tokens[:, 1:][pair])
        best[:] = current
        for _ in range(3, self.max_len + 1):
            grows = (current[:, :-1] >= 0) & ok[:, 1:]  # an (n-1)-gram ends at e-1 and token e is real
            if not grows.any():
                break
            longer = np.full(tokens.shape, -1, np.int64)
            longer[:, 1:][grows] = self.lookup((v + current[:, :-1][grows]) * v + tokens[:, 1:][grows])
            best = np.where(longer >= 0, longer, best)
            current = longer
        return best


class Fgrams:
    """The table and the matcher of an export directory, as its config.json's `fgrams` section describes them."""

    def __init__(self, directory: str, section: dict):
        try:
            s, k, d = int(section["num_fgrams"]), int(section["max_len"]), int(section["width"])
            vocab_size, dtype = int(section["vocab_size"]), str(section["dtype"])
            table, vocab = section.get("table", TABLE_FILE), section.get("vocabulary", VOCAB_FILE)
        except (KeyError, TypeError, ValueError) as e:
            raise SconeExportError(f"{os.path.join(directory, 'config.json')}: its fgrams section lacks or garbles "
                                   f"{e}. {_FIX}") from None
        self.table = FgramTable(os.path.join(directory, table), s, d, dtype)
        path = os.path.join(directory, vocab)
        tokens, lengths = open_tensor(path, "tokens", "I32", (s, k)), open_tensor(path, "lengths", "I32", (s,))
        self.matcher = FgramMatcher(tokens, lengths, vocab_size)
        self.max_len = k
