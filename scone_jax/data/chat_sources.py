"""Conversation sources (data.source='chat'): JSONL files with a list of messages per line, or the ArrayRecord
shards tools/pretokenize.py --format=chat makes of them (files ending in .arrayrecord; the two are not mixed).

Either way `source[i]` is conversation i's token ids as the model reads them (what f-gram extraction counts
and pre-tokenization stores) and `source.example(i)` its (ids, mask) (data/conversations.py). A JSONL source
renders and tokenizes on every read, so the pipeline encodes the training split once, on all cores
(data/conversation_docs.py); shards hold the result. Sources pickle small (file offsets, the tokenizer's and
the template's bytes) for worker processes.
"""
from __future__ import annotations

import json

import numpy as np

from scone_jax.data import chat_template, conversations, shards, sources


class _Where:
    """'path:line' of a JSONL record, worked out only when an error message is made (it reads the file)."""

    def __init__(self, index, path: str, offset: int):
        self._index, self._path, self._offset = index, path, offset

    def __str__(self) -> str:
        return f"{self._path}:{self._index.line_number(self._path, self._offset)}"


class ChatJsonlSource:
    """One conversation per non-empty line of JSONL files: the messages in `field`."""

    def __init__(self, files: list[str], field: str, encoder: conversations.Encoder):
        self._index = sources._LineIndex(files)
        self._field, self.encoder = field, encoder

    def __len__(self) -> int:
        return len(self._index)

    def messages(self, index: int) -> tuple[list[dict], _Where]:
        """Conversation `index`'s checked messages and where it is."""
        path, offset, line = self._index.read(index)
        where = _Where(self._index, path, offset)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise conversations.ConversationError(f"{where}: bad JSON ({e.msg}). Fix: repair or remove that line.") from None
        return conversations.messages_of(record, self._field, where), where

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        messages, where = self.messages(index)
        return self.encoder.encode(messages, where)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.example(index)[0]


class ChatShardSource(sources.TokenArrayRecordSource):
    """Pre-tokenized conversations: each record is n int32 ids and n + 1 mask bytes (data/shards.py)."""

    def __init__(self, files: list[str], loss_on: str):
        super().__init__(files)
        for path, count in zip(self._files, self._counts):
            meta = shards.read_sidecar(path, count, shards.CHAT_FORMAT)
            if meta is None:
                raise ValueError(f"{path} has no {shards.META_SUFFIX} sidecar, so it cannot be read as conversations. "
                                 "Fix: write it with tools/pretokenize.py --format=chat.")
            if meta.get("loss_on") != loss_on:
                raise ValueError(f"{path} holds masks for data.loss_on={meta.get('loss_on')!r} but this run sets "
                                 f"data.loss_on={loss_on!r}. Fix: set it to {meta.get('loss_on')!r}, or re-run "
                                 f"tools/pretokenize.py --format=chat --loss_on={loss_on}.")

    def examples(self, indices) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of conversations `indices`, in that order."""
        out = []
        for record in self.read_records(indices):
            n = (len(record) - 1) // 5
            if len(record) != 5 * n + 1:
                raise ValueError(f"A chat shard's record of {len(record)} bytes is not n ids and n + 1 mask bytes: the "
                                 "shards are damaged. Fix: re-run tools/pretokenize.py --format=chat.")
            out.append((np.frombuffer(record[:4 * n], "<i4").astype(np.int32), np.frombuffer(record[4 * n:], np.uint8)))
        return out

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.examples([index])[0]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.example(index)[0]

    def read_concatenated(self, indices) -> np.ndarray:
        parts = [ids for ids, _ in self.examples(indices)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def check_tokenizer(self, fingerprint: str) -> None:
        for path, count in zip(self._files, self._counts):
            made = shards.read_sidecar(path, count, shards.CHAT_FORMAT).get("tokenizer_fingerprint")
            if made != fingerprint:
                raise ValueError(f"{path} was tokenized with tokenizer {made} but this run uses {fingerprint}. Fix: set "
                                 "data.tokenizer_path to the tokenizer that made the data, or re-run "
                                 "tools/pretokenize.py --format=chat with this one.")


def encoder(data_cfg, tokenizer) -> conversations.Encoder:
    """The run's conversation encoder: its chat template (data.chat_template), tokenizer and data.loss_on."""
    template = chat_template.load(data_cfg.chat_template, data_cfg.tokenizer_path)
    return conversations.Encoder(template, tokenizer, data_cfg.loss_on)


def open_chat(data_cfg, files: list[str], tokenizer):
    """The conversation source of `files` (JSONL or shards, module docstring)."""
    if tokenizer is None:
        raise ValueError("data.source='chat' renders conversations with a checkpoint's tokenizer and chat template. "
                         "Fix: set data.tokenizer_path (a tokenizer is not trained on conversations).")
    records = [f.endswith(".arrayrecord") for f in files]
    if any(records) and not all(records):
        raise ValueError(f"data.source='chat' got {sum(records)} .arrayrecord shard(s) and {len(files) - sum(records)} "
                         "JSONL file(s) in one glob list. Fix: pre-tokenize them all (tools/pretokenize.py "
                         "--format=chat), or list the JSONL files alone.")
    if all(records):
        source = ChatShardSource(files, data_cfg.loss_on)
        source.check_tokenizer(tokenizer.fingerprint)
        return source
    source = ChatJsonlSource(files, data_cfg.messages_field, encoder(data_cfg, tokenizer))
    if len(source):
        source.example(0)  # a wrong field, role or template: now, not inside a worker
    return source
