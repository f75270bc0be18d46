"""The f-gram table on the host: load it, gather rows for a batch, and feed them to the device ahead.

At inference the accelerator holds only the main model (SCONE.md rule 6); each batch's f-gram rows
come from host memory. A table that fits the memory budget is read whole into one numpy array
(tensorstore reads chunks in parallel); a larger one is served from a bounded LRU cache of table
chunks read on demand, from local disk or GCS alike. Gathers split large batches over threads
(numpy releases the GIL in `take`), and `Prefetcher` prepares and transfers batch i+1 while the
device computes batch i.
"""
from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import tensorstore as ts

from scone_jax import bundle

_THREAD_MIN_ROWS = 1 << 14  # below this a single take is faster than handing work to threads
_FEW_ROWS = 64  # up to this many ids (decoding), indexing with a Python list beats the general path


class HostTable:
    """Rows [S, d] of an export; `gather(ids)` -> [*ids.shape, d], zero rows where ids < 0."""

    def __init__(self, store: ts.TensorStore, meta: dict, *, max_bytes: int | None = None, threads: int = 4):
        self.meta = meta
        self.num_rows, self.width = meta["num_fgrams"], meta["d_model"]
        self.dtype = bundle.numpy_dtype(meta["dtype"])
        self.nbytes = self.num_rows * self.width * self.dtype.itemsize
        self._pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
        self._threads = threads
        if max_bytes is None or self.nbytes <= max_bytes:
            self._rows = store.read().result()
            self._cache = None
        else:
            self._rows = None
            self._cache = ChunkCache(store, meta["chunk_rows"], max_bytes)

    @classmethod
    def open(cls, path: str, *, expect: dict | None = None, max_bytes: int | None = None, threads: int = 4):
        """Load the table of a finished export; `expect` holds fingerprints it must carry."""
        meta = bundle.open_complete(path, expect)
        store = ts.open(bundle.table_spec(path), open=True).result()
        bundle.check_table(meta, store, path)
        return cls(store, meta, max_bytes=max_bytes, threads=threads)

    @property
    def in_ram(self) -> bool:
        return self._rows is not None

    def gather(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        flat = ids.reshape(-1)
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
    """At most `max_bytes` of table chunks in RAM, least recently used evicted first."""

    def __init__(self, store: ts.TensorStore, chunk_rows: int, max_bytes: int):
        self.store, self.chunk_rows = store, chunk_rows
        chunk_bytes = chunk_rows * store.shape[1] * store.dtype.numpy_dtype.itemsize
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
            self.chunks[c] = future.result()
            self.reads += 1
            while len(self.chunks) > self.max_chunks:
                self.chunks.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks.values())


class Prefetcher:
    """Iterates `prepare(item)` over `items`, computed `depth` items ahead on a background thread.

    `prepare` does the host work and starts the device transfer (jax.device_put is asynchronous),
    so the next batch's rows travel while the device runs the current step."""

    _END = object()

    def __init__(self, items: Iterable, prepare: Callable, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iter(items), prepare), daemon=True)
        self._thread.start()

    def _fill(self, items: Iterator, prepare: Callable):
        try:
            for item in items:
                if self._stop.is_set():
                    return
                self._queue.put(("item", prepare(item)))
        except BaseException as e:  # re-raised in the consumer's thread
            self._queue.put(("error", e))
            return
        self._queue.put(("end", self._END))

    def __iter__(self):
        while True:
            kind, value = self._queue.get()
            if kind == "error":
                raise value
            if kind == "end":
                return
            yield value

    def close(self):
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
