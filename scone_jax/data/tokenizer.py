"""Tokenizers: SentencePiece `.model` files and Hugging Face `tokenizer.json` files behind one class.

`Tokenizer.load(path)` (local or gs://) is the single entry point for both. The kind comes from the
file's content, not its name: a JSON object is a tokenizer.json (read with the `tokenizers`
library), a serialized SentencePiece proto is a SentencePiece model, and bytes that start with
`scone-tokenizer` are a tokenizer this module saved (below). Anything else is a one-line ValueError.
Tokenizers we train (train_tokenizer) are lossless SentencePiece models, and so is a byte-level
BPE tokenizer.json without a normalizer (GPT-2's): decode(encode(text)) == text for any text. One
whose file normalizes first (e.g. NFC, as GPT-NeoX-style files do) round-trips normalized text.

Text is text: encode never adds special tokens, and a special token's spelling inside a document
(e.g. a literal "<|endoftext|>") is encoded as ordinary text, so only the pipeline draws document
boundaries. A tokenizer.json's own padding and truncation settings are switched off.

Special ids. The pipeline needs three ids: it packs each document as [bos] + ids + [eos], and pads
the last row of a finite (evaluation) stream with pad. Padding is masked out of the loss by
position (loss_mask 0), never by id, so pad may equal eos. Default, derived from the file alone:
  SentencePiece   the model's own bos/eos/pad pieces (train_tokenizer makes all three).
  tokenizer.json  eos: the end token of the file's post-processor template (TemplateProcessing,
                  BertProcessing, RobertaProcessing), else the token named in EOS_NAMES, else the
                  file's only special token; bos: the template's start token, else one named in
                  BOS_NAMES; pad: the file's padding token, else one named in PAD_NAMES.
  Either kind     a bos or pad still missing (after the override below) is eos: one token then
                  separates documents and fills padding, GPT-2's own convention. No eos at all is
                  an error naming data.eos_token.
  GPT-2 has one special token, <|endoftext|> (50256): it is bos, eos and pad. OLMo's
  gpt-neox-olmo-dolma: bos = eos = <|endoftext|>, pad = <|padding|> (OLMo publishes eos 50279, pad 1).
Override: data.bos_token, data.eos_token, data.pad_token (tools/pretokenize.py: --bos_token, ...)
name a token of the vocabulary; '' keeps the default. A token not in the vocabulary is an error
naming the key.

Serialized form (`Tokenizer.proto`): what pickling sends to worker processes, what export bundles
store (as tokenizer.model) and what `Tokenizer.from_bytes` / `Tokenizer.load` read back.
  - A SentencePiece model with its own ids: the .model bytes, unchanged. Workdir tokenizers,
    checkpoints, f-gram vocabularies and bundles made before tokenizer.json support keep their
    fingerprints, and old bundles load as before.
  - Anything else (every tokenizer.json; a SentencePiece model with overridden ids): the line
    `scone-tokenizer`, a one-line JSON header {"kind", "version", "bos_id", "eos_id", "pad_id"},
    then the original file's bytes verbatim. The ids travel with the tokenizer, so serving uses
    the run's ids without the run's data config. `Tokenizer.save(path)` writes this form: a file
    any --tokenizer flag accepts, with the policy baked in.
Fingerprint: the first 16 hex digits of the sha256 of the serialized form. It names the file and
the resolved ids (two policies -> two fingerprints), not the path, so f-gram vocabularies,
pre-tokenized shards, checkpoints and bundles refuse to pair with another tokenizer or policy.

Threads. `encode_batch` uses each library's own parallel batch encoding in the main process. In a
worker process (a multiprocessing child: grain workers, tokenize.run_pool, which spawn), the
parent already runs one worker per core, so batches are encoded on one thread there:
TOKENIZERS_PARALLELISM=false unless the user set it, and SentencePiece gets num_threads=1. Never
set TOKENIZERS_PARALLELISM=true for a program that forks after encoding: a forked child that
encodes a batch then deadlocks on the library's thread pool (that is why the library turns itself
off in forked children unless the variable is set).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np
import sentencepiece as spm

from scone_jax.runtime import storage

SENTENCEPIECE, HUGGINGFACE = "sentencepiece", "huggingface"
ROLES = ("bos", "eos", "pad")
# Names that declare a role when a tokenizer.json's post-processor and padding do not (see above).
BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "<|bos|>")
EOS_NAMES = ("</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "<|eos|>")
PAD_NAMES = ("<pad>", "<|padding|>", "<|pad|>", "[PAD]")
_NAMES = {"bos": BOS_NAMES, "eos": EOS_NAMES, "pad": PAD_NAMES}
_MAGIC, _ENVELOPE_VERSION = b"scone-tokenizer\n", 1
_FILE_FIX = ("Fix: point it at a SentencePiece .model (tools/train_tokenizer.py makes one) or a Hugging Face "
             "tokenizer.json (e.g. the one in the Hugging Face repo openai-community/gpt2).")


def in_worker_process() -> bool:
    """True in a multiprocessing child (grain workers, tokenize.run_pool): its parent already uses every core."""
    return multiprocessing.parent_process() is not None


class _SentencePiece:
    kind = SENTENCEPIECE

    def __init__(self, sp: spm.SentencePieceProcessor):
        self._sp, self.vocab_size = sp, sp.vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_rendered(self, text: str) -> list[int]:
        """Special pieces' spellings (control pieces such as <s> and </s>, which SentencePiece never makes from
        text) become their ids; the text between them is encoded piece by piece, each with SentencePiece's own
        leading-space marker, as any text it encodes."""
        specials = sorted(self.special_tokens(), key=len, reverse=True)
        ids = []
        for i, part in enumerate(re.split("(" + "|".join(map(re.escape, specials)) + ")", text)):
            if i % 2:
                ids.append(self._sp.piece_to_id(part))
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=1 if in_worker_process() else -1)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)  # unknown pieces map to unk: check the way back
        return i if self._sp.id_to_piece(i) == token else None

    def id_to_token(self, i: int) -> str:
        return self._sp.id_to_piece(i)

    def default_ids(self) -> dict[str, int | None]:
        ids = {"bos": self._sp.bos_id(), "eos": self._sp.eos_id(), "pad": self._sp.pad_id()}
        return {role: (i if i >= 0 else None) for role, i in ids.items()}

    def special_tokens(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(min(self.vocab_size, 1024))
                if self._sp.is_control(i) or self._sp.is_unknown(i)]


class _HuggingFace:
    kind = HUGGINGFACE

    def __init__(self, raw: bytes, name: str):
        import tokenizers  # only runs that use a tokenizer.json need the library loaded

        try:
            text = raw.decode("utf-8-sig")
            spec = json.loads(text)
        except ValueError as e:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"{name} starts like JSON but is not valid JSON ({_brief(e)}). {_FILE_FIX}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise ValueError(f"{name} is JSON but not a Hugging Face tokenizer.json (it has no 'model' object; "
                             f"tokenizer_config.json, vocab.json and special_tokens_map.json are not enough). {_FILE_FIX}")
        try:
            tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # the library raises plain Exception for files it cannot read
            raise ValueError(f"{name} is a tokenizer.json that tokenizers {tokenizers.__version__} cannot read "
                             f"({_brief(e)}). Fix: upgrade tokenizers, or re-save the file with it.") from None
        tok.no_truncation()  # a file's truncation would cut documents silently; the pipeline packs them
        tok.no_padding()
        tok.encode_special_tokens = True  # a special token's spelling in a document is text
        self._tok = tok
        # What the ids are derived from; the parsed JSON itself is not kept (tens of MB for a 50k vocabulary).
        added = sorted((t for t in spec.get("added_tokens") or [] if isinstance(t, dict) and t.get("special")),
                       key=lambda t: t.get("id", 0))
        self._specials = [t["content"] for t in added if isinstance(t.get("content"), str)]
        self._declared = _declared_ids(spec)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # added tokens included, holes too
        if not self.vocab_size:
            raise ValueError(f"{name} is a tokenizer.json with an empty vocabulary. {_FILE_FIX}")
        self._batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no character offsets: faster
        self._rendered = None  # a second instance that reads special tokens' spellings, made on first use

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_rendered(self, text: str) -> list[int]:
        if self._rendered is None:
            import tokenizers

            self._rendered = tokenizers.Tokenizer.from_str(self._tok.to_str())
            self._rendered.encode_special_tokens = False
        return self._rendered.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if in_worker_process():  # asked here, not at unpickling: a spawned worker learns it is one only later
            # Read by the library when it batches (on every batch up to 0.23; newer versions keep the value of
            # their first batch, which in a worker is this one).
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return [e.ids for e in self._batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        return self._tok.id_to_token(i)

    def special_tokens(self) -> list[str]:
        return list(self._specials)

    def default_ids(self) -> dict[str, int | None]:
        ids = dict(self._declared)
        for role, names in _NAMES.items():
            if ids.get(role) is None:
                ids[role] = next((i for i in map(self.token_to_id, names) if i is not None), None)
        specials = self.special_tokens()
        if ids["eos"] is None and len(specials) == 1:
            ids["eos"] = self.token_to_id(specials[0])
        return ids  # bos and pad fall back to eos once overrides are applied (Tokenizer.__init__)


def _declared_ids(spec: dict) -> dict[str, int | None]:
    """The bos/eos a tokenizer.json's post-processor wraps a sequence in, and its padding's pad id."""
    found = {role: None for role in ROLES}

    def one_id(table: dict, item) -> int | None:
        key = item.get("SpecialToken", {}).get("id") if isinstance(item, dict) else None
        ids = (table.get(key) or {}).get("ids") if key is not None else None
        return ids[0] if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int) else None

    def visit(proc) -> None:
        if not isinstance(proc, dict):
            return
        kind = proc.get("type")
        if kind == "Sequence":
            for inner in proc.get("processors") or []:
                visit(inner)
        elif kind in ("BertProcessing", "RobertaProcessing"):
            for role, field in (("bos", "cls"), ("eos", "sep")):
                pair = proc.get(field)
                if found[role] is None and isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int):
                    found[role] = pair[1]
        elif kind == "TemplateProcessing":
            single, table = proc.get("single") or [], proc.get("special_tokens") or {}
            if single and found["bos"] is None:
                found["bos"] = one_id(table, single[0])
            if len(single) > 1 and found["eos"] is None:
                found["eos"] = one_id(table, single[-1])

    visit(spec.get("post_processor"))
    padding = spec.get("padding")
    if isinstance(padding, dict) and isinstance(padding.get("pad_id"), int):
        found["pad"] = padding["pad_id"]
    return found


def _brief(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def _parse(raw: bytes, name: str):
    """The backend for a file's bytes, its kind read from the content."""
    if not raw:
        raise ValueError(f"{name} is empty: not a tokenizer. {_FILE_FIX}")
    if raw.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"{":
        return _HuggingFace(raw, name)
    try:
        sp = spm.SentencePieceProcessor(model_proto=raw)
    except RuntimeError:
        sp = None
    if sp is None or sp.vocab_size() == 0:
        raise ValueError(f"{name} is neither a SentencePiece model nor a Hugging Face tokenizer.json (it starts "
                         f"with {raw[:16]!r}). {_FILE_FIX}")
    return _SentencePiece(sp)


