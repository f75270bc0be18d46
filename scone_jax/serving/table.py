"""The f-gram table on the host: load it, gather rows for a batch, and feed them to the device ahead.

At inference the accelerator holds only the main model (docs/method.md §7); each batch's f-gram rows
come from host memory. A table that fits the memory budget is read whole into one numpy array
(tensorstore reads chunks in parallel); a larger one is served from a bounded LRU cache of table
chunks read on demand, from local disk or GCS alike. Gathers split large batches over threads
(numpy releases the GIL in `take`); serving/prefetch.py prepares and transfers batch i+1 while the
device computes batch i.

Every chunk is checked against the CRC-32 its export recorded as it is read: the whole table once at
load (in RAM; split over the gather threads), or each chunk the cache fetches. A missing chunk reads
as zeros and fails its CRC, so a damaged table is a BundleError naming the chunk, never zero rows.
tools/bench_serving.py reports what the checks cost (docs/benchmarks.md).
"""
from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time
from collections.abc import Callable

import numpy as np
import tensorstore as ts
from absl import logging

from scone_jax.runtime.errors import one_line
from scone_jax.serving import bundle

_THREAD_MIN_ROWS = 1 << 14  # below this a single take is faster than handing work to threads
_FEW_ROWS = 64  # up to this many ids (decoding), indexing with a Python list beats the general path


