"""Train a lossless SentencePiece tokenizer for a run that names none (training/assets.ensure_tokenizer,
tools/train_tokenizer.py): identity normalization, whitespace kept, byte fallback for unseen characters, so
decode(encode(text)) == text for any text, and all three special ids of its own (data/tokenizer.py)."""
from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

from scone_jax.data import tokenizer

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Enough text for a representative vocabulary, little enough to train in seconds.
DEFAULT_MAX_CHARS = 4_000_000
_BYTE_PIECES = 256
# sentencepiece skips sentences longer than max_sentence_length bytes; we cut
# training text into pieces of at most this many characters (4 bytes each at most).
_TRAIN_PIECE_CHARS = 4096


def _training_pieces(documents: Iterable[str]) -> Iterator[str]:
    for doc in documents:
        for line in doc.split("\n"):
            for start in range(0, len(line), _TRAIN_PIECE_CHARS):
                yield line[start : start + _TRAIN_PIECE_CHARS]


def train_tokenizer(
    documents: Iterable[str], model_path: str, vocab_size: int, model_type: str = "unigram",
    character_coverage: float = 0.9995,
) -> tokenizer.Tokenizer:
    """Trains a lossless SentencePiece model on `documents` and writes only `model_path`. Characters outside
    `character_coverage` of the text get no piece and are spelled with byte pieces.

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
            character_coverage=character_coverage,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            max_sentence_length=4 * _TRAIN_PIECE_CHARS,
            minloglevel=2,
        )
    except RuntimeError as e:
        fix = (" Fix: lower data.character_coverage (e.g. 0.99; the rest is spelled in bytes) or raise "
               "data.vocab_size." if "required_chars" in str(e) else "")
        raise ValueError(
            f"SentencePiece training (vocab_size={vocab_size}, model_type={model_type!r}) failed: {e}{fix}"
        ) from e
    tokenizer.write_atomically(model_path, writer.getvalue())
    return tokenizer.Tokenizer(writer.getvalue(), path=model_path)


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
