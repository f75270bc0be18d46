"""A Hugging Face checkpoint's tensors read from disk straight into a decoder's shardings.

`load_decoder(checkpoint, abstract)` takes the decoder's parameters as ShapeDtypeStructs carrying their shardings
(what training/state.py's StateSpec holds) and returns them as global jax.Arrays, each made with
jax.make_array_from_callback: JAX asks for the blocks that this process's devices hold, and the callback reads
exactly those from the safetensors files (hf/safetensors.py: a range of rows, then columns, from disk; for a
scanned parameter, stacked [layers, ...], that block of every layer the index covers), transposes what the family
says ([out, in] -> [in, out]), and converts to the parameter's dtype. A block that several local devices share (a
replicated axis) is read once. Parameters are made one at a time, so besides the device buffers a host holds at
most one parameter's local blocks.

A 70B checkpoint on a pod: every host runs this same call; with parameters sharded over `fsdp` (and `tensor`) each
host's devices hold 1/hosts of every weight matrix, so each host reads only that fraction of every tensor from its
own copy of the files (local disk, or a shared file system mounted on every host), and no host ever holds the whole
model: its peak is its device share plus one parameter's local blocks. Reads are plain preads and page-cache
backed memory maps, so a host's disk (not Python) bounds the speed. `LoadReport.bytes_read` counts the bytes this
process read (what a benchmark compares with the disk's rate).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from scone_jax.hf.checkpoint_dir import HfCheckpoint
from scone_jax.hf.families.base import BLOCKS, Part, Tensor


@dataclasses.dataclass
class LoadReport:
    bytes_read: int = 0  # bytes read from the checkpoint's files by this process
    seconds: float = 0.0
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


def read_block(checkpoint: HfCheckpoint, tensor: Tensor, part: Part, layer: int | None, ours: tuple[slice, ...],
               dtype) -> tuple[np.ndarray, int]:
    """Our block `ours` (slices of one layer's parameter) read from the tensor, in our layout and `dtype`; and the
    bytes read."""
    raw = checkpoint.read(tensor, layer, tensor.hf_block(part, ours))
    block = raw.T if tensor.transpose else raw
    return np.ascontiguousarray(block.astype(dtype, copy=False)), raw.nbytes


def load_decoder(checkpoint: HfCheckpoint, abstract: nnx.State) -> tuple[nnx.State, LoadReport]:
    """`abstract` (the decoder's nnx.Param state as ShapeDtypeStructs with shardings) filled from the checkpoint,
    every array created in its sharding from the blocks this process's devices hold. ValueError naming a parameter
    the checkpoint has nothing for, or whose shape differs from the family's."""
    report, start = LoadReport(), time.time()
    where, layers = placement(checkpoint), checkpoint.model["num_layers"]
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
        blocks: dict = {}

        def callback(index, tensor=tensor, part=part, stacked=stacked, layer=layer, dtype=spec.dtype, blocks=blocks):
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:
                if stacked:
                    rows = range(*index[0].indices(layers))
                    read = [read_block(checkpoint, tensor, part, i, index[1:], dtype) for i in rows]
                    blocks[key] = np.stack([r[0] for r in read]) if read else np.empty(
                        (0, *(len(range(*s.indices(n))) for s, n in zip(index[1:], want[1:]))), dtype)
                    report.bytes_read += sum(r[1] for r in read)
                else:
                    blocks[key], nbytes = read_block(checkpoint, tensor, part, layer, index, dtype)
                    report.bytes_read += nbytes
            return blocks[key]

        array = jax.make_array_from_callback(tuple(spec.shape), spec.sharding, callback)
        blocks.clear()
        report.tensors += 1
        out.append((path, variable.replace(array)))
    report.seconds = time.time() - start
    return nnx.from_flat_state(out), report


def expected_bytes(checkpoint: HfCheckpoint) -> int:
    """The bytes of every tensor the decoder reads (each once): a whole checkpoint's load, for a benchmark."""
    return sum(checkpoint.files[stored].tensors[stored].nbytes for stored in checkpoint.names.values())

