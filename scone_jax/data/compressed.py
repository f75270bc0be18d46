"""Compressed text and JSONL files (.gz, .zst) with random access to their decompressed bytes.

The line sources (sources.py) read any document by its byte offset, from any grain worker, so batch b
stays a pure function of b. A gzip or zstd stream can only be read from its start, so the first time a
process opens such a file it is decompressed once, streaming, and re-cut into blocks of 16 KiB of
text, each compressed on its own (zlib, fast level) into a local copy: a document's bytes are then one
or two blocks' decompression away. Nothing is decompressed whole, in memory or on disk.

The copy lives in this user's cache directory (local_cache.py), named by the archive's path, size and
CRC-32 (its content, which the training-file identity reads anyway), so every process and every later
run on the host reuses it, and an archive replaced by other bytes gets a new one. Its index records the
archive's size and CRC as read while the copy was made, and each block's CRC: a copy whose archive
differs is rebuilt before use, and the line scan at every start checks every block, rebuilding a damaged
copy. It is written under a temporary name and renamed, so a killed process or a full disk leaves no
half copy.
"""
from __future__ import annotations

import errno
import gzip
import hashlib
import os
import zlib

import numpy as np
from absl import logging

from scone_jax.data import local_cache
from scone_jax.runtime.errors import one_line

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


def stream_chunks(path: str, raw=None):
    """The decompressed bytes of a .gz or .zst file, chunk by chunk, streaming; from `raw` (the archive
    opened for binary reading) when given."""
    if raw is None:
        with open(path, "rb") as raw:
            yield from stream_chunks(path, raw)
        return
    try:
        if kind_of(path) == "gzip":
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                while chunk := f.read(_READ_BYTES):
                    yield chunk
        else:
            yield from _zstd_frames(raw)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise _damaged(path, e) from None
    except Exception as e:  # zstandard.ZstdError
        if type(e).__name__ == "ZstdError":
            raise _damaged(path, e) from None
        raise


