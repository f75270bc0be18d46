"""A table served from disk: rows read where they lie, at the disk's speed, for tables larger than host RAM.

The paper's second store (docs/method.md §6: rows on NVMe). A batch's distinct blocks (table_layout.py:
at most 4 KiB of rows each) are read once, tens of reads in flight (serving/table_files.py), bypassing
the page cache; each block is checked against the block index kept in RAM (4 bytes per
block, itself checked against COMPLETE at open), so a damaged block is a BundleError naming its rows,
never wrong rows. What RAM the budget leaves after the index holds the table's head: rows are in rank
order (the most frequent f-grams first), so rows 0..H-1 answer a share of lookups far above H / S
without a read (docs/serving.md measures it). Evaluation reads batch i+1's rows while the device runs
batch i (runtime/prefetch.py); decoding cannot know the next row ahead, so there one read's latency
is what a token pays.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from scone_jax.serving import bundle
from scone_jax.serving.table_files import TableFiles
from scone_jax.runtime.crc import crc32_hex
from scone_jax.serving.table_layout import CRC, Layout, block_crcs, check_ids


class DiskTable:
    """Rows [S, d] of an export read from its files on demand; `gather(ids)` -> [*ids.shape, d], zero rows
    where ids < 0. `max_bytes` (0/None: no limit, and no head kept) bounds the RAM of index and head."""

    in_ram = False

    def __init__(self, path: str, layout: Layout, index_crcs: list[str], *, max_bytes: int | None,
                 threads: int = 64, direct: bool = True):
        """The table files of the bundle at `path`, laid out as `layout`, whose block indexes hash to
        `index_crcs` (what COMPLETE records, one per file)."""
        self.path, self.layout = path, layout
        self.num_rows, self.width, self.dtype = layout.num_rows, layout.width, layout.dtype
        self.nbytes = layout.nbytes
        index_bytes = layout.num_blocks * CRC.itemsize
        if max_bytes and max_bytes < index_bytes:
            raise ValueError(f"--max_table_bytes={max_bytes:,} is less than the {index_bytes:,} bytes the block index of "
                             f"{path}'s table ({layout.num_blocks:,} blocks) must keep in RAM to serve rows from disk. "
                             f"Fix: raise --max_table_bytes to at least {index_bytes:,} (or 0: no limit).")
        self.files = TableFiles.open(path, layout, threads=threads)
        try:
            if self.files.problems:
                raise bundle.bad_table_error(path, layout, self.files.problems)
            self.index = self._read_index(index_crcs)
            head = 0 if not max_bytes else (max_bytes - index_bytes) // layout.row_bytes
            self.head = self._read_head(min(layout.num_rows, head // layout.block_rows * layout.block_rows))
            if direct:
                self.files.start_direct()
        except BaseException:
            self.files.close()
            raise
        self.head_rows = len(self.head)
        self.rows_from_head = self.rows_from_disk = self.blocks_read = 0
        self.read_seconds = 0.0  # in gather's disk reads
        self._lock = threading.Lock()

    @property
    def direct(self) -> bool:
        """Whether block reads bypass the page cache (O_DIRECT, kernel AIO)."""
        return self.files.direct

    def _read_index(self, index_crcs: list[str]) -> np.ndarray:
        """Every file's block index, concatenated (block b's CRC at [b]), each checked against COMPLETE."""
        layout = self.layout
        index = np.empty(layout.num_blocks, CRC)
        per = layout.blocks_per_chunk

        def slot(c):
            return index[c * per:c * per + layout.index_bytes(c) // CRC.itemsize].view(np.uint8)

        try:
            self.files.read_all((c, layout.rows_bytes(c), slot(c)) for c in range(layout.num_chunks))
        except OSError as e:
            raise bundle.BundleError(f"Reading the table's block index at {self.path!r} failed: {e}. Fix: try again; "
                                     "if it persists, export again into a fresh --output.") from None
        bad = {c: f"has a damaged block index: it hashes to {have}, {bundle.COMPLETE} records {index_crcs[c]}"
               for c in range(layout.num_chunks) if (have := crc32_hex(slot(c))) != index_crcs[c]}
        if bad:
            raise bundle.bad_table_error(self.path, layout, bad)
        return index

    def _read_head(self, rows: int) -> np.ndarray:
        """Rows 0..rows-1 (whole blocks), read in large pieces and checked block by block."""
        layout = self.layout
        head = np.empty((rows, layout.width), layout.dtype)
        flat = head.reshape(-1).view(np.uint8)
        jobs = []
        for c in range(-(-rows // layout.chunk_rows)):
            lo, hi = layout.rows_of_chunk(c)
            hi = min(hi, rows)
            jobs.append((c, 0, flat[lo * layout.row_bytes:hi * layout.row_bytes]))
        try:
            self.files.read_all(jobs)
        except OSError as e:
            raise bundle.BundleError(f"Reading the table at {self.path!r} failed: {e}. Fix: try again; if it "
                                     "persists, export again into a fresh --output.") from None
        found = block_crcs(head, layout.block_rows)
        bad = np.flatnonzero(found != self.index[:len(found)])
        if len(bad):
            self._raise_damaged({int(b): f"{found[b]:08x}" for b in bad})
        return head

    def gather(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        flat = ids.reshape(-1)
        check_ids(flat, self.num_rows)
        far = flat >= self.head_rows
        every = flat.size > 0 and bool(far.all())  # all rows from disk: the gather from the reads is the output
        out = None
        if not every:
            out = np.empty((flat.size, self.width), self.dtype)
            out[flat < 0] = 0
            near = (flat >= 0) & ~far
            out[near] = self.head[flat[near]]
            self.rows_from_head += int(near.sum())
        rows = flat if every else flat[far]
        if rows.size:
            blocks, inverse = np.unique(rows // self.layout.block_rows, return_inverse=True)
            at = inverse * self.layout.block_rows + rows % self.layout.block_rows
            with self._lock:  # the staged rows live in the reader's buffer until the next batch's read
                staged = self._read_blocks(blocks)
                if every:
                    out = staged[at]  # (indexing copies at twice the speed of np.take into an array)
                else:
                    out[far] = staged[at]
            self.rows_from_disk += len(rows)
        return out.reshape(*ids.shape, self.width)

    def _read_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """The rows of `blocks` (sorted, distinct), read and checked: [len(blocks) * block_rows, d], valid until the
        next call (the caller holds self._lock)."""
        layout = self.layout
        per, block_bytes = layout.blocks_per_chunk, layout.block_rows * layout.row_bytes
        chunks = blocks // per
        offsets = (blocks - chunks * per) * block_bytes
        lengths = (np.minimum((blocks + 1) * layout.block_rows, self.num_rows) - blocks * layout.block_rows
                   ) * layout.row_bytes
        start = time.perf_counter()
        staged, bad = self.files.read_blocks(chunks, offsets, lengths, self.index[blocks])
        self.read_seconds += time.perf_counter() - start
        self.blocks_read += len(blocks)
        if bad:
            self._raise_damaged({int(blocks[i]): what for i, what in bad.items()})
        return staged.view(self.dtype).reshape(len(blocks) * layout.block_rows, self.width)

    def _raise_damaged(self, bad: dict[int, str]):
        """BundleError for blocks that failed (block -> the CRC read, or why it could not be read)."""
        by_chunk: dict[int, list[int]] = {}
        for b in sorted(bad):
            by_chunk.setdefault(b // self.layout.blocks_per_chunk, []).append(b)
        states = {}
        for c, blocks in by_chunk.items():
            what = bad[blocks[0]]
            states[c] = (what if what.startswith("cannot") else
                         self.layout.block_damage(blocks[0], what, int(self.index[blocks[0]]), len(blocks) - 1))
        raise bundle.bad_table_error(self.path, self.layout, states)

    def close(self):
        self.files.close()
