"""CRC-32 as 8 hex digits: the one checksum of stored bytes (an f-gram vocabulary's arrays, a bundle's files,
a table's chunks and block indexes), computed when they are written and checked when they are read.
zlib releases the GIL on large buffers, so threads check chunks in parallel."""
import zlib

import numpy as np


def crc32_hex(data) -> str:
    """CRC-32 of bytes, or of an array's bytes in memory order (what zarr and the table files store)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return f"{zlib.crc32(data):08x}"