def _split_envelope(data: bytes, name: str) -> tuple[dict | None, bytes]:
    """(header, the original file's bytes) of the serialized form; header None for a bare file."""
    if not data.startswith(_MAGIC):
        return None, data
    line, _, raw = data[len(_MAGIC):].partition(b"\n")
    try:
        header = json.loads(line)
        ok = header["kind"] in (SENTENCEPIECE, HUGGINGFACE) and all(type(header[f"{r}_id"]) is int for r in ROLES)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{name} starts like a tokenizer saved by scone_jax but its header is damaged. Fix: save it "
                         "again (Tokenizer.save), or point at the original .model or tokenizer.json.")
    if header.get("version") != _ENVELOPE_VERSION:
        raise ValueError(f"{name} is a saved tokenizer of version {header.get('version')!r}; this code reads version "
                         f"{_ENVELOPE_VERSION}. Fix: use the scone_jax version that wrote it.")
    return header, raw


def special_tokens_of(data_cfg) -> dict[str, str]:
    """The data.bos_token / eos_token / pad_token overrides ('' = the tokenizer's own); a config saved
    before these keys existed has none."""
    return {role: data_cfg.get(f"{role}_token", "") or "" for role in ROLES}


class Tokenizer:
    """A SentencePiece model or a tokenizer.json with the three ids the pipeline needs; picklable for
    worker processes (it pickles as its serialized form: the file's bytes and the ids).

    `special_tokens` ({'bos'|'eos'|'pad': token}, '' = default) overrides the ids; `key` names the
    setting in errors ('data.{}_token' for the config, '--{}_token' for a tool's flags).
    """

    def __init__(self, data: bytes, path: str | None = None, special_tokens: Mapping[str, str] | None = None,
                 *, key: str = "data.{}_token"):
        self.path = path  # the file it came from, None if built in memory (e.g. from a bundle)
        name = path or "<in memory>"
        header, raw = _split_envelope(bytes(data), name)
        backend = _parse(raw, name)
        if header is not None and header["kind"] != backend.kind:
            raise ValueError(f"{name} says it holds a {header['kind']} tokenizer but holds a {backend.kind} one: it "
                             "was altered. Fix: save it again, or point at the original file.")
        own = backend.default_ids()
        ids = dict(own) if header is None else {role: header[f"{role}_id"] for role in ROLES}
        unknown = sorted(set(special_tokens or {}) - set(ROLES))
        if unknown:
            raise ValueError(f"Unknown special token roles {unknown}; use {list(ROLES)}.")
        hint = ", ".join(repr(t) for t in backend.special_tokens()[:6])
        hint = f" (its special tokens: {hint})" if hint else ""
        for role in ROLES:
            token = (special_tokens or {}).get(role) or ""
            if token:
                ids[role] = backend.token_to_id(token)
                if ids[role] is None:
                    raise ValueError(
                        f"{key.format(role)}={token!r} is not a token of {name} ({backend.kind}, {backend.vocab_size} "
                        f"tokens){hint}. Fix: name a token of its vocabulary, or set it to '' for the tokenizer's own.")
        if ids["eos"] is None:
            also = " (or train one with tools/train_tokenizer.py)" if backend.kind == SENTENCEPIECE else ""
            raise ValueError(
                f"Tokenizer {name} declares no end-of-document token{hint}; the pipeline needs one to pack "
                f"documents. Fix: set {key.format('eos')} to a token of its vocabulary{also}.")
        for role in ("bos", "pad"):  # one token may separate documents and fill padding (GPT-2's convention)
            if ids[role] is None:
                ids[role] = ids["eos"]
        bad = {role: i for role, i in ids.items() if not 0 <= i < backend.vocab_size}
        if bad:
            raise ValueError(f"{name} gives ids {bad} outside its {backend.vocab_size} tokens: it was altered. Fix: save "
                             "it again, or point at the original file.")
        self._backend, self._ids = backend, ids
        plain = backend.kind == SENTENCEPIECE and ids == own
        self._data = raw if plain else _envelope(backend.kind, ids, raw)

    @classmethod
    def load(cls, path: str, special_tokens: Mapping[str, str] | None = None, *,
             key: str = "data.{}_token") -> Tokenizer:
        """From a local file or a URL (gs://...): a .model, a tokenizer.json, or one saved by `save`."""
        data = read_model(path)
        if data is None:
            raise FileNotFoundError(f"Tokenizer {path!r} does not exist.")
        return cls(data, path=path, special_tokens=special_tokens, key=key)

    @classmethod
    def from_bytes(cls, data: bytes, path: str | None = None, special_tokens: Mapping[str, str] | None = None,
                   *, key: str = "data.{}_token") -> Tokenizer:
        """From the serialized form (`proto`) or a bare file's bytes."""
        return cls(data, path=path, special_tokens=special_tokens, key=key)

    def save(self, path: str) -> None:
        """Writes the serialized form (local or gs://, atomically): the same tokenizer and ids on load."""
        write_atomically(path, self._data)

    @property
    def proto(self) -> bytes:
        """The serialized form (see the module docstring): a .model file's bytes for a SentencePiece model
        with its own ids, else the scone-tokenizer envelope around the original file."""
        return self._data

    @property
    def file_bytes(self) -> bytes:
        """The original file's bytes (the .model or the tokenizer.json), without the envelope: what a Hugging Face
        export writes beside its weights."""
        return _split_envelope(self._data, self.path or "<in memory>")[1]

    def id_to_token(self, i: int) -> str:
        """The spelling of token `i` (a special token's too)."""
        return self._backend.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled `token` (a special token's too), None if there is none."""
        return self._backend.token_to_id(token)

    @property
    def kind(self) -> str:
        """'sentencepiece' or 'huggingface' (a tokenizer.json)."""
        return self._backend.kind

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self._ids)

    def __getstate__(self):
        return {"data": self._data, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["data"], state["path"])

    def __repr__(self) -> str:
        ids = ", ".join(f"{role}={self._ids[role]}" for role in ROLES)
        return f"Tokenizer({self.kind}, {self.vocab_size} tokens, {ids}, fingerprint {self.fingerprint})"

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of `text`, no special tokens added."""
        return np.asarray(self._backend.encode(text), dtype=np.int32)

    def encode_rendered(self, text: str) -> np.ndarray:
        """int32 ids of a chat template's output (data/chat_template.py): a special token's spelling is that token,
        as Hugging Face's apply_chat_template reads its rendering (encode() reads it as text)."""
        return np.asarray(self._backend.encode_rendered(text), dtype=np.int32)

    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens (a tokenizer.json's special added tokens, a SentencePiece model's control
        pieces) and of bos, eos and pad: the ids that can end an assistant's turn (data/conversations.py)."""
        ids = {self._backend.token_to_id(t) for t in self._backend.special_tokens()} | set(self._ids.values())
        return frozenset(i for i in ids if i is not None)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """encode() of each text, with the library's own batch (parallel in the main process)."""
        texts = list(texts)
        if not texts:
            return []
        return [np.asarray(ids, dtype=np.int32) for ids in self._backend.encode_batch(texts)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._backend.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: the largest id + 1 (a tokenizer.json's added tokens included)."""
        return self._backend.vocab_size

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the sha256 of the serialized form (the file and the ids)."""
        return hashlib.sha256(self._data).hexdigest()[:16]


def _envelope(kind: str, ids: Mapping[str, int], raw: bytes) -> bytes:
    header = {"kind": kind, "version": _ENVELOPE_VERSION, **{f"{role}_id": int(ids[role]) for role in ROLES}}
    return _MAGIC + json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n" + raw


def read_model(path: str) -> bytes | None:
    """The bytes of a local or remote model file, None if there is none."""
    if storage.is_remote(path):
        return storage.read_file(path)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def write_atomically(path: str, data: bytes) -> None:
    """Replace `path` (local or gs://) with `data` at once: readers see the old file or the new one."""
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
