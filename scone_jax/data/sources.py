"""Random-access document sources (grain's RandomAccessDataSource protocol).

Every source has `__len__` and `__getitem__`, and pickles small (no file handles,
no text), so grain worker processes can read any document by index. Items are
`str` (text) or int32 `np.ndarray` (pre-tokenized ArrayRecord).
"""
from __future__ import annotations

import glob
import json
import os
import threading

import numpy as np
from absl import logging
from array_record.python import array_record_module

from scone_jax.data import compressed, corpus, shards

SOURCES = ("kjv", "text", "jsonl", "arrayrecord", "chat")
_SCAN_BYTES = 1 << 24
_WHITESPACE = np.frombuffer(b" \t\r\n\v\f", np.uint8)


def expand_files(patterns: str) -> list[str]:
    """Sorted files matching comma-separated glob patterns; each pattern must match something.

    Sidecars are left out: `<f>.lengths.npy` and `<f>.json` when `<f>` matched too (shards.py),
    so `dir/*` over pre-tokenized shards lists the shards alone.
    """
    files = set()
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        matches = [f for f in glob.glob(pattern) if os.path.isfile(f)]
        if not matches:
            raise FileNotFoundError(f"No files match the pattern {pattern!r}. Fix: check the path/glob.")
        files.update(matches)
    if not files:
        raise ValueError(f"No file pattern given ({patterns!r}). Fix: set data.train_files / data.eval_files.")
    return sorted(f for f in files if shards.described_shard(f) not in files)


def _line_starts(chunks) -> np.ndarray:
    """Byte offsets of the lines of a file (its bytes as consecutive `chunks`) that hold more than whitespace
    (a blank line is no document), plus the file size as a sentinel (int64). Each line's start and end are tagged with the number of
    non-whitespace bytes before them, in one pass over the file: a line has text iff the two differ."""
    starts, start_counts, ends, end_counts = [], [], [], []
    offset, before, at_line_start = 0, 0, True
    for chunk in chunks:
        if chunk:
            data = np.frombuffer(chunk, np.uint8)
            newline = data == ord("\n")
            text_before = np.cumsum(~np.isin(data, _WHITESPACE), dtype=np.int64) - ~np.isin(data, _WHITESPACE) + before
            begins = np.flatnonzero(np.concatenate([[at_line_start], newline[:-1]]))  # after every newline
            breaks = np.flatnonzero(newline)
            starts.append(begins + offset)
            start_counts.append(text_before[begins])
            ends.append(breaks + offset)
            end_counts.append(text_before[breaks])
            before = int(text_before[-1] + (not np.isin(data[-1], _WHITESPACE)))
            offset += len(chunk)
            at_line_start = bool(newline[-1])
    starts, start_counts = np.concatenate(starts or [np.zeros(0, np.int64)]), np.concatenate(start_counts or [[]])
    ends = np.concatenate([*ends, [offset]]).astype(np.int64)
    end_counts = np.concatenate([*end_counts, [before]]).astype(np.int64)
    line_end = np.searchsorted(ends, starts)  # the newline (or end of file) that closes each line
    keep = end_counts[line_end] > start_counts
    return np.concatenate([starts[keep], [offset]]).astype(np.int64)


