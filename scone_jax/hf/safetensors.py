"""safetensors files read and written with numpy alone (no torch, no safetensors library at run time).

The format: an 8-byte little-endian header length n, n bytes of JSON {name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}, then the tensors' raw little-endian bytes, offsets counted from the end
of the header. bfloat16 (and the 8-bit floats) come from ml_dtypes, which JAX depends on.

`SafetensorsFile` checks the whole header before it allocates anything: its length within the file, JSON of the
right form, known dtypes, shape x itemsize == each byte span, spans in order from 0 without gaps or overlap, and the
last span ending where the file ends. A truncated or corrupted file is one SafetensorsError line naming the file
(and the tensor). `read(name, index)` reads one block of a tensor (a range of rows, then of columns) from disk and
nothing else: whole rows with one pread, a column range through a memory map that touches only those pages.

`write_file` writes tensors one at a time, in the order given, into a temporary file renamed into place at the end
(readers never see half a file); `write_sharded` splits them over files of at most `max_shard_bytes` with the
`model.safetensors.index.json` that Hugging Face reads.
"""
from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A tensor file being written: `.safetensors-<pid>-<random>.tmp` beside it, renamed to its name when complete (an
# exporter removes such files a killed write left).
TEMPORARY_PREFIX, TEMPORARY_SUFFIX = ".safetensors-", ".tmp"
_FIX = "Fix: copy the file again from its source (it is truncated or damaged)."


class SafetensorsError(ValueError):
    """A safetensors file that is not one, or a read outside what it holds; the message is one line."""


class TensorInfo:
    """One tensor's entry in a header: numpy dtype, shape, absolute byte offset in the file and byte size."""

    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")

    def __init__(self, name: str, dtype: np.dtype, shape: tuple[int, ...], offset: int, nbytes: int):
        self.name, self.dtype, self.shape, self.offset, self.nbytes = name, dtype, shape, offset, nbytes

    @property
    def dtype_name(self) -> str:
        return NAMES[self.dtype]


class SafetensorsFile:
    """An opened, checked safetensors file; `read` reads blocks of its tensors."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    self._fail(f"is {size} bytes long, shorter than the 8-byte header length")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    self._fail(f"declares a {n}-byte header but the file has {size} bytes")
                raw = f.read(n)
        except OSError as e:
            raise SafetensorsError(f"{path} cannot be read: {e.strerror or e}. Fix: check the path and its "
                                   "permissions.") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            self._fail("has a header that is not JSON")
        if not isinstance(header, dict):
            self._fail("has a header that is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            self._fail("has a __metadata__ entry that is not a map of strings")
        self.metadata = metadata
        self.tensors = {name: self._entry(name, spec, 8 + n) for name, spec in header.items()}
        end = 0
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            if info.offset - 8 - n != end:
                self._fail(f"tensor {info.name} starts at byte {info.offset - 8 - n} of the data, expected {end} "
                           "(spans must follow each other without gaps or overlap)")
            end += info.nbytes
        if 8 + n + end != size:
            self._fail(f"holds {size - 8 - n} bytes of data but its header accounts for {end}")

    def _fail(self, problem: str):
        raise SafetensorsError(f"{self.path} {problem}: not a valid safetensors file. {_FIX}")

    def _entry(self, name: str, spec, data_start: int) -> TensorInfo:
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            self._fail(f"has a malformed header entry for tensor {name}")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in DTYPES:
            self._fail(f"gives tensor {name} the unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            self._fail(f"gives tensor {name} the shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            self._fail(f"gives tensor {name} the byte span {offsets!r}")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            self._fail(f"gives tensor {name} ({dtype} {shape}: {nbytes} bytes) a span of {offsets[1] - offsets[0]} "
                       "bytes")
        return TensorInfo(name, DTYPES[dtype], tuple(shape), data_start + offsets[0], nbytes)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise SafetensorsError(f"{self.path} has no tensor {name}.")
        return self.tensors[name]

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """The block `index` (slices with step 1, one per leading dimension; missing ones are whole) of tensor
        `name`, read from disk into a new array (read_into's reads)."""
        info = self.info(name)
        out = np.empty(tuple(b - a for a, b in _block(info, index, self.path)), info.dtype)
        self.read_into(name, index, out)
        return out

    def read_into(self, name: str, index: tuple, out: np.ndarray) -> None:
        """Fill `out` (C-contiguous, the block's shape and the tensor's dtype) with the block `index` of tensor
        `name`, read from disk and nothing else: a contiguous range of rows with one pread straight into `out`, a
        column range of them through a memory map (only the pages of those columns are read)."""
        info = self.info(name)
        block = _block(info, index, self.path)
        shape = tuple(b - a for a, b in block)
        if out.shape != shape or out.dtype != info.dtype or not out.flags.c_contiguous:
            raise ValueError(f"read_into {name} {index}: out is {out.dtype} {out.shape}, the block {info.dtype} {shape}.")
        if math.prod(shape) == 0:
            return
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        rows_whole = all(b - a == d for (a, b), d in zip(block[1:], info.shape[1:]))
        if not info.shape or rows_whole:  # one contiguous byte range
            start = info.offset + (block[0][0] * row_bytes if info.shape else 0)
            view, got = memoryview(out.reshape(-1).view(np.uint8)), 0
            with open(self.path, "rb") as f:
                while got < out.nbytes:  # one read returns at most ~2 GiB on Linux
                    n = os.preadv(f.fileno(), [view[got:]], start + got)
                    if n == 0:
                        raise SafetensorsError(f"{self.path} ended while reading tensor {name}: it was truncated "
                                               f"after it was opened. {_FIX}")
                    got += n
            return
        mapped = np.memmap(self.path, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)
        try:
            out[...] = mapped[tuple(slice(a, b) for a, b in block)]
        finally:
            del mapped


def _block(info: TensorInfo, index: tuple, path: str) -> list[tuple[int, int]]:
    """[(start, stop)] per dimension of `index` over `info.shape`; SafetensorsError for steps or overruns."""
    if len(index) > len(info.shape):
        raise SafetensorsError(f"{path}: index {index} has more dimensions than tensor {info.name} {info.shape}.")
    out = []
    for dim, size in enumerate(info.shape):
        s = index[dim] if dim < len(index) else slice(None)
        start, stop, step = s.indices(size)
        if step != 1 or (s.stop is not None and s.stop > size) or stop < start:
            raise SafetensorsError(f"{path}: block {index} is not a range inside tensor {info.name} {info.shape}.")
        out.append((start, stop))
    return out


def header_bytes(specs: Iterable[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict | None = None) -> bytes:
    """The length prefix and JSON header for tensors (name, dtype, shape) laid out in the order given, padded with
    spaces to a multiple of 8 bytes (as the safetensors library pads it)."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_file(path: str, specs: list[tuple[str, np.dtype, tuple[int, ...]]], produce: Callable[[str], np.ndarray],
               metadata: dict | None = None) -> int:
    """Write the tensors `specs` (name, dtype, shape) to `path`, each produced by `produce(name)` only when it is
    written (one in memory at a time), into a temporary file renamed to `path` at the end. Returns the bytes of
    tensor data. ValueError if a produced array's shape or dtype differs from its spec."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f"{TEMPORARY_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's mode, as its neighbours get
    total = 0
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header_bytes(specs, metadata))
            for name, dtype, shape in specs:
                array = np.asarray(produce(name))
                if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                    raise ValueError(f"tensor {name} was produced as {array.dtype} {array.shape}, but its header "
                                     f"says {np.dtype(dtype)} {tuple(shape)}.")
                data = np.ascontiguousarray(array).tobytes()  # these hosts are little-endian, as the format is
                f.write(data)
                total += len(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return total


def write_sharded(directory: str, specs: list[tuple[str, np.dtype, tuple[int, ...]]],
                  produce: Callable[[str], np.ndarray], max_shard_bytes: int,
                  metadata: dict | None = None) -> list[str]:
    """`specs` written into `directory` as model.safetensors, or, when their data exceeds `max_shard_bytes`, as
    model-0000K-of-0000N.safetensors files of at most that much (a larger tensor gets a file of its own) plus
    model.safetensors.index.json mapping each tensor to its file. Returns the file names written."""
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for _, dtype, shape in specs]
    if sum(sizes) <= max_shard_bytes:
        write_file(os.path.join(directory, SINGLE), specs, produce, metadata)
        return [SINGLE]
    groups, current, current_bytes = [], [], 0
    for spec, size in zip(specs, sizes):
        if current and current_bytes + size > max_shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += size
    groups.append(current)
    names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    for name, group in zip(names, groups):
        write_file(os.path.join(directory, name), group, produce, metadata)
    index = {"metadata": {"total_size": sum(sizes)},
             "weight_map": {spec[0]: name for name, group in zip(names, groups) for spec in group}}
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return [*names, INDEX]
