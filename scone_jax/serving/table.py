"""The f-gram table on the host: the rows each batch needs, from RAM or from disk (docs/method.md §6).

At inference the accelerator holds only the main model (§7); each batch's f-gram rows come from the
host, from one of two stores, as in the paper:
  ram   HostTable: the table read whole into one numpy array (its files read in parallel, each checked
        against the CRC of its rows that COMPLETE records); gathers split large batches over threads
        (numpy releases the GIL in `take`).
  disk  DiskTable (serving/disk_table.py): each row read where it lies, tens of reads in flight, each
        block checked; for a table larger than host RAM, at the disk's speed.
`open_table(bundle, table="auto")` picks RAM when the table fits `max_bytes` (0 or None: no limit), else disk.
The tables hold rows only: what the export records about them (layout, checksums) comes from the opened
bundle (serving/bundle.py), which the caller keeps.
runtime/prefetch.py gathers the rows of batch i+1 while the device computes batch i.
"""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np
from absl import logging

from scone_jax.serving import bundle
from scone_jax.serving.disk_table import DiskTable
from scone_jax.serving.table_files import TableFiles
from scone_jax.runtime.crc import crc32_hex
from scone_jax.serving.table_layout import CRC, Layout, block_crcs, check_ids

TABLE_MODES = ("ram", "disk", "auto")
_THREAD_MIN_ROWS = 1 << 14  # below this a single take is faster than handing work to threads
_FEW_ROWS = 64  # up to this many ids (decoding), indexing with a Python list beats the general path


class HostTable:
    """Rows [S, d] of an export in RAM; `gather(ids)` -> [*ids.shape, d], zero rows where ids < 0."""

    in_ram = True

    def __init__(self, rows: np.ndarray, *, threads: int = 4):
        self._rows = rows
        self.num_rows, self.width = rows.shape
        self.dtype = rows.dtype
        self.nbytes = rows.nbytes
        self._pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
        self._threads = threads
        self.read_seconds = self.verify_seconds = 0.0  # loading, and checking the rows' CRCs

    def gather(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        flat = ids.reshape(-1)
        if flat.size <= _FEW_ROWS and self.num_rows:  # decoding: skip the ~10 numpy calls below
            few = flat.tolist()
            if few and max(few) >= self.num_rows:
                check_ids(flat, self.num_rows)
            out = self._rows[[max(i, 0) for i in few]]
            if few and min(few) < 0:
                out[flat < 0] = 0
            return out.reshape(*ids.shape, self.width)
        check_ids(flat, self.num_rows)
        out = np.zeros((flat.size, self.width), self.dtype)
        if not self.num_rows:  # a decoder-only bundle (no f-grams): nothing ever matches
            return out.reshape(*ids.shape, self.width)
        if self._pool is None or flat.size < _THREAD_MIN_ROWS:
            np.take(self._rows, np.maximum(flat, 0), axis=0, out=out)
        else:
            bounds = np.linspace(0, flat.size, self._threads + 1).astype(int)
            parts = [self._pool.submit(np.take, self._rows, np.maximum(flat[a:b], 0), 0, out[a:b])
                     for a, b in zip(bounds[:-1], bounds[1:])]
            for p in parts:
                p.result()
        out[flat < 0] = 0
        return out.reshape(*ids.shape, self.width)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()


def open_table(source: bundle.Bundle, *, table: str = "auto", max_bytes: int | None = None, threads: int = 4,
               io_threads: int = 64) -> HostTable | DiskTable:
    """The table of the opened bundle `source`, in RAM or served from disk (module docstring). `max_bytes`:
    host RAM the table may take (0 or None: no limit); `io_threads`: reads in flight from disk."""
    if table not in TABLE_MODES:
        raise ValueError(f"--table={table!r} is not one of {', '.join(TABLE_MODES)}.")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"--max_table_bytes={max_bytes:,} is negative. Fix: the host RAM the table may take, in "
                         "bytes, or 0 for no limit.")
    layout = source.layout
    fits = not max_bytes or layout.nbytes <= max_bytes
    mode = ("ram" if fits else "disk") if table == "auto" else table
    if mode == "disk" and layout.num_rows == 0:
        logging.warning("Note: --table=disk, but the export at %s has no f-gram table (a run without SCONE); "
                        "nothing is read from disk.", source.path)
        mode = "ram"
    if mode == "disk":
        return DiskTable(source.path, layout, source.checksums.table_index, max_bytes=max_bytes, threads=io_threads)
    if not fits:
        raise ValueError(f"--table=ram: the table of {source.path} is {layout.nbytes:,} bytes, more than "
                         f"--max_table_bytes={max_bytes:,}. Fix: --table=disk (or auto) to serve it from disk, or "
                         "raise --max_table_bytes.")
    return _load(source.path, layout, source.checksums, threads)


def _load(path: str, layout: Layout, sums: bundle.Checksums, threads: int) -> HostTable:
    """Every file's rows read into one array, then each file's rows checked against COMPLETE, in parallel. The
    files are opened, and their sizes checked, before the array is allocated."""
    files = TableFiles.open(path, layout, threads=max(threads, 16))
    try:
        if files.problems:
            raise bundle.bad_table_error(path, layout, files.problems)
        try:
            rows = np.empty((layout.num_rows, layout.width), layout.dtype)
        except MemoryError:
            raise ValueError(f"The table of {path} is {layout.nbytes:,} bytes, more than this host can allocate. Fix: "
                             "--table=disk (or auto with --max_table_bytes) to serve it from disk.") from None
        flat = rows.reshape(-1).view(np.uint8)
        chunks = range(layout.num_chunks)

        def rows_of(c):
            lo, hi = layout.rows_of_chunk(c)
            return flat[lo * layout.row_bytes:hi * layout.row_bytes]

        start = time.perf_counter()
        try:
            files.read_all((c, 0, rows_of(c)) for c in chunks)
        except OSError as e:
            raise bundle.BundleError(f"Reading the table at {path!r} failed: {e}. Fix: try again; if it persists, "
                                     "export again into a fresh --output.") from None
        read_seconds = time.perf_counter() - start
        start = time.perf_counter()
        have = list(files.pool.map(lambda c: crc32_hex(rows_of(c)), chunks))
        verify_seconds = time.perf_counter() - start
        bad = {c: _damage(files, layout, sums, c, h, rows) for c, h in zip(chunks, have) if h != sums.table[c]}
        if bad:
            raise bundle.bad_table_error(path, layout, bad)
    finally:
        files.close()
    table = HostTable(rows, threads=threads)
    table.read_seconds, table.verify_seconds = read_seconds, verify_seconds
    return table


def _damage(files: TableFiles, layout: Layout, sums: bundle.Checksums, c: int, have: str, rows: np.ndarray) -> str:
    """What is wrong with chunk c, whose rows hash to `have`: its damaged rows, found with its block index."""
    state = f"is damaged: its rows hash to {have}, {bundle.COMPLETE} records {sums.table[c]}"
    try:
        index = files.read(c, layout.rows_bytes(c), layout.index_bytes(c))
    except OSError:
        return state
    if crc32_hex(index) != sums.table_index[c]:
        return state + ", and its block index is damaged too"
    lo, hi = layout.rows_of_chunk(c)
    found = block_crcs(rows[lo:hi], layout.block_rows)
    want = index.view(CRC)
    bad = np.flatnonzero(found != want)
    if not len(bad):
        return state
    first = c * layout.blocks_per_chunk + int(bad[0])
    return layout.block_damage(first, f"{found[bad[0]]:08x}", int(want[bad[0]]), len(bad) - 1)