class _PlainFile:
    """A file's bytes by offset (the interface compressed.BlockCopy shares)."""

    def __init__(self, path: str):
        self.path = path

    def pread(self, length: int, offset: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def chunks(self):
        with open(self.path, "rb") as f:
            while chunk := f.read(_SCAN_BYTES):
                yield chunk


def _reader(path: str):
    """Random access to the text of `path`: the file itself, or the block copy of a .gz/.zst file."""
    return compressed.BlockCopy(path) if compressed.kind_of(path) else _PlainFile(path)


def _utf8_error(path: str, at: int, reason: str) -> ValueError:
    where = f"byte {at}" + (" of its decompressed text" if compressed.kind_of(path) else "")
    return ValueError(f"{path} at {where}: not UTF-8 text ({reason}). Fix: convert the file to UTF-8 (e.g. iconv -f "
                      "LATIN1 -t UTF-8), or leave it out of the glob.")


class _LineIndex:
    """Shared by the text and JSONL line sources: document i is the i-th non-empty line over all files."""

    def __init__(self, files: list[str]):
        self._files = files
        self._readers = [_reader(f) for f in files]
        per_file = [_line_starts(r.chunks()) for r in self._readers]
        # Offsets of all files back to back, each followed by its sentinel; 8 bytes per document.
        self._offsets = np.concatenate(per_file)
        self._first_doc = np.cumsum([0] + [len(s) - 1 for s in per_file])

    def __len__(self) -> int:
        return int(self._first_doc[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(file number, byte offset) of document `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"document index {index} out of range [0, {len(self)})")
        file_no = int(np.searchsorted(self._first_doc, index, side="right")) - 1
        return file_no, int(self._offsets[index + file_no])

    def read(self, index: int) -> tuple[str, int, str]:
        """(path, byte offset, text) of document `index`: its line, without the line break."""
        file_no, start = self.locate(index)
        end = int(self._offsets[index + file_no + 1])
        path = self._files[file_no]
        raw = self._readers[file_no].pread(end - start, start)
        try:
            return path, start, raw.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8")  # blank lines may follow
        except UnicodeDecodeError as e:
            raise _utf8_error(path, start + e.start, e.reason) from e

    def line_number(self, path: str, offset: int) -> int:
        """The 1-based line number at byte `offset` of `path` (for error messages)."""
        return self._readers[self._files.index(path)].pread(offset, 0).count(b"\n") + 1


class TextLineSource:
    """One document per non-empty line of text files, read by offset; the text stays on disk."""

    def __init__(self, files: list[str]):
        self._index = _LineIndex(files)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> str:
        return self._index.read(index)[2]


class TextFileSource:
    """One document per non-empty file."""

    def __init__(self, files: list[str]):
        self._files = [f for f in files if _has_text(f)]

    def __len__(self) -> int:
        return len(self._files)

    def __getitem__(self, index: int) -> str:
        path = self._files[index]
        if compressed.kind_of(path):
            raw = compressed.read_all(path)
        else:
            with open(path, "rb") as f:
                raw = f.read()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _utf8_error(path, e.start, e.reason) from e


def _has_text(path: str) -> bool:
    """Not an empty file (for a compressed one: its decompressed content)."""
    if compressed.kind_of(path):
        return any(compressed.stream_chunks(path))
    return os.path.getsize(path) > 0


class JsonlSource:
    """One document per non-empty JSONL line: the string in `text_field`."""

    def __init__(self, files: list[str], text_field: str):
        self._index = _LineIndex(files)
        self._field = text_field

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> str:
        path, offset, line = self._index.read(index)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{self._index.line_number(path, offset)}: bad JSON ({e.msg}).") from e
        text = record.get(self._field) if isinstance(record, dict) else None
        if isinstance(record, dict) and self._field in record and not isinstance(text, str):
            raise ValueError(
                f"{path}:{self._index.line_number(path, offset)}: field {self._field!r} holds {json.dumps(text)[:40]}, not "
                "text. Fix: remove or repair that record (every record needs its text in that field)."
            )
        if not isinstance(text, str):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{path}:{self._index.line_number(path, offset)}: no string field {self._field!r} (found {keys}). "
                "Fix: set data.text_field to the field that holds the text."
            )
        return text


class TokenArrayRecordSource:
    """Pre-tokenized documents: each ArrayRecord record is raw little-endian int32 token ids.

    Shards written by tools/pretokenize.py carry sidecars (shards.py) with every record's length
    and the tokenizer fingerprint; shards without them still work, at the cost of one read.
    Each process opens its own readers on first use (readers do not pickle) and reads in the
    calling thread: the input pipeline already runs one builder per core, so a thread pool per
    read (grain's ArrayRecordDataSource starts one per call) only added start-ups, waits and CPU.
    """

    def __init__(self, files: list[str]):
        self._files = list(files)
        self._counts = [shards.num_records(f) for f in self._files]
        self._first = np.concatenate([[0], np.cumsum(self._counts, dtype=np.int64)])
        self._readers, self._lock = None, threading.Lock()
        self._warned_unchecked = False

    def __getstate__(self):
        return {**self.__dict__, "_readers": None, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read_concatenated([index])

    def read_concatenated(self, indices) -> np.ndarray:
        """int32 tokens of documents `indices` (any order, repeats allowed), back to back (a read-only
        view of the records' bytes on little-endian hosts).

        Record by record (seek, read) in this thread: the readers' batched read hands the work to
        array_record's thread pool, whose threads then spin for as long again as the read took."""
        return np.frombuffer(b"".join(self.read_records(indices)), dtype="<i4").astype(np.int32, copy=False)

    def read_records(self, indices) -> list[bytes]:
        """The raw records of documents `indices`, in that order."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            bad = int(indices[(indices < 0) | (indices >= len(self))][0])
            raise IndexError(f"Document {bad} is outside the {len(self)} documents of {len(self._files)} shard(s).")
        shard = np.searchsorted(self._first, indices, side="right") - 1
        local = (indices - self._first[shard]).tolist()
        records = []
        with self._lock:
            for s, position in zip(shard.tolist(), local):
                reader = self._reader(s)
                reader.seek(position)
                records.append(reader.read())
        return records

    def _reader(self, shard: int):
        if self._readers is None:
            self._readers = [None] * len(self._files)
        if self._readers[shard] is None:
            # Random access: no read-ahead, no parallel reads of its own.
            self._readers[shard] = array_record_module.ArrayRecordReader(
                self._files[shard], options="readahead_buffer_size:0,max_parallelism:1",
                file_reader_buffer_size=32768)
        return self._readers[shard]

    def document_lengths(self) -> np.ndarray:
        """int64 token count of every document, from the lengths sidecars where shards have them."""
        per_shard, unindexed = [], []
        for path, count in zip(self._files, self._counts):
            lengths = shards.read_lengths(path, count)
            if lengths is None:
                unindexed.append(path)
                lengths = _record_lengths(path, count)
            per_shard.append(lengths)
        if unindexed:
            logging.warning(
                "%d of %d ArrayRecord shard(s) have no %s sidecar (%s); read every record once to learn the "
                "document lengths. Fix: write the data with tools/pretokenize.py.",
                len(unindexed), len(self._files), shards.LENGTHS_SUFFIX, _some(unindexed))
        return np.concatenate(per_shard) if per_shard else np.zeros(0, np.int64)

    def check_tokenizer(self, fingerprint: str) -> None:
        """Refuses shards whose sidecar names another tokenizer; warns once about shards without one."""
        unchecked = []
        for path, count in zip(self._files, self._counts):
            meta = shards.read_sidecar(path, count)
            if meta is None:
                unchecked.append(path)
            elif meta.get("tokenizer_fingerprint") != fingerprint:
                raise ValueError(
                    f"{path} was tokenized with tokenizer {meta.get('tokenizer_fingerprint')} but this run uses "
                    f"{fingerprint}. Fix: set data.tokenizer_path to the tokenizer that made the data, or re-run "
                    "tools/pretokenize.py with this one."
                )
        if unchecked and not self._warned_unchecked:
            self._warned_unchecked = True
            logging.warning(
                "%d of %d ArrayRecord shard(s) have no %s sidecar (%s), so their tokenizer cannot be checked. "
                "Fix: write the data with tools/pretokenize.py.",
                len(unchecked), len(self._files), shards.META_SUFFIX, _some(unchecked))


def _record_lengths(path: str, count: int, batch: int = 4096) -> np.ndarray:
    """Token count of every record of one shard, read in batches (bounded memory)."""
    reader = array_record_module.ArrayRecordReader(path)
    try:
        lengths = np.zeros(count, np.int64)
        for start in range(0, count, batch):
            stop = min(start + batch, count)
            lengths[start:stop] = [len(r) // 4 for r in reader.read(start, stop)]
        return lengths
    finally:
        reader.close()


def _some(paths: list[str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def write_token_arrayrecord(path: str, docs) -> None:
    """Writes token-id documents (iterable of int sequences) as one ArrayRecord file."""
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    try:
        for doc in docs:
            writer.write(np.asarray(doc, dtype="<i4").tobytes())
    finally:
        writer.close()


class KjvSource:
    """The embedded KJV corpus; pickles as (split, fraction) and re-reads the text in each process."""

    def __init__(self, split: str, eval_fraction: float):
        self._split, self._fraction = split, eval_fraction
        corpus.kjv_documents(split, eval_fraction)  # fail early on a bad split/fraction

    def __len__(self) -> int:
        return len(corpus.kjv_documents(self._split, self._fraction))

    def __getitem__(self, index: int) -> str:
        return corpus.kjv_documents(self._split, self._fraction)[index]


def open_source(data_cfg, split: str, tokenizer_fingerprint: str | None = None, tokenizer=None):
    """The document source that data_cfg names for `split` ('train' or 'eval').

    With `tokenizer_fingerprint`, pre-tokenized shards made by another tokenizer are refused. Conversations
    (data.source='chat', data/chat_sources.py) need `tokenizer`: their items are its ids.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} is not valid; use 'train' or 'eval'.")
    kind = data_cfg.source
    if kind not in SOURCES:
        raise ValueError(f"data.source={kind!r} is unknown; valid sources: {', '.join(SOURCES)}.")
    patterns = data_cfg.train_files if split == "train" else data_cfg.eval_files
    if kind == "kjv":
        if patterns:
            key = "train_files" if split == "train" else "eval_files"
            raise ValueError(
                f"data.{key}={patterns!r} is set but data.source='kjv' reads the embedded corpus. "
                f"Fix: clear data.{key}, or set data.source to one of text/jsonl/arrayrecord/chat."
            )
        source, where = KjvSource(split, data_cfg.eval_fraction), f"kjv {split} split"
    else:
        if not patterns:
            key = "train_files" if split == "train" else "eval_files"
            raise ValueError(f"data.source={kind!r} needs data.{key}: a comma-separated list of globs.")
        files = expand_files(patterns)
        where = f"{len(files)} file(s) matching {patterns!r}"
        if kind == "text" and data_cfg.document_unit not in ("line", "file"):
            raise ValueError(f"data.document_unit={data_cfg.document_unit!r} is unknown; use 'line' or 'file'.")
        if kind == "text":
            source = TextLineSource(files) if data_cfg.document_unit == "line" else TextFileSource(files)
        elif kind == "jsonl":
            source = JsonlSource(files, data_cfg.text_field)
        elif kind == "chat":
            from scone_jax.data import chat_sources  # it builds on this module

            source = chat_sources.open_chat(data_cfg, files, tokenizer)
        else:
            source = TokenArrayRecordSource(files)
    if len(source) == 0:
        raise ValueError(f"The {where} hold zero documents (data.source={kind!r}). Fix: point at non-empty data.")
    if kind == "jsonl":
        source[0]  # fail now, not inside a worker, when data.text_field is wrong
    if kind == "arrayrecord" and tokenizer_fingerprint is not None:
        source.check_tokenizer(tokenizer_fingerprint)
    return source