def _zstd_frames(raw):
    """Every frame of a .zst file in turn (`cat a.zst b.zst` is one valid file); a file that ends inside a
    frame is damaged (zstandard's stream reader would just stop there)."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame, fed = decompressor.decompressobj(), False
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


class DamagedCopy(ValueError):
    pass


class _Crc32Reader:
    """A binary file that keeps the CRC-32 of the bytes read from it (the archive, as the copy is made)."""

    def __init__(self, f):
        self._f, self.crc, self.mode = f, 0, "rb"

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self.crc = zlib.crc32(data, self.crc)
        return data


class BlockCopy:
    """Random access to the decompressed bytes of one .gz/.zst file through its local block copy.

    Pickles as its paths and block tables (three numbers per 16 KiB), so grain workers open the same copy."""

    def __init__(self, path: str):
        self.path = path
        size, crc = local_cache.file_id(path)
        self.archive = np.array([size, int(crc, 16)], np.int64)  # what the copy must have been made from
        key = hashlib.sha256(f"{os.path.abspath(path)}|{size}|{crc}".encode()).hexdigest()[:24]
        self.copy_path = os.path.join(local_cache.directory(), f"{os.path.basename(path)}.{key}.blocks")
        if not self._load():
            self._build()

    @property
    def index_path(self) -> str:
        return self.copy_path + ".index.npz"

    @property
    def size(self) -> int:
        """Bytes of decompressed text."""
        return int(self.starts[-1])

    def _load(self) -> bool:
        """Take the existing copy's tables if it was made from this archive's bytes and is whole."""
        try:
            with np.load(self.index_path) as index:
                archive, starts, offsets, crcs = index["archive"], index["starts"], index["offsets"], index["crcs"]
            copy_bytes = os.path.getsize(self.copy_path)
        except FileNotFoundError:
            return False
        except Exception as e:  # noqa: BLE001 - an index that does not load is rebuilt, whatever numpy says
            logging.warning("%s: unreadable (%s); building the block copy of %s again.", self.index_path,
                            one_line(e), self.path)
            return False
        if not np.array_equal(archive, self.archive) or copy_bytes != offsets[-1] or len(crcs) != len(starts) - 1:
            logging.warning("%s was not made from %s as it is now (archive size, CRC %s, recorded %s; %d copy bytes "
                            "for %d); building it again.", self.copy_path, self.path, self.archive.tolist(),
                            archive.tolist(), copy_bytes, offsets[-1])
            return False
        self.starts, self.offsets, self.crcs = starts, offsets, crcs  # per block: text offset, copy offset, text CRC
        return True

    def _build(self) -> None:
        """Decompress the archive into a new copy, hashing the archive's bytes as they are read. A write that
        fails (a full disk) is a one-line ValueError, as the training job reports bad input, and leaves no
        file behind."""
        scratch, index_scratch = local_cache.temporary(self.copy_path), local_cache.temporary(self.index_path)
        starts, offsets, crcs, text_at, copy_at, pending = [0], [0], [], 0, 0, b""
        archive = open(self.path, "rb")
        try:
            with archive, open(scratch, "wb") as out:
                raw = _Crc32Reader(archive)

                def flush(block: bytes):
                    nonlocal text_at, copy_at
                    packed = zlib.compress(block, 1)
                    out.write(packed)
                    text_at, copy_at = text_at + len(block), copy_at + len(packed)
                    starts.append(text_at)
                    offsets.append(copy_at)
                    crcs.append(zlib.crc32(block))

                for chunk in stream_chunks(self.path, raw):
                    pending += chunk
                    whole = len(pending) - len(pending) % BLOCK_BYTES
                    for at in range(0, whole, BLOCK_BYTES):
                        flush(pending[at:at + BLOCK_BYTES])
                    pending = pending[whole:]
                if pending:
                    flush(pending)
                while raw.read(_READ_BYTES):  # bytes after the last stream count too
                    pass
            if raw.crc != self.archive[1]:
                raise ValueError(f"{self.path} changed while it was read (CRC {self.archive[1]:08x} at start, "
                                 f"{raw.crc:08x} now). Fix: rerun once nothing writes to it.")
            tables = dict(archive=self.archive, starts=np.array(starts, np.int64), offsets=np.array(offsets, np.int64),
                          crcs=np.array(crcs, np.uint32))
            with open(index_scratch, "wb") as f:
                np.savez(f, **tables)
            os.replace(scratch, self.copy_path)
            os.replace(index_scratch, self.index_path)
        except BaseException as e:
            for name in (scratch, index_scratch):
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass
            if isinstance(e, OSError):
                raise _unwritable(self.path, os.path.dirname(self.copy_path), e) from None
            raise
        self.starts, self.offsets, self.crcs = tables["starts"], tables["offsets"], tables["crcs"]

    def _block(self, fd: int, i: int) -> bytes:
        """Block i's text, checked against its CRC."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        try:
            block = zlib.decompress(os.pread(fd, end - start, start))
        except zlib.error:
            block = None
        if block is None or len(block) != self.starts[i + 1] - self.starts[i] or zlib.crc32(block) != self.crcs[i]:
            raise DamagedCopy(f"{self.copy_path}: the block copy of {self.path} is damaged (block {i}, bytes "
                              f"{start}-{end}). Fix: rerun; each start checks every block and builds a damaged "
                              "copy again (or delete the file).")
        return block

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
        """The decompressed text, block by block, for the line scan at every start: each block is checked, and
        a damaged copy is built again once (the blocks already given are the same text in the new copy)."""
        i, rebuilt = 0, False
        while i < len(self.starts) - 1:
            fd = os.open(self.copy_path, os.O_RDONLY)
            try:
                while i < len(self.starts) - 1:
                    block = self._block(fd, i)
                    yield block
                    i += 1
            except DamagedCopy:
                if rebuilt:
                    raise
                logging.warning("%s is damaged (block %d): building the block copy of %s again.", self.copy_path, i,
                                self.path)
                self._build()
                rebuilt = True
            finally:
                os.close(fd)


def _unwritable(path: str, directory: str, error: OSError) -> ValueError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return ValueError(f"{path}: no space left for its block copy in {directory} ({one_line(error)}; the copy "
                          f"is a little larger than the archive). Nothing was left behind. Fix: free space there, "
                          f"or set ${local_cache.ENV} to a directory of yours with room.")
    return ValueError(f"{path}: its block copy could not be written to {directory} ({one_line(error)}). Nothing "
                      f"was left behind. Fix: set ${local_cache.ENV} to a directory of yours that can be written.")