class HostTable:
    """Rows [S, d] of an export; `gather(ids)` -> [*ids.shape, d], zero rows where ids < 0.

    `checksums`: the CRC-32 of each chunk's rows (bundle.Checksums.table); None reads unchecked."""

    def __init__(self, store: ts.TensorStore, meta: dict, *, max_bytes: int | None = None, threads: int = 4,
                 checksums: list[str] | None = None, path: str = "the table"):
        self.meta, self.path, self._sums = meta, path, checksums
        self.num_rows, self.width = meta["num_fgrams"], meta["d_model"]
        self.chunk_rows = meta["chunk_rows"]
        self.dtype = bundle.numpy_dtype(meta["dtype"])
        self.nbytes = self.num_rows * self.width * self.dtype.itemsize
        self._pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
        self._threads = threads
        self.read_seconds = self.verify_seconds = 0.0  # loading, and checking CRCs (the cache adds per fetch)
        self.checksums: bundle.Checksums | None = None  # set by open(): the bundle's, files included
        if max_bytes is None or self.nbytes <= max_bytes:
            start = time.perf_counter()
            try:
                self._rows = store.read().result()
            except ValueError as e:  # an unreadable chunk (e.g. truncated): find which, for the message
                raise self._unreadable(store, e) from None
            self.read_seconds = time.perf_counter() - start
            self._cache = None
            self._verify_all()
        else:
            self._rows = None
            self._cache = ChunkCache(store, self.chunk_rows, max_bytes, check=self._check_chunk)

    @classmethod
    def open(cls, path: str, *, expect: dict | None = None, max_bytes: int | None = None, threads: int = 4):
        """Load the table of a finished export; `expect` holds fingerprints it must carry."""
        meta, sums = bundle.open_checked(path, expect)
        store = ts.open(bundle.table_spec(path), open=True).result()
        bundle.check_table(meta, store, path)
        chunks = math.ceil(meta["num_fgrams"] / meta["chunk_rows"])
        if len(sums.table) != chunks:
            raise bundle.BundleError(f"{path!r}: {bundle.COMPLETE} records {len(sums.table)} table chunks, the table "
                                     f"has {chunks}; the bundle was altered. Fix: export again into a fresh --output.")
        table = cls(store, meta, max_bytes=max_bytes, threads=threads,
                    checksums=sums.table, path=path)
        table.checksums = sums
        return table

    def _chunk(self, c: int) -> slice:
        return slice(c * self.chunk_rows, min((c + 1) * self.chunk_rows, self.num_rows))

    def _verify_all(self) -> None:
        """Every chunk of the in-RAM rows against its CRC, the chunks split over the threads."""
        if self._sums is None:
            return
        start = time.perf_counter()

        def bad_in(chunks):
            return {int(c): h for c in chunks
                    if (h := bundle.array_checksum(self._rows[self._chunk(int(c))])) != self._sums[int(c)]}

        groups = np.array_split(np.arange(len(self._sums)), max(1, self._threads))
        bad = {}
        for found in (self._pool.map(bad_in, groups) if self._pool is not None else map(bad_in, groups)):
            bad |= found
        self.verify_seconds += time.perf_counter() - start
        if bad:
            raise bundle.bad_chunks_error(self.path, self.meta, bad, self._sums)

    def _check_chunk(self, c: int, rows: np.ndarray) -> None:
        """A chunk the cache fetched (or the exception reading it): its CRC, or the error naming it."""
        if isinstance(rows, Exception):
            raise bundle.bad_chunks_error(self.path, self.meta, {c: rows}, self._sums) from rows
        if self._sums is None:
            return
        start = time.perf_counter()
        have = bundle.array_checksum(rows)
        self.verify_seconds += time.perf_counter() - start
        if have != self._sums[c]:
            raise bundle.bad_chunks_error(self.path, self.meta, {c: have}, self._sums)

    def _unreadable(self, store: ts.TensorStore, error: ValueError) -> bundle.BundleError:
        bad = {}
        for c in range(math.ceil(self.num_rows / self.chunk_rows)):
            try:
                store[self._chunk(c)].read().result()
            except ValueError as e:
                bad[c] = e
        if not bad:  # each chunk reads alone: a passing storage error
            return bundle.BundleError(f"Reading the table at {self.path!r} failed: {one_line(error)}. "
                                      "Fix: try again; if it persists, export again into a fresh --output.")
        return bundle.bad_chunks_error(self.path, self.meta, bad, self._sums)

    @property
    def in_ram(self) -> bool:
        return self._rows is not None

    def gather(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        flat = ids.reshape(-1)
        if self.num_rows == 0:  # a decoder-only bundle (no f-grams): nothing ever matches
            if flat.size and flat.max() >= 0:
                self._out_of_range(int(flat.max()))
            return np.zeros((*ids.shape, self.width), self.dtype)
        if self._rows is not None and flat.size <= _FEW_ROWS:  # decoding: skip the ~10 numpy calls below
            few = flat.tolist()
            if few and max(few) >= self.num_rows:
                self._out_of_range(max(few))
            out = self._rows[[max(i, 0) for i in few]]
            if few and min(few) < 0:
                out[flat < 0] = 0
            return out.reshape(*ids.shape, self.width)
        if flat.size and flat.max() >= self.num_rows:
            self._out_of_range(int(flat.max()))
        out = np.empty((flat.size, self.width), self.dtype)
        if self._cache is not None:
            self._cache.gather(flat, out)
        elif self._pool is None or flat.size < _THREAD_MIN_ROWS:
            np.take(self._rows, np.maximum(flat, 0), axis=0, out=out)
        else:
            bounds = np.linspace(0, flat.size, self._threads + 1).astype(int)
            parts = [self._pool.submit(np.take, self._rows, np.maximum(flat[a:b], 0), 0, out[a:b])
                     for a, b in zip(bounds[:-1], bounds[1:])]
            for p in parts:
                p.result()
        out[flat < 0] = 0
        return out.reshape(*ids.shape, self.width)

    def _out_of_range(self, row: int):
        raise ValueError(f"F-gram id {row} is outside the table's {self.num_rows} rows; the ids come "
                         "from another vocabulary than the table's.")

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()


class ChunkCache:
    """At most `max_bytes` of table chunks in RAM, least recently used evicted first; `check(chunk, rows or
    the read's exception)` raises for a bad chunk before it is cached."""

    def __init__(self, store: ts.TensorStore, chunk_rows: int, max_bytes: int,
                 check: Callable[[int, np.ndarray | Exception], None] | None = None):
        self.store, self.chunk_rows, self.check = store, chunk_rows, check
        chunk_bytes = chunk_rows * store.shape[1] * store.dtype.numpy_dtype.itemsize
        if max_bytes < chunk_bytes:
            logging.warning("--max_table_bytes=%d is less than one table chunk (%d bytes, %d rows): the cache keeps "
                            "one chunk, %d bytes, in RAM.", max_bytes, chunk_bytes, chunk_rows, chunk_bytes)
        self.max_chunks = max(1, max_bytes // chunk_bytes)
        self.chunks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self.reads = 0
        self._lock = threading.Lock()

    def gather(self, flat: np.ndarray, out: np.ndarray) -> None:
        chunk_of = np.maximum(flat, 0) // self.chunk_rows
        needed = np.unique(chunk_of)
        for start in range(0, len(needed), self.max_chunks):  # a batch wider than the cache goes in rounds
            group = needed[start:start + self.max_chunks]
            with self._lock:
                self._load(group)
                for c in group:
                    at = chunk_of == c
                    out[at] = self.chunks[int(c)][np.maximum(flat[at], 0) - c * self.chunk_rows]

    def _load(self, group: np.ndarray) -> None:
        missing = [int(c) for c in group if int(c) not in self.chunks]
        rows = self.store.shape[0]
        reads = [(c, self.store[c * self.chunk_rows:min((c + 1) * self.chunk_rows, rows)].read()) for c in missing]
        for c in group:
            if int(c) in self.chunks:
                self.chunks.move_to_end(int(c))
        for c, future in reads:  # all reads were issued before the first wait
            try:
                rows = future.result()
            except ValueError as e:  # an unreadable chunk: `check` names it
                if self.check is None:
                    raise
                self.check(c, e)
            if self.check is not None:
                self.check(c, rows)
            self.chunks[c] = rows
            self.reads += 1
            while len(self.chunks) > self.max_chunks:
                self.chunks.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks.values())
