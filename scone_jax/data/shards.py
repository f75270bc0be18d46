"""Pre-tokenized shards and their sidecar files: names, atomic writing, validated reading.

A shard is an ArrayRecord file whose records are the little-endian int32 token ids of one
document each. tools/pretokenize.py writes two sidecars beside every shard:
  <shard>.lengths.npy  int32 [num_documents]: the token count of each record, in record
                       order, so training knows every length without reading the shard
  <shard>.json         {"format": FORMAT, "tokenizer_fingerprint", "tokenizer_vocab_size",
                        "num_documents", "num_tokens", "first_document", "source"}
                       so a run can refuse data made by another tokenizer
Shards of conversations (tools/pretokenize.py --format=chat, data.source='chat') have the format CHAT_FORMAT:
each record is a conversation's n int32 ids followed by its n + 1 mask bytes (data/conversations.py), the
lengths sidecar holds n, and the JSON sidecar also names the chat template and data.loss_on they were made
with. Each kind of source refuses the other's shards.
Sidecars are never documents: expand_files (sources.py) drops `<f>.lengths.npy` and `<f>.json`
whenever `<f>` is in the same file list.
"""
from __future__ import annotations

import array
import json
import os
from collections.abc import Iterable

import numpy as np
from array_record.python import array_record_module

FORMAT = "scone_jax.tokens.v1"
CHAT_FORMAT = "scone_jax.chat_tokens.v1"
_SOURCE_OF = {FORMAT: "arrayrecord", CHAT_FORMAT: "chat"}
LENGTHS_SUFFIX = ".lengths.npy"
META_SUFFIX = ".json"
WRITER_OPTIONS = "group_size:1"  # one record per group: cheap random access by record


def lengths_path(shard: str) -> str:
    return shard + LENGTHS_SUFFIX


def meta_path(shard: str) -> str:
    return shard + META_SUFFIX


def described_shard(path: str) -> str | None:
    """The shard `path` would be a sidecar of (path minus its sidecar suffix), else None."""
    for suffix in (LENGTHS_SUFFIX, META_SUFFIX):
        if path.endswith(suffix) and len(path) > len(suffix):
            return path[: -len(suffix)]
    return None


def num_records(shard: str) -> int:
    reader = array_record_module.ArrayRecordReader(shard)
    try:
        return reader.num_records()
    finally:
        reader.close()


def read_lengths(shard: str, num_records: int) -> np.ndarray | None:
    """int64 token count per record from the shard's lengths sidecar; None when it has none."""
    path = lengths_path(shard)
    if not os.path.isfile(path):
        return None
    try:
        lengths = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: unreadable lengths sidecar ({e}). Fix: re-run tools/pretokenize.py.") from e
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or len(lengths) != num_records:
        raise ValueError(
            f"{path} lists {lengths.shape} {lengths.dtype} lengths but {shard} holds {num_records} records. "
            "Fix: re-run tools/pretokenize.py for this data, or delete the sidecar."
        )
    return lengths.astype(np.int64)


def read_sidecar(shard: str, num_records: int, expected: str = FORMAT) -> dict | None:
    """The shard's JSON sidecar, checked against its record count and the `expected` format; None when it has
    none."""
    path = meta_path(shard)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: unreadable sidecar ({e}). Fix: re-run tools/pretokenize.py.") from e
    found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
    if found in _SOURCE_OF and found != expected:
        raise ValueError(f"{path}: {shard} holds {'conversations' if found == CHAT_FORMAT else 'documents'} "
                         f"({found}), read by data.source={_SOURCE_OF[found]!r}. Fix: set data.source="
                         f"{_SOURCE_OF[found]!r}, or pre-tokenize the data for data.source={_SOURCE_OF[expected]!r}.")
    if found != expected:
        raise ValueError(f"{path}: format {found!r} is not {expected!r}. Fix: re-run tools/pretokenize.py.")
    if meta.get("num_documents") != num_records:
        raise ValueError(
            f"{path} says {meta.get('num_documents')} documents but {shard} holds {num_records} records. "
            "Fix: re-run tools/pretokenize.py for this data, or delete the sidecar."
        )
    return meta


def publish_shard(shard: str, directory: str) -> str:
    """Move a complete shard and its sidecars into `directory`, replacing a shard of the same name: its old
    sidecars go first, then the shard, then its own sidecars, so no sidecar ever describes another shard
    (an interruption at worst leaves a shard without sidecars, which readers accept). Returns the new path."""
    final = os.path.join(directory, os.path.basename(shard))
    for old in (lengths_path(final), meta_path(final)):
        if os.path.lexists(old):
            os.unlink(old)
    for src, dst in ((shard, final), (lengths_path(shard), lengths_path(final)), (meta_path(shard), meta_path(final))):
        os.replace(src, dst)
    return final


def write_shard(shard: str, docs: Iterable, meta: dict, record_format: str = FORMAT) -> tuple[int, int]:
    """Writes the token-id documents as `shard` plus both sidecars; returns (documents, tokens). A document is
    an id array, or with CHAT_FORMAT a conversation's (ids, mask).

    `meta` gives the JSON fields other than format/num_documents/num_tokens. Everything is
    written under hidden temporary names first; then the old shard and sidecars are removed
    and the new shard is renamed into place before its sidecars. So a shard under its final
    name is always complete, and no sidecar ever describes another shard's contents (an
    interruption at worst leaves a complete shard without sidecars, which readers accept).
    """
    directory = os.path.dirname(os.path.abspath(shard))
    temp = {final: os.path.join(directory, f".{os.path.basename(final)}.{os.getpid()}.tmp")
            for final in (shard, lengths_path(shard), meta_path(shard))}
    try:
        writer = array_record_module.ArrayRecordWriter(temp[shard], WRITER_OPTIONS)
        lengths = array.array("i")  # 4 bytes per document, not a Python int each
        try:
            for doc in docs:
                ids, mask = doc if record_format == CHAT_FORMAT else (doc, None)
                record = np.asarray(ids, dtype="<i4").tobytes()
                writer.write(record if mask is None else record + np.asarray(mask, np.uint8).tobytes())
                lengths.append(len(ids))
        finally:
            writer.close()
        lengths = np.frombuffer(lengths, np.int32) if lengths else np.zeros(0, np.int32)
        with open(temp[lengths_path(shard)], "wb") as f:
            np.save(f, lengths, allow_pickle=False)
        full = {"format": record_format, **meta, "num_documents": len(lengths), "num_tokens": int(lengths.sum(dtype=np.int64))}
        with open(temp[meta_path(shard)], "w", encoding="utf-8") as f:
            json.dump(full, f, indent=1, sort_keys=True)
        for final in temp:
            if os.path.lexists(final):
                os.unlink(final)
        for final, tmp in temp.items():  # the shard first: a sidecar never precedes its shard
            os.replace(tmp, final)
    finally:
        for tmp in temp.values():
            if os.path.lexists(tmp):
                os.unlink(tmp)
    return full["num_documents"], full["num_tokens"]

