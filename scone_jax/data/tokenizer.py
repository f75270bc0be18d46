"""SentencePiece tokenizer: load and train.

Tokenizers we train are lossless (identity normalization, whitespace kept, byte
fallback for unseen characters), so decode(encode(text)) == text for any text.
The fingerprint names the exact model, so f-gram vocabularies and checkpoints can
refuse to pair with a different tokenizer.
"""
from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

from scone_jax.runtime import storage

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Enough text for a representative vocabulary; unigram trains on 4 MB in ~5 s.
DEFAULT_MAX_CHARS = 4_000_000
_BYTE_PIECES = 256
# sentencepiece skips sentences longer than max_sentence_length bytes; we cut
# training text into pieces of at most this many characters (4 bytes each at most).
_TRAIN_PIECE_CHARS = 4096


class Tokenizer:
    """A SentencePiece model with the ids the pipeline needs; picklable for grain workers."""

    def __init__(self, model_proto: bytes, path: str | None = None):
        self._proto = model_proto
        self.path = path  # the .model file it came from, None if built in memory
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        missing = [n for n, i in (("pad", self.pad_id), ("bos", self.bos_id), ("eos", self.eos_id)) if i < 0]
        if missing:
            raise ValueError(
                f"Tokenizer {path or '<in memory>'} defines no {'/'.join(missing)} piece; the pipeline needs pad, bos "
                "and eos. Fix: train one with tools/train_tokenizer.py."
            )

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """From a local .model file or a URL (gs://...)."""
        proto = read_model(path)
        if proto is None:
            raise FileNotFoundError(f"Tokenizer model {path!r} does not exist.")
        return cls(proto, path=path)

    @property
    def proto(self) -> bytes:
        """The serialized SentencePiece model (what a .model file holds)."""
        return self._proto

    def __getstate__(self):
        return {"model_proto": self._proto, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["model_proto"], state["path"])

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the sha256 of the serialized model."""
        return hashlib.sha256(self._proto).hexdigest()[:16]


def _training_pieces(documents: Iterable[str]) -> Iterator[str]:
    for doc in documents:
        for line in doc.split("\n"):
            for start in range(0, len(line), _TRAIN_PIECE_CHARS):
                yield line[start : start + _TRAIN_PIECE_CHARS]


def read_model(path: str) -> bytes | None:
    """The bytes of a local or remote model file, None if there is none."""
    if storage.is_remote(path):
        return storage.read_file(path)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def _write_atomically(path: str, data: bytes) -> None:
    if storage.is_remote(path):  # one kvstore write replaces the object at once
        storage.write_file(path, data)
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tokenizer-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def train_tokenizer(
    documents: Iterable[str], model_path: str, vocab_size: int, model_type: str = "unigram"
) -> Tokenizer:
    """Trains a lossless SentencePiece model on `documents` and writes only `model_path`.

    Ids: pad=0, unk=1, bos=2, eos=3, then 256 byte-fallback pieces, then learned pieces.
    """
    if vocab_size <= _BYTE_PIECES + 4:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: {_BYTE_PIECES} byte pieces, 4 special ids and "
            "one piece per distinct character are reserved. Use a larger vocab_size (e.g. 8000)."
        )
    writer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_pieces(documents),
            model_writer=writer,
            vocab_size=vocab_size,
            model_type=model_type,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            byte_fallback=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            max_sentence_length=4 * _TRAIN_PIECE_CHARS,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(
            f"SentencePiece training (vocab_size={vocab_size}, model_type={model_type!r}) failed: {e}"
        ) from e
    _write_atomically(model_path, writer.getvalue())
    return Tokenizer(writer.getvalue(), path=model_path)


def sample_documents(source: Sequence[str], max_chars: int, seed: int = 0) -> list[str]:
    """Documents in a fixed random order until `max_chars` characters: a cap that still covers the corpus."""
    picked, total = [], 0
    for index in np.random.default_rng(seed).permutation(len(source)):
        if total >= max_chars:
            break
        doc = source[int(index)]
        if not isinstance(doc, str):
            raise ValueError(
                f"Cannot train a tokenizer on pre-tokenized documents (got {type(doc).__name__}). "
                "Fix: set data.tokenizer_path to the tokenizer that produced the token ids."
            )
        picked.append(doc[: max_chars - total])
        total += len(picked[-1])
    return picked
