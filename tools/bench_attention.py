"""Attention implementations (scone_jax/model/attention.py): forward+backward time, and TPU memory.

  python tools/bench_attention.py            # quick (the default): ~1 minute on 2 CPU cores
  python tools/bench_attention.py --noquick  # more and larger sizes
  python tools/bench_attention.py --tpu_topology=  # skip the TPU compile

1. Time: jit(value_and_grad(sum(attention(q, k, v) * w))) for every implementation this
   platform has (CPU: reference, xla; GPU: + cudnn; TPU: + splash) at a few [B, T, N, H] sizes,
   each dtype, on the default device. Documents are packed 4 to a row, the last 5% of each row
   padding. Implementations run in alternating rounds and each keeps its fastest round, so load
   from other jobs on a shared machine lands on all of them alike.
2. TPU memory (needs libtpu, no TPU): the same function compiled for one chip of
   --tpu_topology at T=--tpu_seq_len, bf16, B=1, N=8, H=128: XLA's temporary memory
   (memory_analysis().temp_size_in_bytes) for 'reference' and 'splash' ('xla' too without
   --quick), and whether the compiled program holds a [.., T, T] buffer.
3. Prefill memory (this platform): a prompt of --prefill_len tokens run into an empty KV cache, as
   serving.generate does, for one layer's attention [1, P, 8, 64] fp32: the cached formula (dense
   fp32 [B, N, P, S] scores, what prefill used before) against the training implementation that
   prefill now runs (layers.Attention); XLA's temporary memory of each compiled program.
Last lines: `RESULT name value`.
"""
import os
import re
import time

# The TPU compile goes through libtpu's topology API from this (CPU) host; libtpu must not try to
# open a TPU or query VM metadata. A TPU VM's own values win.
for _key, _value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                     ("TPU_WORKER_HOSTNAMES", "localhost")):
    os.environ.setdefault(_key, _value)

import importlib.util  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from scone_jax.model import attention as attention_lib  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", True, "Small sizes, 3 rounds (about a minute on 2 cores).")
_TPU_TOPOLOGY = flags.DEFINE_string("tpu_topology", "v5e:1x1", "libtpu topology for the memory figures; '' skips.")
_TPU_SEQ_LEN = flags.DEFINE_integer("tpu_seq_len", 8192, "Sequence length of the TPU memory figures.")
_PREFILL_LEN = flags.DEFINE_integer("prefill_len", 8192, "Prompt length of the prefill memory figures (0 skips).")

QUICK_SIZES = [(4, 512, 8, 64), (2, 1024, 8, 64)]
FULL_SIZES = QUICK_SIZES + [(1, 2048, 8, 64), (1, 4096, 4, 128)]


def segment_ids(batch: int, seq_len: int) -> np.ndarray:
    real = seq_len - seq_len // 20
    ids = np.zeros((batch, seq_len), np.int32)
    ids[:, :real] = 1 + np.arange(real) * 4 // real
    return ids


