"""A SentencePiece model as a Hugging Face `tokenizer.json` (built with the `tokenizers` library), which
`transformers.AutoTokenizer` (PreTrainedTokenizerFast) and vLLM open and which encodes and decodes as
`sentencepiece` does: what `--format=hf` writes for a run whose tokenizer is a SentencePiece model.

The .model file's own settings are read from its protobuf (a few fields, read from the wire format: the
`sentencepiece_model_pb2` module that ships with sentencepiece needs a newer protobuf than our pin):
  model           unigram: a Unigram model with every piece and its score; bpe: a BPE model whose merges are
                  every split of a piece into two pieces, ranked by the merged piece's score (SentencePiece
                  merges the best-scoring pair first); unk_id and byte fallback as the model has them
  normalizer      the precompiled character map (none for identity normalization), extra whitespace removal,
                  the dummy prefix ("▁" before every text, also each stretch between special tokens, as
                  SentencePiece encodes each stretch) and spaces written as "▁", in SentencePiece's order
  pre-tokenizer   none (SentencePiece segments the whole normalized text), except a cut inside a byte piece's
                  spelling ("<0x41>"), which SentencePiece reads as text and a `tokenizers` Unigram as that byte
  decoder         "▁" -> " ", byte pieces -> UTF-8, the dummy prefix removed from the start of the text
  special tokens  control pieces (<s>, </s>, <pad>) and the unknown piece, as special added tokens
  post-processor  bos before the text when the run trained with data.add_bos (what `tokenizer(text)` gives
                  then is the run's own prompt encoding)
Control pieces decode to their spelling unless skip_special_tokens=True, as every Hugging Face tokenizer does
(SentencePiece decodes them to ''), and so does the unknown piece (SentencePiece: ' ⁇ '; our own models never emit
it: they fall back to bytes). A model this cannot reproduce (a word or char model, whitespace as a suffix) is
refused in one line; `check` compares the two on probe texts, so a setting read wrongly is refused too, not
written.
"""
from __future__ import annotations

import json
import re

import sentencepiece as spm

UNIGRAM, BPE = 1, 2
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
# SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class UnsupportedModelError(ValueError):
    """A SentencePiece model whose encoding no tokenizer.json reproduces here."""


def _fields(data: bytes):
    """(field number, wire type, value) of one protobuf message: varints as int, fixed32 as bytes, length-delimited
    as bytes."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise UnsupportedModelError(f"the SentencePiece model has a protobuf field of wire type {wire}")
        yield number, wire, value


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def settings(raw: bytes) -> dict:
    """The trainer's and normalizer's settings an encoding depends on (protobuf defaults where a field is absent)."""
    out = {"model_type": UNIGRAM, "byte_fallback": False, "treat_whitespace_as_suffix": False,
           "charsmap": b"", "add_dummy_prefix": True, "remove_extra_whitespaces": True, "escape_whitespaces": True}
    for number, _, value in _fields(raw):
        if number == 2:  # trainer_spec
            for field, _, v in _fields(value):
                if field == 3:
                    out["model_type"] = v
                elif field == 35:
                    out["byte_fallback"] = bool(v)
                elif field == 24:
                    out["treat_whitespace_as_suffix"] = bool(v)
        elif number == 3:  # normalizer_spec
            for field, _, v in _fields(value):
                if field == 2:
                    out["charsmap"] = bytes(v)
                elif field == 3:
                    out["add_dummy_prefix"] = bool(v)
                elif field == 4:
                    out["remove_extra_whitespaces"] = bool(v)
                elif field == 5:
                    out["escape_whitespaces"] = bool(v)
    return out


def _piece_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    if sp.is_unknown(i):
        return UNKNOWN
    if sp.is_control(i):
        return CONTROL
    if sp.is_byte(i):
        return BYTE
    if sp.is_unused(i):
        return UNUSED
    return NORMAL  # user-defined pieces read as normal ones: refused by `check` if they encode otherwise


def build(raw: bytes, bos_token: str | None = None):
    """A `tokenizers.Tokenizer` that encodes and decodes as the SentencePiece model `raw` (the .model bytes);
    `bos_token`: the token the post-processor puts before each text (None: nothing added)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    spec = settings(raw)
    kind = _MODEL_TYPES.get(spec["model_type"], str(spec["model_type"]))
    if spec["model_type"] not in (UNIGRAM, BPE):
        raise UnsupportedModelError(f"it is a SentencePiece {kind} model (unigram and bpe are written)")
    if spec["treat_whitespace_as_suffix"]:
        raise UnsupportedModelError("it writes whitespace as a suffix (treat_whitespace_as_suffix)")
    sp = spm.SentencePieceProcessor(model_proto=raw)
    pieces = [(sp.id_to_piece(i), float(sp.get_score(i)), _piece_type(sp, i)) for i in range(sp.vocab_size())]
    unk_id = next((i for i, (_, _, t) in enumerate(pieces) if t == UNKNOWN), None)
    byte_fallback = spec["byte_fallback"]
    if spec["model_type"] == UNIGRAM:
        model = models.Unigram([(piece, score) for piece, score, _ in pieces], unk_id=unk_id,
                               byte_fallback=byte_fallback)
    else:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        model = models.BPE(vocab=vocab, merges=_merges(pieces), unk_token=pieces[unk_id][0] if unk_id is not None
                           else None, fuse_unk=True, byte_fallback=byte_fallback)
    tok = Tokenizer(model)
    steps = []
    if spec["charsmap"]:
        steps.append(normalizers.Precompiled(spec["charsmap"]))
    if spec["remove_extra_whitespaces"]:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec["add_dummy_prefix"]:
        steps.append(normalizers.Prepend(" "))
    if spec["escape_whitespaces"]:
        steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    if byte_fallback and spec["model_type"] == UNIGRAM and not any("<0" in p for p, _, t in pieces if t == NORMAL):
        # A Unigram model of `tokenizers` also matches byte pieces' spellings in text ("<0x41>" -> the byte A),
        # SentencePiece never: cut such a spelling after its "<", where no normal piece spans, so the cut changes
        # no other segmentation.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("<(?=0x[0-9A-F]{2}>)"), "merged_with_previous")
    undo = [decoders.Replace("▁", " ")] if spec["escape_whitespaces"] else []
    if byte_fallback:
        undo.append(decoders.ByteFallback())
    undo.append(decoders.Fuse())  # one string, so Strip below removes only the text's first space
    if spec["add_dummy_prefix"]:
        undo.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(undo)
    tok.add_special_tokens([AddedToken(piece, special=True, normalized=False)
                            for piece, _, t in pieces if t in (CONTROL, UNKNOWN)])
    if bos_token is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B",
            special_tokens=[(bos_token, sp.piece_to_id(bos_token))])
    return tok


