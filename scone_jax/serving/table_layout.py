"""Where each f-gram row lives in an export's table (bundle format 2), and the checksums that vouch for it.

    table/<c:09d>   chunk c: rows [c * chunk_rows, min((c + 1) * chunk_rows, S)), row-major, little-endian,
                    from byte 0; then the block index: the CRC-32 of each block of `block_rows` rows
                    (uint32, little-endian), in order

A row is read where it lies, with no lookup: chunk = row // chunk_rows, and its block starts at
(row % chunk_rows) // block_rows * block_rows * row_bytes. A block is at most 4 KiB of rows (one
row if a row is larger), so a random row costs one small read and one CRC of what was read. The
blocks' CRCs of every chunk, concatenated, are the index a disk-served table keeps in RAM: 4 bytes
per block, 1/1,024 of the table at 4 KiB blocks. COMPLETE records two CRCs per chunk: of its rows
(what a whole-table load checks, one pass per chunk) and of its block index (checked when the index
is read). Files of many rows keep a 1B-row table at thousands of files, not millions.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from scone_jax.runtime.crc import crc32_hex

BLOCK_BYTES = 4096  # the unit a disk reads at random (a page); a block of rows is at most this
CRC = np.dtype("<u4")


def block_rows_for(row_bytes: int, chunk_rows: int) -> int:
    """Rows per checksum block: the largest power of two that fits in BLOCK_BYTES (1 for a larger row)
    and divides chunk_rows, so blocks never straddle chunks."""
    rows = 1
    while rows * 2 * row_bytes <= BLOCK_BYTES and chunk_rows % (rows * 2) == 0:
        rows *= 2
    return rows


def block_crcs(rows: np.ndarray, block_rows: int) -> np.ndarray:
    """The CRC-32 of each block of `block_rows` rows of `rows` [n, d] (the last block may be short)."""
    data = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
    step = max(1, block_rows * rows.shape[1] * rows.dtype.itemsize)
    return np.fromiter((zlib.crc32(data[i:i + step]) for i in range(0, data.size, step)), CRC,
                       count=-(-data.size // step))


def check_ids(flat: np.ndarray, num_rows: int) -> None:
    """ValueError for an id past the table (ids < 0 mean no match and read as zero rows)."""
    if flat.size and flat.max() >= num_rows:
        raise ValueError(f"F-gram id {int(flat.max())} is outside the table's {num_rows} rows; the ids come "
                         "from another vocabulary than the table's.")


@dataclasses.dataclass(frozen=True)
class Layout:
    num_rows: int
    width: int
    dtype: np.dtype
    chunk_rows: int
    block_rows: int

    @classmethod
    def of_meta(cls, meta: dict, dtype: np.dtype) -> "Layout":
        return cls(meta["num_fgrams"], meta["d_model"], np.dtype(dtype), meta["chunk_rows"], meta["block_rows"])

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def num_chunks(self) -> int:
        return -(-self.num_rows // self.chunk_rows)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_rows // self.block_rows

    def rows_of_chunk(self, c: int) -> tuple[int, int]:
        return c * self.chunk_rows, min((c + 1) * self.chunk_rows, self.num_rows)

    def rows_of_block(self, b: int) -> tuple[int, int]:
        return b * self.block_rows, min((b + 1) * self.block_rows, self.num_rows)

    def rows_bytes(self, c: int) -> int:
        """Bytes of chunk c's rows, where its block index starts."""
        lo, hi = self.rows_of_chunk(c)
        return (hi - lo) * self.row_bytes

    def index_bytes(self, c: int) -> int:
        lo, hi = self.rows_of_chunk(c)
        return -(-(hi - lo) // self.block_rows) * CRC.itemsize

    def file_bytes(self, c: int) -> int:
        return self.rows_bytes(c) + self.index_bytes(c)

    def block_span(self, b: int) -> tuple[int, int, int]:
        """(chunk, byte offset in its file, bytes) of block b."""
        c = b // self.blocks_per_chunk
        lo, hi = self.rows_of_block(b)
        return c, (lo - c * self.chunk_rows) * self.row_bytes, (hi - lo) * self.row_bytes

    def encode(self, rows: np.ndarray) -> tuple[bytes, str, str]:
        """A chunk's file and the CRCs of its rows and of its block index, computed from the rows in memory:
        what readers check is what the f-gram model computed. (Hosts are little-endian, like the file.)"""
        data = np.ascontiguousarray(rows, self.dtype).reshape(-1).view(np.uint8)
        index = block_crcs(rows, self.block_rows).tobytes()
        return b"".join((data, index)), crc32_hex(data), crc32_hex(index)

    def block_damage(self, b: int, have: str, want: int, more: int = 0) -> str:
        """The state of a chunk whose block b hashes to `have`, its block index recording `want`: names the rows."""
        lo, hi = self.rows_of_block(b)
        others = f" ({more} more damaged blocks in this file)" if more else ""
        return f"is damaged: table rows {lo}..{hi - 1} hash to {have}, its block index records {want:08x}{others}"
