"""The f-gram vocabulary: its arrays, its fingerprint, and its on-disk format.

On disk a vocabulary is a directory (local path or any tensorstore kvstore URL,
e.g. `gs://bucket/run/fgrams`) holding three zarr3 arrays and one JSON file:

    tokens/     int32 [S, K]  row r = token ids of f-gram r, right-padded with PAD (0)
    lengths/    int32 [S]     number of real tokens in row r (2..K)
    counts/     int64 [S]     occurrences of f-gram r in the counted corpus
    vocab.json  {"format", "version", "max_len", "num_fgrams", "min_count",
                 "tokens_counted", "vocab_size", "tokenizer_fingerprint", "fingerprint",
                 "checksums": {array name: CRC-32 of its bytes as stored}}

Rows are sorted by rank: count descending, then shorter first, then token ids
ascending, so row r is f-gram id r. The pad value 0 is a valid token id on
purpose: padded rows can be embedded without out-of-range gathers, and `lengths`
(not the pad value) says where an f-gram ends. vocab.json is written last and read
first, so a directory without it is an unfinished write; the fingerprint in it is
recomputed on load, so truncated or altered arrays are an error, not garbage. The per-array
checksums name the array that is missing chunks or damaged: zarr reads a missing chunk as zeros.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import tensorstore as ts

from scone_jax.runtime import storage
from scone_jax.runtime.crc import crc32_hex
from scone_jax.runtime.errors import one_line

PAD = 0
FORMAT = "scone_fgram_vocab"
VERSION = 1
_META = "vocab.json"
_ROWS_PER_CHUNK = 1 << 16
_ARRAYS = ("tokens", "lengths", "counts")


class VocabError(ValueError):
    """A vocabulary whose arrays are missing, damaged or unreadable."""


@dataclasses.dataclass(frozen=True, eq=False)
class FgramVocab:
    """S f-grams of 2..K tokens, ranked; see the module docstring for the layout."""

    tokens: np.ndarray  # int32 [S, K], padded with PAD
    lengths: np.ndarray  # int32 [S]
    counts: np.ndarray  # int64 [S]
    max_len: int
    min_count: int
    tokens_counted: int
    vocab_size: int  # the tokenizer's vocabulary size; token ids lie in [0, vocab_size)
    tokenizer_fingerprint: str = ""

    def __post_init__(self):
        s = len(self.lengths)
        if self.tokens.shape != (s, self.max_len) or self.counts.shape != (s,):
            raise ValueError(
                f"Inconsistent vocabulary arrays: tokens {self.tokens.shape}, lengths {self.lengths.shape}, "
                f"counts {self.counts.shape}, max_len {self.max_len}."
            )

    @classmethod
    def empty(cls, vocab_size: int, tokenizer_fingerprint: str = "") -> "FgramVocab":
        """No f-grams at all: what a plain decoder is served with (every position keeps T(token))."""
        return cls(tokens=np.zeros((0, 2), np.int32), lengths=np.zeros(0, np.int32), counts=np.zeros(0, np.int64),
                   max_len=2, min_count=1, tokens_counted=0, vocab_size=vocab_size,
                   tokenizer_fingerprint=tokenizer_fingerprint)

    @property
    def num_fgrams(self) -> int:
        return len(self.lengths)

    @property
    def metadata(self) -> dict:
        return {
            "max_len": int(self.max_len),
            "num_fgrams": self.num_fgrams,
            "min_count": int(self.min_count),
            "tokens_counted": int(self.tokens_counted),
            "vocab_size": int(self.vocab_size),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
        }

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of sha256 over the arrays and the metadata."""
        digest = hashlib.sha256(json.dumps(self.metadata, sort_keys=True).encode())
        for array, dtype in ((self.tokens, "<i4"), (self.lengths, "<i4"), (self.counts, "<i8")):
            digest.update(np.ascontiguousarray(array, dtype=dtype).tobytes())
        return digest.hexdigest()[:16]

    def fgram(self, row: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.tokens[row, : self.lengths[row]])