def _merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, the best-scoring merged piece first."""
    normal = {piece: (score, i) for i, (piece, score, t) in enumerate(pieces) if t in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, (score, i) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, cut, left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


# Probe texts `check` encodes with both: whitespace runs at the start, inside and at the end, newlines and tabs,
# digits, punctuation, letters outside most vocabularies and characters outside any (byte fallback).
PROBES = ("In the beginning God created the heaven and the earth.", "  two  spaces,\tthen a tab\nand a newline\n\n",
          " leading", "trailing ", "", " ", "3.14159 and 1,000,000 (2024-12-07)", "naïve café — “quoted” ‘text’",
          "日本語のテキスト ☃ 🙂", "ÅNGSTRÖM Ωmega ﬁ ligature ①", "a\u00a0b\u200bc", "x" * 40,
          "<0x41><0xE2> <s></s>")


def check(tok, raw: bytes, texts=PROBES) -> None:
    """UnsupportedModelError naming the first text `tok` (from `build`) encodes or decodes otherwise than the
    SentencePiece model `raw`. A special token's spelling is that token, as in `tokenizer(text)` (the stretches
    between are each encoded by SentencePiece: data/tokenizer.py's encode_rendered); decoding skips special tokens,
    which SentencePiece decodes to ''."""
    sp = spm.SentencePieceProcessor(model_proto=raw)
    specials = {sp.id_to_piece(i): i for i in range(sp.vocab_size()) if sp.is_control(i) or sp.is_unknown(i)}
    unknown = sp.unk_id()  # sentencepiece decodes it as ' ⁇ ', a tokenizer.json as its spelling (skipped: '')
    split = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
    normal = [sp.id_to_piece(i) for i in range(sp.vocab_size())
              if not (sp.is_unknown(i) or sp.is_control(i) or sp.is_byte(i))]
    for text in (*texts, " ".join(normal[:2000]).replace("▁", " ")):
        want = [i for k, part in enumerate(split.split(text))
                for i in ([specials[part]] if k % 2 else sp.encode(part) if part else [])]
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            raise UnsupportedModelError(f"its tokenizer.json encodes {text[:40]!r} as {got[:8]}..., sentencepiece "
                                        f"as {want[:8]}...")
        if unknown not in want and tok.decode(want, skip_special_tokens=True) != sp.decode(want):
            raise UnsupportedModelError(f"its tokenizer.json decodes the ids of {text[:40]!r} as "
                                        f"{tok.decode(want)[:40]!r}, sentencepiece as {sp.decode(want)[:40]!r}")


def tokenizer_json(raw: bytes, bos_token: str | None = None) -> tuple[bytes, str | None]:
    """(the checked tokenizer.json bytes of the SentencePiece model `raw` (`build`, then `check`), its unknown
    piece or None)."""
    tok = build(raw, bos_token)
    check(tok, raw)
    sp = spm.SentencePieceProcessor(model_proto=raw)
    unk = sp.id_to_piece(sp.unk_id()) if 0 <= sp.unk_id() < sp.vocab_size() else None
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1).encode("utf-8"), unk
