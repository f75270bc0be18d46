"""An export's table files, opened for reading only: whole chunks for a load into RAM, many small blocks
at once for rows served from disk.

Local block reads bypass the page cache (O_DIRECT, into page-aligned buffers) and go through kernel AIO
(runtime/aio.py): one thread keeps tens of reads queued on the device and checks each block's CRC as it
arrives, which is what lets a table far larger than RAM run at the disk's own speed
(tools/bench_table_io.py). A filesystem without O_DIRECT (tmpfs before Linux 6.6) falls back, with a
note, to buffered os.preadv from a pool of threads (each read releases the GIL). Whole chunks (a load
into RAM, the head of a disk table) are read buffered, on the pool.
gs:// objects are read with tensorstore's kvstore, byte ranges for blocks, all requests issued before
the first wait. Nothing here writes.
"""
from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import resource
import threading
import zlib

import numpy as np
import tensorstore as ts
from absl import logging

from scone_jax.runtime import aio, storage
from scone_jax.runtime.errors import one_line
from scone_jax.serving import bundle, bundle_files
from scone_jax.serving.table_layout import Layout

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the device's block size; a page covers it
# Up to this many blocks, read one after another with os.preadv: one read waits ~55 us that way here, ~250 us
# through kernel AIO (tools/bench_table_io.py's decode figure).
_SYNC_BLOCKS = 4
_PIECE = 256 << 20  # large sequential reads load fastest here (0.64-0.69 s/GB cold against 0.8-1.2 at 16 MiB)


class TableFiles:
    """The table's files (serving/table_layout.py) of the bundle at `path`. `problems` holds what is wrong with
    any of them (chunk -> state), found at open; callers raise bundle.bad_table_error with it."""

    direct = False  # block reads bypass the page cache (start_direct)

    def __init__(self, path: str, layout: Layout, threads: int):
        self.path, self.layout = path, layout
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="table-io")
        self.threads = threads
        self.problems: dict[int, str] = {}

    @staticmethod
    def open(path: str, layout: Layout, *, threads: int = 64) -> "TableFiles":
        cls = RemoteFiles if storage.is_remote(path) else LocalFiles
        return cls(path, layout, threads)

    def start_direct(self) -> None:
        """From now on, block reads bypass the page cache where they can (local files); whole-chunk reads end."""

    def read_into(self, c: int, offset: int, out: np.ndarray) -> None:
        """Fill `out` (a contiguous uint8 array) with chunk c's file from byte `offset`; OSError if it cannot."""
        raise NotImplementedError

    def read(self, c: int, offset: int, length: int) -> np.ndarray:
        """`length` bytes of chunk c's file from `offset` (e.g. its block index)."""
        out = np.empty(length, np.uint8)
        self.read_into(c, offset, out)
        return out

    def read_all(self, jobs) -> None:
        """read_into(c, offset, out) for each (c, offset, out) of `jobs`, on the pool, in pieces of at most 256 MiB
        (a file of 1 GiB rows is still read by four threads)."""
        pieces = [(c, offset + at, out[at:at + _PIECE]) for c, offset, out in jobs for at in range(0, out.size, _PIECE)]
        for future in [self.pool.submit(self.read_into, *piece) for piece in pieces]:
            future.result()

    def read_blocks(self, chunks: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, want: np.ndarray
                    ) -> tuple[np.ndarray, dict[int, str]]:
        """Read block i (lengths[i] bytes of chunk chunks[i]'s file at offsets[i]) and check it against the CRC
        want[i]: ([n, block bytes] uint8, block i's bytes first in row i, valid until the next call; {i: what is
        wrong} for the blocks that failed, the CRC of what was read (8 hex digits) or why it could not be read)."""
        raise NotImplementedError

    def _split(self, n: int):
        return np.array_split(np.arange(n), max(1, min(n, self.threads)))

    def close(self):
        self.pool.shutdown()


_HEADROOM = 256  # descriptors left for the rest of the program when the limit is raised for the table


def _open_descriptors() -> int:
    """How many descriptors this process has open now (0 where /proc does not say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _allow_open_files(files: int, path: str) -> None:
    """Make room for the table's `files` descriptors (a 1B-row table at d = 2048 is 15,259 files of 65,536 rows), and
    one more while start_direct swaps a file's descriptor, beside those open now: the soft open-file limit is
    raised where it is short (with some headroom, up to the hard limit); OSError naming the fix if even the hard
    limit is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = _open_descriptors()
    needed = in_use + files + 1
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise OSError(f"the table at {path} needs {files:,} open files, and with the {in_use:,} this process has open "
                      f"that is more than it may open (hard limit {hard:,}). Fix: raise the limit (`ulimit -Hn`, "
                      "limits.conf), or export with a larger --chunk_rows (fewer, larger files).")
    raised = needed + _HEADROOM
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised if hard == resource.RLIM_INFINITY else min(raised, hard), hard))


