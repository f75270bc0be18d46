"""A checkpoint larger than one host's share loads on four JAX processes (loopback, 2 CPU devices each, every weight
matrix split over the 8 devices) without any holding the whole model: each reads only its quarter of every tensor,
and its resident memory rises by about half the checkpoint: its quarter, the blocks of a parameter in transit
(read, then transposed and converted by the devices) and the compiled conversions (on CPU devices the "device"
buffers are host memory too; on accelerators only the blocks in transit are). The docstring of
scone_jax/hf/load.py says how a 70B checkpoint loads on a pod; docs/training.md has the figures. The decoder is
unscanned (a parameter per layer): scanned, one parameter stacks every layer, a larger block in transit.

Deliberate bug it caught: load._read_sharding reading every parameter replicated (each device the whole tensor):
every process read the whole 471 MB checkpoint (its resident rise stayed near 210 MB: its devices shared one read
buffer, so only the bytes read show it)."""
import json
import os
import sys

import pytest

from scone_jax.hf import synthetic
from tests.common import free_port, run_processes

pytestmark = pytest.mark.slow  # starts processes
HOSTS = 4


def test_four_hosts_each_read_and_hold_only_their_share(tmp_path):
    config = synthetic.llama_config(d_model=512, num_layers=36, num_heads=8, num_kv_heads=2, d_ff=1408,
                                    vocab_size=16000, dtype="float32")
    size = synthetic.write_random_checkpoint(str(tmp_path / "ckpt"), config, max_shard_bytes=64 * 2**20)
    assert size > 450e6  # float32 weights and parameters: a host's share is a quarter of this
    port = free_port()
    argvs = [[sys.executable, "-m", "tests.hf_load_worker", str(port), str(i), str(HOSTS), str(tmp_path / "ckpt"),
              str(tmp_path), "0"] for i in range(HOSTS)]
    for r in run_processes(argvs, timeout=300, devices=2):
        assert r.returncode == 0, r.stderr[-3000:]
    for i in range(HOSTS):
        with open(os.path.join(tmp_path, f"{i}.json")) as f:
            result = json.load(f)
        print(f"process {i}: peak resident rise {result['peak_rise'] / 1e6:.0f} MB, read "
              f"{result['bytes_read'] / 1e6:.0f} MB of a {size / 1e6:.0f} MB checkpoint")
        assert (result["devices"], result["local_devices"]) == (8, 2)
        assert result["exact"]  # every block this host holds is the checkpoint's
        assert 0.22 * size < result["bytes_read"] < 0.28 * size  # its quarter of every matrix (norms: whole)
        assert result["peak_rise"] < 0.6 * size, result  # its quarter, parameters in transit, compiled code
