"""Compressed text and JSONL files (.gz, .zst) with random access to their decompressed bytes.

The line sources (sources.py) read any document by its byte offset, from any grain worker, so batch b
stays a pure function of b. A gzip or zstd stream can only be read from its start, so the first time a
process opens such a file it is decompressed once, streaming, and re-cut into blocks of 16 KiB of
text, each compressed on its own (zlib, fast level) into a local copy: a document's bytes are then one
or two blocks' decompression away. Nothing is decompressed whole, in memory or on disk. The copy lives
in the host's temporary directory (SCONE_JAX_BLOCK_CACHE overrides), named by the file's path, size and
modification time, so every process and every later run on the host reuses it; it is written under a
temporary name and renamed, so a killed process leaves no half copy.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import zlib

import numpy as np

KINDS = {".gz": "gzip", ".zst": "zstd"}
BLOCK_BYTES = 16 << 10  # a document read decompresses one or two blocks
_READ_BYTES = 1 << 22


def kind_of(path: str) -> str | None:
    """'gzip', 'zstd' or None (not compressed), from the file name's suffix."""
    return KINDS.get(os.path.splitext(path)[1].lower())


class DamagedArchive(ValueError):
    pass


def _damaged(path: str, error: Exception) -> DamagedArchive:
    return DamagedArchive(f"{path}: damaged {kind_of(path)} archive ({type(error).__name__}: {error}). Fix: "
                          "download or compress it again (gzip -t / zstd -t checks a file), or leave it out of the glob.")


def stream_chunks(path: str):
    """The decompressed bytes of a .gz or .zst file, chunk by chunk, streaming."""
    try:
        if kind_of(path) == "gzip":
            with gzip.open(path, "rb") as f:
                while chunk := f.read(_READ_BYTES):
                    yield chunk
        else:
            yield from _zstd_frames(path)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise _damaged(path, e) from None
    except Exception as e:  # zstandard.ZstdError
        if type(e).__name__ == "ZstdError":
            raise _damaged(path, e) from None
        raise


def _zstd_frames(path: str):
    """Every frame of a .zst file in turn (`cat a.zst b.zst` is one valid file); a file that ends inside a
    frame is damaged (zstandard's stream reader would just stop there)."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame, fed = decompressor.decompressobj(), False
    with open(path, "rb") as raw:
        while data := raw.read(_READ_BYTES):
            while data:
                fed = True
                if out := frame.decompress(data):
                    yield out
                if not frame.eof:
                    break
                data, frame, fed = frame.unused_data, decompressor.decompressobj(), False
    if fed:
        raise EOFError("the file ends inside a frame (truncated)")


def read_all(path: str) -> bytes:
    """The whole decompressed content (one document per file)."""
    return b"".join(stream_chunks(path))


def _cache_dir() -> str:
    return os.environ.get("SCONE_JAX_BLOCK_CACHE") or os.path.join(tempfile.gettempdir(), "scone_jax_block_cache")


class BlockCopy:
    """Random access to the decompressed bytes of one .gz/.zst file through its local block copy.

    Pickles as its paths and block tables (two numbers per 16 KiB), so grain workers open the same copy."""

    def __init__(self, path: str):
        self.path = path
        stat = os.stat(path)
        key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
        self.copy_path = os.path.join(_cache_dir(), f"{os.path.basename(path)}.{key}.blocks")
        index_path = self.copy_path + ".index.npy"
        if not (os.path.exists(self.copy_path) and os.path.exists(index_path)):
            self._build(index_path)
        index = np.load(index_path)
        self.starts, self.offsets = index[0], index[1]  # per block, with a sentinel: text offset, copy offset

    @property
    def size(self) -> int:
        """Bytes of decompressed text."""
        return int(self.starts[-1])

    def _build(self, index_path: str) -> None:
        os.makedirs(_cache_dir(), exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        starts, offsets, text_at, copy_at, pending = [0], [0], 0, 0, b""
        with open(self.copy_path + suffix, "wb") as out:
            def flush(block: bytes):
                nonlocal text_at, copy_at
                packed = zlib.compress(block, 1)
                out.write(packed)
                text_at, copy_at = text_at + len(block), copy_at + len(packed)
                starts.append(text_at)
                offsets.append(copy_at)

            for chunk in stream_chunks(self.path):
                pending += chunk
                whole = len(pending) - len(pending) % BLOCK_BYTES
                for at in range(0, whole, BLOCK_BYTES):
                    flush(pending[at:at + BLOCK_BYTES])
                pending = pending[whole:]
            if pending:
                flush(pending)
        with open(index_path + suffix, "wb") as f:
            np.save(f, np.array([starts, offsets], np.int64))
        os.replace(self.copy_path + suffix, self.copy_path)
        os.replace(index_path + suffix, index_path)

    def _block(self, fd: int, i: int) -> bytes:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return zlib.decompress(os.pread(fd, end - start, start))

    def pread(self, length: int, offset: int) -> bytes:
        """`length` bytes of decompressed text from `offset` (fewer at the end), as os.pread reads a file."""
        end = min(offset + length, self.size)
        if offset >= end:
            return b""
        first = int(np.searchsorted(self.starts, offset, side="right")) - 1
        last = int(np.searchsorted(self.starts, end - 1, side="right")) - 1
        fd = os.open(self.copy_path, os.O_RDONLY)
        try:
            data = b"".join(self._block(fd, i) for i in range(first, last + 1))
        finally:
            os.close(fd)
        base = int(self.starts[first])
        return data[offset - base:end - base]

    def chunks(self):
        """The decompressed text, block by block (for the line scan)."""
        fd = os.open(self.copy_path, os.O_RDONLY)
        try:
            for i in range(len(self.starts) - 1):
                yield self._block(fd, i)
        finally:
            os.close(fd)
