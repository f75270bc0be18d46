"""Is loading a Hugging Face checkpoint disk-bound? Loads a few-GB Llama-shaped bf16 checkpoint made offline and
compares the load's rate with the disk's sequential read rate, both measured in this run with the page cache
dropped for the checkpoint's files.

  python tools/bench_hf_load.py                       # ~3 GB checkpoint in a temporary directory, removed after
  python tools/bench_hf_load.py --size_gb=6 --dir=/mnt/nvme/bench --keep
  python tools/bench_hf_load.py --quick                 # a few MB, one round: the script runs (tests)

The checkpoint (random values, no download) is written with scone_jax/hf/safetensors.py into --dir as
model-0000K-of-0000N.safetensors shards of --shard_gb with their index and a config.json. Then, for each of
--repeats rounds: the files' pages are dropped from the page cache (posix_fadvise DONTNEED after fsync; root is
not needed), the files are read sequentially in 16 MiB reads (the disk's rate), the pages are dropped again, and
scone_jax.hf.load.load_decoder reads every tensor into the decoder's parameters on this process's devices (a mesh
of all local devices, the run's shardings; fp32 master weights by default, --param_dtype=bfloat16 to skip the
conversion). It prints

  RESULT disk_read_gb_per_s        the sequential read rate of the checkpoint's files
  RESULT hf_load_gb_per_s          checkpoint bytes over the load's wall time (first array to last, blocked)
  RESULT hf_load_vs_disk_ratio     the two rates' ratio (goal >= 0.8: the load is disk-bound, not Python-bound)
  RESULT hf_read_vs_disk_ratio     the load's reads alone (bytes over the time spent reading the files) over the
                                   disk's rate: where the first ratio is low and this one is not, the rest of the
                                   time is the devices' work (on CPU devices, the transposes and conversions run on
                                   this host's cores; on accelerators they take milliseconds)

using the best round of each (the least disturbed by other work on the machine).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import types

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from scone_jax.hf import synthetic  # noqa: E402


def _define_flags():
    """The command-line flags, defined only when this file runs as a program (tests import it beside other
    benchmarks with a --quick of their own)."""
    return types.SimpleNamespace(
        size_gb=flags.DEFINE_float("size_gb", 3.0, "Checkpoint size in GB (bf16 weights); must be > 0."),
        shard_gb=flags.DEFINE_float("shard_gb", 1.0, "Size of each safetensors shard in GB; must be > 0."),
        dir=flags.DEFINE_string("dir", "", "Directory for the checkpoint ('' = a temporary one); must be empty or "
                                "absent."),
        keep=flags.DEFINE_bool("keep", False, "Keep the checkpoint after the run."),
        repeats=flags.DEFINE_integer("repeats", 2, "Rounds of (disk read, load); the best of each is reported; >= 1."),
        param_dtype=flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"],
                                      "The decoder's parameter dtype."),
        quick=flags.DEFINE_bool("quick", False, "A checkpoint of a few MB (width 256), one round: checks that the "
                                "script runs, in seconds; its figures say nothing about the disk."))


READ_BYTES = 16 * 2**20
SHAPE = dict(d_model=2048, num_heads=16, num_kv_heads=4, d_ff=5632, vocab_size=32000)
QUICK_SHAPE = dict(d_model=256, num_heads=4, num_kv_heads=2, d_ff=704, vocab_size=1024)


def checkpoint_config(size_gb: float, shape: dict = SHAPE) -> dict:
    """A Llama-3-shaped config (by default width 2048, GQA 16/4 heads, untied head) with the blocks that bring its
    bf16 weights to about `size_gb`."""
    d, heads, kv_heads, d_ff, vocab = (shape[k] for k in ("d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size"))
    head_dim = d // heads
    block = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * d_ff + 2 * d
    fixed = 2 * vocab * d + d
    layers = max(1, round((size_gb * 1e9 / 2 - fixed) / block))
    return synthetic.llama_config(num_layers=layers, **shape)


def weight_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


def drop_cache(paths: list[str]) -> None:
    """Evict the files' pages from the page cache, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_rate(paths: list[str]) -> float:
    """Bytes per second reading the files sequentially in 16 MiB reads, from a dropped cache."""
    drop_cache(paths)
    buffer, total = bytearray(READ_BYTES), 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total / (time.perf_counter() - start)


