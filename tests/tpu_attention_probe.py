"""Compiles attention train steps for a v5e 2x2 TPU slice and prints what the programs hold, as JSON.

Run in a process of its own (`python -m tests.tpu_attention_probe`) by tests/test_attention.py: a process
that has loaded libtpu is unsafe for the rest of a CPU test session (jax.profiler crashes in it, and a
pytest worker that had loaded it aborted from a native thread during a later CPU test)."""
import json
import os
import re

# name: (implementation, seq_len, dtype, key/value heads of the 4 query heads)
CASES = {"auto-1024-bf16": ("auto", 1024, "bfloat16", 4), "auto-300-fp32": ("auto", 300, "float32", 4),
         "reference-256-bf16": ("reference", 256, "bfloat16", 4),
         "gqa-auto-512-bf16": ("auto", 512, "bfloat16", 2), "mqa-auto-512-bf16": ("auto", 512, "bfloat16", 1)}


def tpu_mesh():
    """A v5e 2x2 slice (4 chips) from libtpu's topology API, as a (data 2, fsdp 1, tensor 2) mesh."""
    for key, value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_ACCELERATOR_TYPE", "v5litepod-4")):
        os.environ[key] = value  # libtpu reads these once, when it loads
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                            chips_per_host_bounds=(2, 2, 1), num_slices=1)
    return Mesh(np.array(topology.devices).reshape(2, 1, 2), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)


def compile_train_like(mesh, implementation, seq_len, dtype, kv_heads=4, batch=4, heads=4, head_dim=128, width=256):
    """loss + grad of 2 stacked layers (q/k/v projections, attention, output projection) as a
    lax.scan of jax.checkpoint'ed blocks, the way the model runs, compiled for `mesh`; k and v have
    `kv_heads` heads (grouped-query attention when fewer than `heads`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from scone_jax.model import attention as A

    def block(x, w, seg):
        q, k, v = (jnp.einsum("btd,dnh->btnh", x, m.astype(dtype)) for m in w[:3])
        out = A.attention(q, k, v, seg, implementation=implementation)
        return x + jnp.einsum("btnh,nhd->btd", out, w[3].astype(dtype))

    def loss(params, x, seg):
        y, _ = jax.lax.scan(lambda x, w: (jax.checkpoint(block)(x, w, seg), None), x.astype(dtype), params)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    proj = sds((2, width, heads, head_dim), jnp.float32, P(None, None, "tensor"))
    kv_proj = sds((2, width, kv_heads, head_dim), jnp.float32, P(None, None, "tensor" if kv_heads % 2 == 0 else None))
    params = (proj, kv_proj, kv_proj, sds((2, heads, head_dim, width), jnp.float32, P(None, "tensor")))
    rows = P(("data", "fsdp"))
    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.value_and_grad(loss)).lower(
            params, sds((batch, seq_len, width), jnp.float32, rows), sds((batch, seq_len), jnp.int32, rows))
    return lowered.compile()


def square_buffers(hlo_text: str, seq_len: int) -> list:
    return sorted(set(re.findall(rf"(?:f32|bf16)\[[\d,]*{seq_len},{seq_len}\]", hlo_text)))


def main():
    import jax.numpy as jnp

    mesh = tpu_mesh()
    facts = {}
    for name, (implementation, seq_len, dtype, kv_heads) in CASES.items():
        text = compile_train_like(mesh, implementation, seq_len, getattr(jnp, dtype), kv_heads).as_text()
        facts[name] = {"tpu_custom_call": "tpu_custom_call" in text, "square_buffers": square_buffers(text, seq_len)}
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
