"""One process of tests/test_hf_load_memory.py: load a Hugging Face checkpoint into a mesh that spans every
process, sampling this process's resident memory while it loads.

    python -m tests.hf_load_worker PORT PROCESS_ID NUM_PROCESSES CHECKPOINT_DIR OUT_DIR SCANNED

Writes OUT_DIR/<process id>.json: the peak rise of resident memory over the load (bytes, sampled every
millisecond from /proc/self/statm), the bytes this process read, and whether the blocks it holds (of the top-level
parameters and of the first and last layer) equal the checkpoint's values. SCANNED: 1 = the stacked block layout.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx

from scone_jax import sharding
from scone_jax.config import base_config
from scone_jax.hf import load
from scone_jax.hf.checkpoint_dir import HfCheckpoint
from scone_jax.model.transformer import Decoder
from scone_jax.runtime import distributed


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler(threading.Thread):
    """The highest resident memory seen while it runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = resident_bytes(), True

    def run(self):
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, resident_bytes())


def main(port: str, process_id: str, num_processes: str, checkpoint_dir: str, out_dir: str, scanned: str) -> None:
    distributed.initialize(distributed.JoinSpec(f"127.0.0.1:{port}", int(num_processes), int(process_id), 60))
    checkpoint = HfCheckpoint.open(checkpoint_dir)
    config = base_config()
    config.model.update(checkpoint.model)
    config.model.scan_layers = scanned == "1"
    config.mesh.update(dict(data=1, fsdp=-1, tensor=1))  # every weight matrix split over all devices of all hosts
    mesh = sharding.make_mesh(config.mesh)
    abstract = nnx.eval_shape(lambda: nnx.state(Decoder(config.model, nnx.Rngs(0)), nnx.Param))
    target = sharding.sharded_abstract(abstract, sharding.state_shardings(abstract, mesh))
    before = resident_bytes()
    sampler = PeakSampler()
    sampler.start()
    params, report = load.load_decoder(checkpoint, target)
    jax.block_until_ready(jax.tree.leaves(params))
    peak = sampler.stop()
    last = checkpoint.model["num_layers"] - 1
    exact = all(np.array_equal(np.asarray(shard.data), expected(checkpoint, path, shard.index))
                for path, variable in nnx.to_flat_state(params) if not isinstance(path[2:3], int) or path[2] in (0, last)
                for shard in variable.get_value().addressable_shards)  # the top-level ones, the first and last layer
    with open(os.path.join(out_dir, f"{process_id}.json"), "w") as f:
        json.dump({"peak_rise": peak - before, "bytes_read": report.bytes_read, "exact": exact,
                   "devices": jax.device_count(), "local_devices": jax.local_device_count()}, f)


def expected(checkpoint: HfCheckpoint, path: tuple, index: tuple) -> np.ndarray:
    """The values a device's block `index` of our parameter `path` must hold, read from the checkpoint whole (the
    plain way: the tensor, transposed into our layout, stacked over layers for a block parameter)."""
    tensor, part, stacked, layer = load.locate(path, load.placement(checkpoint))
    def ours(i):
        name = checkpoint.names[tensor.name.format(i=i)]
        whole = checkpoint.files[name].read(name).astype(np.float32)
        axis = tensor.axis % whole.ndim
        whole = np.take(whole, np.arange(part.start, part.stop), axis=axis)
        return whole.T if tensor.transpose else whole
    value = np.stack([ours(i) for i in range(checkpoint.model["num_layers"])]) if stacked else ours(layer)
    return value[index]


if __name__ == "__main__":
    main(*sys.argv[1:])
