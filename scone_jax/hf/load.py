"""A Hugging Face checkpoint's tensors read from disk straight into a decoder's shardings.

`load_decoder(checkpoint, abstract)` takes the decoder's parameters as ShapeDtypeStructs carrying their shardings
(what training/state.py's StateSpec holds) and returns them as global jax.Arrays. Each parameter is made with
jax.make_array_from_callback in the checkpoint's own layout: JAX asks for the blocks this process's devices hold,
and the callback reads exactly those bytes (hf/safetensors.py read_into: one pread per contiguous range, straight
into a page-aligned buffer; for a scanned parameter, stacked [layers, ...], the block of every layer it covers);
a block several local devices share is read once. One jitted step per shape then transposes ([out, in] -> [in,
out]), converts to the parameter's dtype and moves the blocks into the target sharding, on the devices.

Which blocks a device reads (_read_sharding): on accelerators, contiguous row ranges, each process exactly its
share of every tensor, moved into the target's split by a collective in device memory; where the devices are the
host's CPUs, the target's own blocks, so nothing moves between devices (CPU collectives stage whole arrays in host
memory) at the price of column reads where the target splits columns.

A 70B checkpoint on a pod: every host runs this same call over the same files (local copies, or a file system
mounted on every host); with parameters sharded over `fsdp` (and `tensor`) each host reads 1/hosts of every tensor
and no host ever holds the whole model. Host memory: the blocks of one parameter in transit, freed before the next
is read (on CPU devices, where device buffers are host memory too, tests/test_hf_load_memory.py measures a rise of
about half a 471 MB checkpoint on each of four hosts holding a quarter of it). Reads bypass Python's per-byte
work, so the disk, not Python, bounds the speed (tools/bench_hf_load.py). `LoadReport.bytes_read` counts the
bytes this process read.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scone_jax.hf.checkpoint_dir import HfCheckpoint
from scone_jax.hf.families.base import BLOCKS, Part, Tensor


@dataclasses.dataclass
class LoadReport:
    bytes_read: int = 0  # bytes read from the checkpoint's files by this process
    seconds: float = 0.0
    read_seconds: float = 0.0  # of `seconds`, in reading the files (the rest: placing and converting on the devices)
    tensors: int = 0  # parameters made


def placement(checkpoint: HfCheckpoint) -> dict:
    """{our parameter path (a block's inside the block): (its Tensor, its Part)}."""
    return {part.path: (tensor, part) for tensor in checkpoint.tensors for part in tensor.parts}


def locate(path: tuple, where: dict) -> tuple[Tensor, Part, bool, int | None]:
    """(tensor, part, stacked, layer) of the decoder parameter at `path`: stacked for the scanned layout
    (('stack', 'blocks', ...) with a leading layers axis), layer for the unscanned one (('stack', 'blocks', i, ...)).
    KeyError naming the path when the family has no tensor for it."""
    if path[:2] == BLOCKS and len(path) > 2:
        if isinstance(path[2], int):
            tensor, part = where[path[3:]]
            return tensor, part, False, path[2]
        tensor, part = where[path[2:]]
        return tensor, part, True, None
    tensor, part = where[path]
    return tensor, part, False, None


def stored_block(tensor: Tensor, part: Part, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """The block of `tensor` (one layer's) holding `index`, a block of `part` in the tensor's own layout."""
    axis = tensor.axis % len(tensor.shape)
    return tuple(slice(s.start + (part.start if d == axis else 0), s.stop + (part.start if d == axis else 0))
                 for d, s in enumerate(_ranges(index, tensor.stored_shape(part))))


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` as plain [start, stop) slices over `shape` (missing dimensions whole)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _read_sharding(target: jax.sharding.NamedSharding, shape: tuple[int, ...], stacked: bool, transpose: bool,
                   by_rows: bool) -> jax.sharding.NamedSharding:
    """How the devices read a parameter in the checkpoint's layout.

    by_rows: its rows (the first dimension after a stacked layers axis) split over every mesh axis the target
    sharding uses, so each process reads contiguous byte ranges that add up to its share and nothing else; the
    jitted conversion (_to_ours) then moves the blocks into the target sharding with a collective among the
    devices (cheap over an accelerator's interconnect, done in device memory). Else, or when the rows do not divide
    that way: the target's own split in the checkpoint's layout, so no block moves between devices, at the price
    of reads along columns where the target splits them (each row's slice: more of the file is paged in)."""
    spec = tuple(target.spec) + (None,) * (len(shape) - len(target.spec))
    used = tuple(axis for entry in spec for axis in ((entry,) if isinstance(entry, str) else entry or ()))
    row = 1 if stacked else 0
    if by_rows and len(shape) > row and shape[row] % math.prod(target.mesh.shape[a] for a in used) == 0:
        read = [None] * len(shape)
        read[row] = used or None
    else:
        read = list(spec[:-2] + (spec[-1], spec[-2]) if transpose else spec)
    return jax.sharding.NamedSharding(target.mesh, jax.sharding.PartitionSpec(*read))


def _aligned_empty(shape: tuple[int, ...], dtype, alignment: int = 4096) -> np.ndarray:
    """An uninitialised array whose data starts on a page boundary: a CPU device adopts such a buffer as it is
    instead of copying it (jax.device_put aliases 64-byte-aligned host memory), so on a host whose devices are its
    CPUs a block is held once, not twice."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@functools.lru_cache(maxsize=64)
def _to_ours(transpose: bool, dtype, sharding: jax.sharding.NamedSharding):
    """jit(a parameter as read -> our layout, dtype and `sharding`): the transpose, the conversion and the move
    from the read's split to ours run on the devices (blocked, parallel; a collective where the splits differ),
    not in numpy on the host. One compile per shape."""
    def convert(x):
        return (jnp.swapaxes(x, -1, -2) if transpose else x).astype(dtype)

    return jax.jit(convert, out_shardings=sharding, donate_argnums=0)


def load_decoder(checkpoint: HfCheckpoint, abstract: nnx.State, *, by_rows: bool | None = None,
                 where: dict | None = None) -> tuple[nnx.State, LoadReport]:
    """`abstract` (the decoder's nnx.Param state as ShapeDtypeStructs with shardings, or any part of a state laid
    out like it: the f-gram model's, hf/fgram_source.py) filled from the checkpoint, every array created in its
    sharding from the blocks this process's devices hold. `by_rows`: how blocks are read (_read_sharding); None =
    by rows on accelerators, by the target's blocks where the devices are CPUs (their collectives would hold whole
    arrays in host memory). `where`: placement(checkpoint) unless given. ValueError naming a parameter the
    checkpoint has nothing for, or whose shape differs from the family's."""
    report, start = LoadReport(), time.time()
    where, layers = where or placement(checkpoint), checkpoint.model["num_layers"]
    out = []
    for path, variable in nnx.to_flat_state(abstract):
        spec = variable.get_value()
        try:
            tensor, part, stacked, layer = locate(path, where)
        except KeyError:
            raise ValueError(f"The {checkpoint.family.model_type} checkpoint {checkpoint.directory} has no tensor for "
                             f"the decoder's {'/'.join(map(str, path))}: the config's model section is not the "
                             "checkpoint's.") from None
        want = ((layers,) if stacked else ()) + tensor.part_shape(part)
        if tuple(spec.shape) != want:
            raise ValueError(f"The decoder's {'/'.join(map(str, path))} is {tuple(spec.shape)} but {tensor.name} gives "
                             f"{want}: the config's model section is not the checkpoint's.")
        shape = ((layers,) if stacked else ()) + tensor.stored_shape(part)
        dtype = checkpoint.files[checkpoint.names[tensor.name.format(i=0 if stacked else layer)]].info(
            checkpoint.names[tensor.name.format(i=0 if stacked else layer)]).dtype
        blocks: dict = {}

        def callback(index, tensor=tensor, part=part, stacked=stacked, layer=layer, shape=shape, dtype=dtype,
                     blocks=blocks):
            index = _ranges(index, shape)
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:  # devices that share a block (a replicated axis) read it once
                started = time.perf_counter()
                block = _aligned_empty(tuple(s.stop - s.start for s in index), dtype)
                if stacked:
                    for row, i in enumerate(range(index[0].start, index[0].stop)):
                        checkpoint.read_into(tensor, i, stored_block(tensor, part, index[1:]), block[row])
                else:
                    checkpoint.read_into(tensor, layer, stored_block(tensor, part, index), block)
                report.bytes_read += block.nbytes
                report.read_seconds += time.perf_counter() - started
                blocks[key] = block
            return blocks[key]

        if by_rows is None:
            by_rows = spec.sharding.mesh.devices.flat[0].platform != "cpu"
        read = _read_sharding(spec.sharding, shape, stacked, tensor.transpose, by_rows)
        stored = jax.make_array_from_callback(shape, read, callback)
        blocks.clear()
        if tensor.transpose or stored.dtype != spec.dtype or not read.is_equivalent_to(spec.sharding, len(shape)):
            stored = _to_ours(tensor.transpose, spec.dtype, spec.sharding)(stored)
        report.tensors += 1
        out.append((path, variable.replace(stored)))
    report.seconds = time.time() - start
    return nnx.from_flat_state(out), report


def expected_bytes(checkpoint: HfCheckpoint) -> int:
    """The bytes of every tensor the decoder reads (each once): a whole checkpoint's load, for a benchmark."""
    return sum(checkpoint.files[stored].tensors[stored].nbytes for stored in checkpoint.names.values())