def fwd_bwd(implementation: str):
    def loss(q, k, v, seg, w):
        out = attention_lib.attention(q, k, v, seg, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def time_sizes(implementations, sizes, dtypes, rounds: int) -> dict:
    results = {}
    for b, t, n, h in sizes:
        for dtype in dtypes:
            keys = jax.random.split(jax.random.key(0), 4)
            q, k, v, w = (jax.random.normal(key, (b, t, n, h), jnp.float32) for key in keys)
            args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), jnp.asarray(segment_ids(b, t)), w)
            fns = {name: fwd_bwd(name) for name in implementations}
            for fn in fns.values():
                jax.block_until_ready(fn(*args))  # compile + warm up
            best = {name: float("inf") for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    best[name] = min(best[name], time.perf_counter() - start)
            tag = f"{jnp.dtype(dtype).name}_B{b}_T{t}_N{n}_H{h}"
            line = ", ".join(f"{name} {best[name] * 1e3:.1f} ms" for name in fns)
            print(f"[{b}, {t}, {n}, {h}] {jnp.dtype(dtype).name}: {line}", flush=True)
            for name in fns:
                results[f"fwd_bwd_ms_{name}_{tag}"] = best[name] * 1e3
            if "reference" in fns:
                for name in fns:
                    if name != "reference":
                        results[f"speedup_{name}_vs_reference_{tag}"] = best["reference"] / best[name]
    return results


def tpu_device(topology_name: str):
    from jax.experimental import topologies

    generation, shape = topology_name.split(":")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{'v5litepod' if generation == 'v5e' else generation}-1")
    dims = [int(x) for x in shape.split("x")]
    bounds = tuple(min(2, d) for d in dims[:2]) + (1,)
    topology = topologies.get_topology_desc(platform="tpu", topology_name=topology_name,
                                            chip_config_name="megacore" if generation == "v4" else "default",
                                            chips_per_host_bounds=bounds, num_slices=1)
    return topology.devices[0]


def tpu_memory(topology_name: str, seq_len: int, implementations) -> dict:
    device = tpu_device(topology_name)
    mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1, 1), ("data", "fsdp", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)
    sharding = jax.sharding.NamedSharding(mesh, jax.P())
    b, n, h = 1, 8, 128
    qkv = jax.ShapeDtypeStruct((b, seq_len, n, h), jnp.bfloat16, sharding=sharding)
    args = (qkv, qkv, qkv, jax.ShapeDtypeStruct((b, seq_len), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((b, seq_len, n, h), jnp.float32, sharding=sharding))
    results = {}
    for name in implementations:
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = fwd_bwd(name).lower(*args).compile()
        mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
        square = bool(re.search(rf"(?:f32|bf16)\[[\d,]*{seq_len},{seq_len}\]", compiled.as_text()))
        print(f"{device.device_kind}, [{b}, {seq_len}, {n}, {h}] bf16, {name}: temp {mib:.1f} MiB, "
              f"[.., T, T] buffer: {'yes' if square else 'no'} (compiled in {time.perf_counter() - start:.1f} s)",
              flush=True)
        results[f"tpu_temp_mib_{name}_T{seq_len}"] = mib
        results[f"tpu_square_buffer_{name}_T{seq_len}"] = int(square)
    return results


def prefill_memory(prompt: int, implementation: str) -> dict:
    """Temporary memory of one layer's prefill attention over a `prompt`-token prompt (module docstring, 3)."""
    shape = jax.ShapeDtypeStruct((1, prompt, 8, 64), jnp.float32)
    paths = {
        "dense": lambda q, k, v: attention_lib.cached_attention(q, k, v, 0),
        "fused": lambda q, k, v: attention_lib.attention(q, k, v, jnp.ones(q.shape[:2], jnp.int32),
                                                         implementation=implementation, packed=False),
    }
    results = {}
    for name, fn in paths.items():
        compiled = jax.jit(fn).lower(shape, shape, shape).compile()
        mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"prefill of {prompt} tokens, one layer, {name} ({'cached formula' if name == 'dense' else implementation}): "
              f"temp {mib:.1f} MiB", flush=True)
        results[f"prefill_temp_mib_{name}_T{prompt}"] = mib
    return results


def main(argv):
    del argv
    platform = attention_lib.compile_platform()
    implementations = [i for i in attention_lib.PLATFORM_IMPLEMENTATIONS.get(platform, ("reference", "xla"))
                       if i != "auto"]
    quick = _QUICK.value
    print(f"{platform} ({jax.devices()[0].device_kind}, {jax.device_count()} devices): {', '.join(implementations)}")
    dtypes = [jnp.float32, jnp.bfloat16]
    results = time_sizes(implementations, QUICK_SIZES if quick else FULL_SIZES, dtypes, rounds=3 if quick else 5)
    if _PREFILL_LEN.value:
        results.update(prefill_memory(_PREFILL_LEN.value, "xla" if platform == "cpu" else "auto"))
    if _TPU_TOPOLOGY.value:
        if importlib.util.find_spec("libtpu") is None:
            print("libtpu not installed (pip install -e '.[aot]'): no TPU memory figures.")
        else:
            names = ["reference", "splash"] + ([] if quick else ["xla"])
            results.update(tpu_memory(_TPU_TOPOLOGY.value, _TPU_SEQ_LEN.value, names))
    for name, value in results.items():
        print(f"RESULT {name} {value:.4g}")


if __name__ == "__main__":
    app.run(main)