class LocalFiles(TableFiles):
    def __init__(self, path: str, layout: Layout, threads: int):
        super().__init__(path, layout, threads)
        self.fds = np.full(layout.num_chunks, -1, np.int64)
        self.direct_fds = np.full(layout.num_chunks, -1, np.int64)
        self._aio = None
        self._real = [""] * layout.num_chunks  # each file's path, links inside the bundle resolved
        try:
            if layout.num_chunks:
                bundle_files.resolve(path, bundle.TABLE, want_dir=True)  # a real directory of the bundle
            _allow_open_files(layout.num_chunks, path)
            for c in range(layout.num_chunks):
                self._open_buffered(c)
        except BaseException:
            self.close()
            raise
        block_bytes = layout.block_rows * layout.row_bytes
        # A read buffer slot per block: the block itself when blocks are whole pages, else room for the
        # aligned pages around a block at any offset.
        self._slot = block_bytes if block_bytes % ALIGN == 0 else -(-block_bytes // ALIGN) * ALIGN + ALIGN
        self._buffer = np.empty(0, np.uint8)
        self._lock = threading.Lock()

    def _name(self, c: int) -> str:
        return os.path.join(self.path, bundle.chunk_key(c))

    def _open_buffered(self, c: int) -> None:
        """Chunk c's file, never through a link out of the bundle and only if it is a regular file (a FIFO would
        block reads); what is wrong with it goes to `problems`."""
        try:
            opened = bundle_files.open_regular(self.path, bundle.chunk_key(c))
        except bundle_files.UnsafeBundleFile as e:
            self.problems[c] = e.what
            return
        if opened is None:
            self.problems[c] = "is missing"
            return
        self.fds[c], self._real[c] = opened
        size, want = os.fstat(int(self.fds[c])).st_size, self.layout.file_bytes(c)
        if size != want:
            self.problems[c] = f"is {size} bytes, not the {want} its rows and block index take (truncated or replaced)"

    def start_direct(self) -> None:
        """Start a kernel AIO context, open the first file with O_DIRECT and read a page of it: a filesystem
        without O_DIRECT (tmpfs before Linux 6.6, some FUSE ones) refuses with EINVAL; then, or where kernel AIO
        is missing, rows stay read with buffered preads from threads. Else each file's O_DIRECT descriptor
        replaces its buffered one."""
        if self.problems or not len(self.fds):
            return
        try:
            self._aio = aio.AsyncReads(self.threads)
            self.direct_fds[0] = self._open_direct(0)
            page = np.frombuffer(mmap.mmap(-1, ALIGN), np.uint8)
            self._aio.read(self.direct_fds[:1], np.zeros(1, np.int64), np.full(1, ALIGN), np.full(1, page.ctypes.data),
                           _raise_errors)
        except OSError as e:
            self._close_direct()
            logging.warning("%s", no_direct_note(self.path, e.errno or errno.EINVAL))
            return
        for c in range(len(self.fds)):
            if c:
                self.direct_fds[c] = self._open_direct(c)
            os.close(int(self.fds[c]))
            self.fds[c] = -1
        self.direct = True

    def _open_direct(self, c: int) -> int:
        """Chunk c's file again, with O_DIRECT: the same file as its buffered descriptor, or BundleError."""
        fd = os.open(self._real[c], os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        have, want = os.fstat(fd), os.fstat(int(self.fds[c]))
        if (have.st_dev, have.st_ino) != (want.st_dev, want.st_ino):
            os.close(fd)
            raise bundle.BundleError(f"{self._name(c)} was replaced while the table was opened. Fix: open it again.")
        return fd

    def _close_direct(self):
        if self._aio is not None:
            self._aio.close()  # waits for reads in flight: only then may their buffer go
            self._aio = None
        for fd in self.direct_fds[self.direct_fds >= 0].tolist():
            os.close(fd)
        self.direct_fds[:] = -1

    def _pread_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset` (a read may return less than asked); returns the bytes read."""
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def read_into(self, c: int, offset: int, out: np.ndarray) -> None:
        assert not self.direct, "whole-chunk reads come before start_direct"
        if self._pread_into(int(self.fds[c]), memoryview(out), offset) != out.size:
            raise OSError(f"{self._name(c)} cannot be read (it ended early)")

    def read_blocks(self, chunks, offsets, lengths, want):
        block_bytes = self.layout.block_rows * self.layout.row_bytes
        if not self.direct:
            return self._read_blocks_threads(chunks, offsets, lengths, want, block_bytes)
        with self._lock:  # one AIO context and one buffer: gathers from two threads take turns
            n = len(chunks)
            start = offsets - offsets % ALIGN
            skip = offsets - start
            if self._buffer.size < n * self._slot:  # page-aligned (a fresh mapping), kept for the next batch
                self._buffer = np.frombuffer(mmap.mmap(-1, max(n * self._slot, 2 * self._buffer.size)), np.uint8)
            view, bad = memoryview(self._buffer), {}
            at = (np.arange(n) * self._slot + skip).tolist()
            need, length, crcs = (skip + lengths).tolist(), lengths.tolist(), want.tolist()

            def check(done, results):
                for i, got in zip(done.tolist(), results.tolist()):
                    if got < need[i]:
                        why = os.strerror(-got) if got < 0 else "the file ended early"
                        bad[i] = f"cannot be read ({why})"
                    elif (have := zlib.crc32(view[at[i]:at[i] + length[i]])) != crcs[i]:
                        bad[i] = f"{have:08x}"

            size = -(-(skip + lengths) // ALIGN) * ALIGN
            if n <= _SYNC_BLOCKS:  # a decoding step's few rows: plain reads wait less than an AIO round trip
                results = [self._pread_into(int(self.direct_fds[c]), view[i * self._slot:i * self._slot + z], o)
                           for i, (c, o, z) in enumerate(zip(chunks.tolist(), start.tolist(), size.tolist()))]
                check(np.arange(n), np.asarray(results))
            else:
                self._aio.read(self.direct_fds[chunks], start, size,
                               self._buffer.ctypes.data + np.arange(n) * self._slot, check)
            slots = self._buffer[:n * self._slot].reshape(n, self._slot)
            if self._slot == block_bytes:  # blocks are whole pages: the buffer is the result (until the next read)
                return slots, bad
            staged = np.empty((n, block_bytes), np.uint8)
            for d in np.unique(skip).tolist():  # few distinct offsets within a page
                pick = skip == d
                staged[pick] = slots[pick, d:d + block_bytes]
            return staged, bad

    def _read_blocks_threads(self, chunks, offsets, lengths, want, block_bytes):
        staged = np.empty((len(chunks), block_bytes), np.uint8)

        def part(indices):
            bad = {}
            for i in indices.tolist():
                length = int(lengths[i])
                data = memoryview(staged[i, :length])
                if self._pread_into(int(self.fds[chunks[i]]), data, int(offsets[i])) != length:
                    bad[i] = "cannot be read (the file ended early)"
                elif (have := zlib.crc32(data)) != int(want[i]):
                    bad[i] = f"{have:08x}"
            return bad

        bad = {}
        for found in self.pool.map(part, self._split(len(chunks))):
            bad |= found
        return staged, bad

    def close(self):
        super().close()
        self._close_direct()
        for fd in self.fds[self.fds >= 0].tolist():
            os.close(fd)
        self.fds[:] = -1


def no_direct_note(path: str, error: int) -> str:
    """The note for a filesystem that refuses O_DIRECT or kernel AIO (`error`: its errno): reads then go through
    the page cache, from threads (tools/bench_table_io.py gives the same note for its raw reads)."""
    return (f"Note: {path} cannot be read with O_DIRECT and kernel AIO ({os.strerror(error)}); table rows are read "
            "through the page cache instead, from threads.")


def _raise_errors(done, results):
    if (results < 0).any():
        raise OSError(int(-results.min()), os.strerror(int(-results.min())))


class RemoteFiles(TableFiles):
    def __init__(self, path: str, layout: Layout, threads: int):
        super().__init__(path, layout, threads)
        self.store = storage.open_store(storage.join(path, bundle.TABLE))
        present = {k.decode() for k in self.store.list().result()}
        for c in range(layout.num_chunks):
            if self._key(c) not in present:
                self.problems[c] = "is missing"

    def _key(self, c: int) -> str:
        return bundle.chunk_key(c).split("/", 1)[1]

    def _range(self, c: int, offset: int, length: int, batch=None):
        return self.store.read(self._key(c), byte_range=slice(offset, offset + length), batch=batch)

    def read_into(self, c: int, offset: int, out: np.ndarray) -> None:
        try:
            out[:] = np.frombuffer(_value(self._range(c, offset, out.size)), np.uint8)
        except OSError as e:
            raise OSError(f"{storage.join(self.path, bundle.chunk_key(c))} cannot be read ({e})") from None

    def read_blocks(self, chunks, offsets, lengths, want):
        out = np.empty((len(chunks), self.layout.block_rows * self.layout.row_bytes), np.uint8)
        with ts.Batch() as batch:
            reads = [self._range(int(c), int(o), int(n), batch) for c, o, n in zip(chunks, offsets, lengths)]
        bad = {}
        for i, future in enumerate(reads):
            try:
                data = _value(future)
            except OSError as e:
                bad[i] = f"cannot be read ({e})"
                continue
            out[i, :len(data)] = np.frombuffer(data, np.uint8)
            if (have := zlib.crc32(data)) != int(want[i]):
                bad[i] = f"{have:08x}"
        return out, bad


def _value(future) -> bytes:
    """The bytes a kvstore read returned; OSError saying why there are none."""
    try:
        result = future.result()
    except ValueError as e:  # tensorstore: a short object answers OUT_OF_RANGE
        raise OSError(one_line(e)) from None
    if result.state != "value":
        raise OSError("the object is missing")
    return result.value
