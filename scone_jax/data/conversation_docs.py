"""A process's conversations, encoded once, by number: what data/conversation_rows.py packs.

JSONL conversations are rendered and tokenized when the pipeline is built, on all cores (a bad one stops the
run here, before training, naming its file and line), and kept as flat ids and masks; shards are read on
demand. A conversation longer than a row (data.seq_len positions, one more than its ids with a bos) is
refused or truncated to its first seq_len positions (data.overlong), and the count is said once, here.
"""
from __future__ import annotations

import numpy as np
from absl import logging

from scone_jax.data import chat_sources, conversations, prompt, sources, tokenize

# Rendering a conversation costs ~100 us; below this many one process is faster than spawning workers.
PARALLEL_CONVERSATIONS = 4000
_CHUNK = 256


class ConversationDocuments:
    """Conversations as flat arrays: i's ids are tokens[offsets[i]:offsets[i+1]] and its mask (one entry more,
    data/conversations.py) masks[offsets[i] + i:offsets[i+1] + i + 1]."""

    def __init__(self, tokens: np.ndarray, masks: np.ndarray, offsets: np.ndarray):
        self.tokens, self.masks, self.offsets = tokens, masks, offsets
        self.lengths = np.diff(offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def gather(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids of `docs` back to back, their masks back to back, their lengths)."""
        docs = np.asarray(docs, np.int64)
        lengths = self.lengths[docs]
        starts = np.repeat(self.offsets[docs] - np.cumsum(lengths) + lengths, lengths)
        ids = self.tokens[starts + np.arange(len(starts))]
        mask_lengths = lengths + 1
        mask_starts = np.repeat(self.offsets[docs] + docs - np.cumsum(mask_lengths) + mask_lengths, mask_lengths)
        return ids, self.masks[mask_starts + np.arange(len(mask_starts))], lengths


class RecordConversations:
    """Conversations ids[0], ids[1], ... of pre-tokenized chat shards, read on demand; those of more than
    `keep` tokens (None: none) are cut to it as they are read."""

    def __init__(self, source: chat_sources.ChatShardSource, ids: np.ndarray, lengths: np.ndarray, keep: int | None,
                 vocab_size: int):
        self._source, self._ids, self._keep, self._vocab_size = source, ids, keep, vocab_size
        self.lengths = lengths if keep is None else np.minimum(lengths, keep)

    def __len__(self) -> int:
        return len(self._ids)

    def gather(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, masks = [], []
        for doc, (i, m) in zip(np.asarray(docs, np.int64).tolist(), self._source.examples(self._ids[docs])):
            if self._keep is not None and len(i) > self._keep:
                i, m = conversations.truncate(i, m, self._keep)
            if len(i) != self.lengths[doc] or len(m) != len(i) + 1:
                raise ValueError(f"Pre-tokenized conversation {int(self._ids[doc])} holds {len(i)} ids but its lengths "
                                 "sidecar says otherwise: the shards changed after the sidecars were written. Fix: "
                                 "re-run tools/pretokenize.py --format=chat.")
            if len(i) and (i.min() < 0 or i.max() >= self._vocab_size):
                raise ValueError(f"Pre-tokenized conversation {int(self._ids[doc])} holds a token id outside the "
                                 f"tokenizer's [0, {self._vocab_size}). Fix: set data.tokenizer_path to the tokenizer "
                                 "that made the data.")
            ids.append(i)
            masks.append(m)
        lengths = self.lengths[docs]
        return (np.concatenate(ids) if ids else np.zeros(0, np.int32),
                np.concatenate(masks) if masks else np.zeros(0, np.uint8), lengths)


_worker = None


def _init_worker(source) -> None:
    global _worker
    _worker = source


def _encode_chunk(bound: tuple[int, int]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [_worker.example(i) for i in range(*bound)]


def _encode(source, workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, masks, offsets) of every conversation of `source` (a subset), in order, on `workers` processes."""
    bounds = [(s, min(s + _CHUNK, len(source))) for s in range(0, len(source), _CHUNK)]
    if workers > 1 and len(bounds) > 1:
        chunks = tokenize.run_pool(_encode_chunk, bounds, min(workers, len(bounds)), _init_worker, (source,))
    else:
        _init_worker(source)
        chunks = map(_encode_chunk, bounds)
    examples = [e for chunk in chunks for e in chunk]
    offsets = np.zeros(len(examples) + 1, np.int64)
    np.cumsum([len(ids) for ids, _ in examples], out=offsets[1:])
    tokens = np.concatenate([ids for ids, _ in examples]).astype(np.int32) if examples else np.zeros(0, np.int32)
    masks = np.concatenate([m for _, m in examples]).astype(np.uint8) if examples else np.zeros(0, np.uint8)
    return tokens, masks, offsets


class _Subset:
    """Conversations ids[0], ids[1], ... of a JSONL source, as a source (picklable)."""

    def __init__(self, source, ids: np.ndarray):
        self._source, self._ids = source, ids

    def __len__(self) -> int:
        return len(self._ids)

    def example(self, index: int):
        return self._source.example(int(self._ids[index]))


def _where(source, index: int) -> str:
    if isinstance(source, chat_sources.ChatShardSource):
        return f"pre-tokenized conversation {index} (record number over all shards)"
    return str(source.messages(index)[1])


def load(data_cfg, split: str, tokenizer, share) -> ConversationDocuments | RecordConversations:
    """This process's conversations of `split` (`share(count)` names which, sorted), overlong ones refused or
    truncated as data.overlong says (module docstring)."""
    source = sources.open_source(data_cfg, split, tokenizer_fingerprint=tokenizer.fingerprint, tokenizer=tokenizer)
    ids = share(len(source))
    bos = prompt.document_bos(tokenizer, data_cfg.add_bos)
    first = source.example(int(ids[0])) if len(ids) else None
    if first is not None and bos is not None and len(first[0]) and first[0][0] == bos:
        raise ValueError(f"{_where(source, int(ids[0]))}: the chat template writes the bos token itself, and "
                         "data.add_bos=True would add a second. Fix: set data.add_bos=False.")
    keep = data_cfg.seq_len - (bos is not None)  # ids that fill a row
    if isinstance(source, chat_sources.ChatShardSource):
        lengths = source.document_lengths()[ids]
    else:
        workers = tokenize.default_workers() if len(ids) >= PARALLEL_CONVERSATIONS else 1
        tokens, masks, offsets = _encode(_Subset(source, ids), workers)
        lengths = np.diff(offsets)
    over = np.flatnonzero(lengths > keep)
    if len(over):
        what = (f"{len(over)} of the {len(ids)} {split} conversations{' of this process' if len(ids) < len(source) else ''} "
                f"are longer than a row of data.seq_len={data_cfg.seq_len} positions")
        if data_cfg.overlong == "refuse":
            raise ValueError(f"{what}, the first {_where(source, int(ids[over[0]]))} with "
                             f"{conversations.row_positions(int(lengths[over[0]]), bos is not None)}. Fix: raise "
                             "data.seq_len, set data.overlong='truncate' (each keeps its first data.seq_len positions), "
                             "or leave those conversations out.")
        logging.warning("%s: truncated to their first %d positions (data.overlong='truncate'; %d tokens cut).", what,
                        data_cfg.seq_len, int((lengths[over] - keep).sum()))
    if isinstance(source, chat_sources.ChatShardSource):
        return RecordConversations(source, ids, lengths, keep if len(over) else None, tokenizer.vocab_size)
    if len(over):
        tokens, masks, offsets = _truncated(tokens, masks, offsets, keep)
    return ConversationDocuments(tokens, masks, offsets)


def _truncated(tokens, masks, offsets, keep: int):
    """The flat arrays with every conversation cut to its first `keep` ids, the final eos target of a cut one
    masked out (data/conversations.truncate)."""
    lengths = np.diff(offsets)
    kept = np.minimum(lengths, keep)
    ends = np.cumsum(kept)
    within = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - kept, kept)
    new_tokens = tokens[np.repeat(offsets[:-1], kept) + within]
    conv = np.arange(len(lengths))
    # Each conversation's mask: its first kept entries, then its final (eos) entry, 0 where it was cut.
    mask_ends = ends + conv + 1
    new_masks = np.empty(int(mask_ends[-1]) if len(mask_ends) else 0, np.uint8)
    body = np.repeat(offsets[:-1] + conv, kept) + within
    new_masks[np.repeat(mask_ends - kept - 1, kept) + within] = masks[body]
    new_masks[mask_ends - 1] = np.where(lengths > keep, 0, masks[offsets[1:] + conv])
    new_offsets = np.concatenate([[0], ends]).astype(np.int64)
    return new_tokens, new_masks, new_offsets


def held_out(data_cfg, tokenizer) -> ConversationDocuments | RecordConversations:
    """Every held-out conversation (each process evaluates every process_count-th of them)."""
    return load(data_cfg, "eval", tokenizer, np.arange)