def load_rate(directory: str, param_dtype: str) -> tuple[float, int, float]:
    """(checkpoint bytes per second loading every tensor into the decoder's shardings, bytes read, bytes per second
    of the reads alone) from a dropped cache: the wall time from the first read to the last array ready on the
    devices."""
    import jax
    from flax import nnx

    from scone_jax import sharding
    from scone_jax.config import base_config
    from scone_jax.hf import load
    from scone_jax.hf.checkpoint_dir import HfCheckpoint
    from scone_jax.model.transformer import Decoder

    checkpoint = HfCheckpoint.open(directory)
    config = base_config()
    config.model.update(checkpoint.model)
    config.model.param_dtype = param_dtype
    mesh = sharding.make_mesh(config.mesh)
    abstract = nnx.eval_shape(lambda: nnx.state(Decoder(config.model, nnx.Rngs(0)), nnx.Param))
    target = sharding.sharded_abstract(abstract, sharding.state_shardings(abstract, mesh))
    drop_cache(weight_files(directory))
    start = time.perf_counter()
    params, report = load.load_decoder(checkpoint, target)
    jax.block_until_ready(jax.tree.leaves(params))
    seconds = time.perf_counter() - start
    del params
    return report.bytes_read / seconds, report.bytes_read, report.bytes_read / max(report.read_seconds, 1e-9)


def main(f):
    for name, value in (("size_gb", f.size_gb.value), ("shard_gb", f.shard_gb.value)):
        if not value > 0:
            sys.exit(f"bench_hf_load: error: --{name}={value} must be > 0.")
    size_gb, shard_gb, repeats, shape = f.size_gb.value, f.shard_gb.value, f.repeats.value, SHAPE
    if f.quick.value:
        size_gb, shard_gb, repeats, shape = 0.01, 0.004, 1, QUICK_SHAPE
    if f.repeats.value < 1:
        sys.exit(f"bench_hf_load: error: --repeats={f.repeats.value} must be at least 1.")
    directory = f.dir.value or tempfile.mkdtemp(prefix="bench_hf_load-")
    os.makedirs(directory, exist_ok=True)
    if os.listdir(directory):
        sys.exit(f"bench_hf_load: error: --dir={directory} is not empty; the benchmark writes a checkpoint there. "
                 "Fix: name an empty or absent directory.")
    try:
        start = time.perf_counter()
        size = synthetic.write_random_checkpoint(directory, checkpoint_config(size_gb, shape),
                                                 max_shard_bytes=int(shard_gb * 1e9))
        print(f"wrote a {size / 1e9:.2f} GB bf16 checkpoint to {directory} in {time.perf_counter() - start:.0f} s",
              flush=True)
        disk, loads, reads = [], [], []
        for round_ in range(repeats):
            disk.append(disk_read_rate(weight_files(directory)))
            rate, read, read_rate = load_rate(directory, f.param_dtype.value)
            loads.append(rate)
            reads.append(read_rate)
            print(f"round {round_ + 1}: disk {disk[-1] / 1e9:.2f} GB/s, load {rate / 1e9:.2f} GB/s "
                  f"({read / 1e9:.2f} GB read at {read_rate / 1e9:.2f} GB/s)", flush=True)
        print(f"RESULT disk_read_gb_per_s {max(disk) / 1e9:.3f}")
        print(f"RESULT hf_load_gb_per_s {max(loads) / 1e9:.3f}")
        print(f"RESULT hf_load_vs_disk_ratio {max(loads) / max(disk):.3f}")
        print(f"RESULT hf_read_vs_disk_ratio {max(reads) / max(disk):.3f}")
    finally:
        if not f.keep.value:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    _flags = _define_flags()
    app.run(lambda argv: main(_flags))