def build_vocab(
    grams: list[tuple[np.ndarray, np.ndarray]],
    *,
    num_fgrams: int,
    max_len: int,
    min_count: int,
    tokens_counted: int,
    vocab_size: int,
    tokenizer_fingerprint: str,
) -> FgramVocab:
    """Ranks candidate n-grams of all lengths together and keeps the top `num_fgrams`.

    `grams` holds one (tokens int32 [m, n], counts [m]) pair per length n, each
    n-gram listed once. Both extraction engines end here, so they agree exactly.
    """
    rows, lengths, counts = [], [], []
    for tokens, gram_counts in grams:
        n = tokens.shape[1]
        keep = gram_counts >= min_count
        tokens, gram_counts = tokens[keep], gram_counts[keep].astype(np.int64)
        if not _rows_ascend(tokens):  # one-machine extraction hands each length sorted already
            order = np.lexsort(tokens.T[::-1])  # lexsort sorts by its last key first
            tokens, gram_counts = tokens[order], gram_counts[order]
        padded = np.full((len(tokens), max_len), PAD, dtype=np.int32)
        padded[:, :n] = tokens
        rows.append(padded)
        lengths.append(np.full(len(padded), n, dtype=np.int32))
        counts.append(gram_counts)
    tokens = np.concatenate(rows) if rows else np.zeros((0, max_len), np.int32)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    # Rows now run by length, then token ids left to right: the tie order. So a stable sort by count
    # (descending) ranks them; only rows at or above the S-th count need sorting.
    candidates = np.arange(len(counts))
    if len(counts) > num_fgrams:
        cutoff = np.partition(counts, len(counts) - num_fgrams)[len(counts) - num_fgrams]
        tied = counts == cutoff
        needed = num_fgrams - int((counts > cutoff).sum())
        candidates = np.flatnonzero((counts > cutoff) | (tied & (np.cumsum(tied) <= needed)))
    order = candidates[np.argsort(-counts[candidates], kind="stable")]
    return FgramVocab(
        tokens=tokens[order],
        lengths=lengths[order],
        counts=counts[order],
        max_len=max_len,
        min_count=min_count,
        tokens_counted=tokens_counted,
        vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint,
    )


def _rows_ascend(tokens: np.ndarray) -> bool:
    """Whether the rows of `tokens` [m, n] are strictly ascending, comparing token ids left to right."""
    if len(tokens) < 2:
        return True
    before, after = tokens[:-1], tokens[1:]
    differ = before != after
    first = differ.argmax(axis=1)
    rows = np.arange(len(first))
    return bool((differ.any(axis=1) & (after[rows, first] > before[rows, first])).all())


def _array_spec(path: str, name: str) -> dict:
    return {"driver": "zarr3", "kvstore": storage.kvstore_url(path) + name + "/"}


def save_vocab(vocab: FgramVocab, path: str) -> None:
    """Writes `vocab` to `path` (a directory or a kvstore URL), replacing any vocabulary there."""
    store = ts.KvStore.open(storage.kvstore_url(path)).result()
    store.delete_range(ts.KvStore.KeyRange(_META, _META + "\0")).result()  # a half-rewritten dir reads as unfinished
    arrays = {"tokens": vocab.tokens, "lengths": vocab.lengths, "counts": vocab.counts}
    for name, array in arrays.items():
        chunk = [_ROWS_PER_CHUNK] + list(array.shape[1:])
        spec = _array_spec(path, name) | {
            "metadata": {
                "shape": list(array.shape),
                "data_type": str(array.dtype),
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
            }
        }
        out = ts.open(spec, create=True, delete_existing=True).result()
        out.write(array).result()
    meta = {"format": FORMAT, "version": VERSION, **vocab.metadata, "fingerprint": vocab.fingerprint,
            "checksums": {name: crc32_hex(array) for name, array in arrays.items()}}
    store.write(_META, json.dumps(meta, indent=1).encode()).result()


def vocab_exists(path: str) -> bool:
    """Whether a finished write (its vocab.json) is at `path`, local or remote; checking the
    arrays is load_vocab's job."""
    return ts.KvStore.open(storage.kvstore_url(path)).result().read(_META).result().state == "value"


def load_vocab(path: str, expected_tokenizer_fingerprint: str | None = None, *, fix: str | None = None,
               num_fgrams: int | None = None) -> FgramVocab:
    """Reads a vocabulary written by `save_vocab` and checks it is whole and fits the tokenizer.
    `fix`: how to recreate missing or damaged data (e.g. where the vocabulary is part of an export);
    `num_fgrams`: the f-grams it must hold, checked against each array's shape before the array is read."""
    fix = fix or f"Fix: run tools/extract_fgrams.py --output={path} (again)."
    raw = ts.KvStore.open(storage.kvstore_url(path)).result().read(_META).result()
    if raw.state != "value":
        raise FileNotFoundError(
            f"No f-gram vocabulary at {path!r}: {_META} is missing (nothing there, or a write that did not "
            f"finish). {fix}"
        )
    meta = json.loads(bytes(raw.value))
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path!r} holds format {meta.get('format')!r} v{meta.get('version')}; "
                         f"this code reads {FORMAT!r} v{VERSION}.")
    if expected_tokenizer_fingerprint is not None and meta["tokenizer_fingerprint"] != expected_tokenizer_fingerprint:
        raise ValueError(
            f"The f-gram vocabulary at {path!r} was built with tokenizer {meta['tokenizer_fingerprint']!r}, "
            f"but the tokenizer in use is {expected_tokenizer_fingerprint!r}: its f-gram ids would mean other "
            "token sequences. Fix: re-extract f-grams with this tokenizer (tools/extract_fgrams.py), or use "
            "the tokenizer the vocabulary was built with."
        )
    if not isinstance(meta.get("checksums"), dict):
        raise VocabError(f"{storage.join(path, _META)} holds no array checksums: it was written by a pre-release "
                         f"version. {fix}")
    arrays = {}
    for name in _ARRAYS:
        where = storage.join(path, name)
        try:
            array = ts.open(_array_spec(path, name), open=True).result()
            if num_fgrams is not None and array.shape[:1] != (num_fgrams,):
                raise VocabError(f"The f-gram vocabulary array {where} has shape {tuple(array.shape)}, not the "
                                 f"{num_fgrams} f-grams it must hold. {fix}")
            arrays[name] = array.read().result()
        except VocabError:
            raise
        except ValueError as e:  # tensorstore: no array metadata, an unreadable or undecodable chunk
            raise VocabError(f"The f-gram vocabulary array {where} cannot be read ({one_line(e)}). {fix}") from e
        want = meta["checksums"].get(name)
        if crc32_hex(arrays[name]) != want:
            raise VocabError(f"The f-gram vocabulary array {where} is missing chunks or damaged: it hashes to "
                             f"{crc32_hex(arrays[name])}, {_META} records {want}. {fix}")
    try:
        vocab = FgramVocab(
            tokens=arrays["tokens"], lengths=arrays["lengths"], counts=arrays["counts"],
            max_len=meta["max_len"], min_count=meta["min_count"], tokens_counted=meta["tokens_counted"],
            vocab_size=meta["vocab_size"], tokenizer_fingerprint=meta["tokenizer_fingerprint"],
        )
    except ValueError as e:
        raise VocabError(f"The f-gram vocabulary at {path!r} is damaged: {e} {fix}") from e
    if vocab.fingerprint != meta["fingerprint"]:
        raise VocabError(
            f"The f-gram vocabulary at {path!r} is damaged: its content hashes to {vocab.fingerprint}, but "
            f"{_META} records {meta['fingerprint']}. {fix}"
        )
    return vocab
