"""Random Hugging Face checkpoints made offline with our own writer (no torch): the load benchmark's input
(tools/bench_hf_load.py) and the multi-process memory test's (tests/test_hf_load_memory.py), of any size."""
from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np

from scone_jax.hf.families import of_config
from scone_jax.hf.safetensors import write_sharded

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def llama_config(*, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int, d_ff: int, vocab_size: int,
                 dtype: str = "bfloat16") -> dict:
    """A Llama-3-laid-out config.json (RMSNorm, SwiGLU, RoPE, untied head)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d_model,
            "intermediate_size": d_ff, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads, "vocab_size": vocab_size, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2}


def tensor_specs(config: dict) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor the config's family stores, layer by layer."""
    family = of_config(config, "config.json")
    dtype = DTYPES[config["torch_dtype"]]
    return [(t.name.format(i=i), dtype, t.shape) for t in family.tensors(family.model_keys(config, "config.json"))
            for i in (range(config["num_hidden_layers"]) if t.per_layer else [None])]


def write_random_checkpoint(directory: str, config: dict, *, seed: int = 0, max_shard_bytes: int = 2**30) -> int:
    """config.json and random N(0, 0.02) weights of `config` in `directory` (shards of at most `max_shard_bytes`
    with their index), one tensor in memory at a time; returns the bytes of tensor data."""
    specs = tensor_specs(config)
    shapes = {name: (dtype, shape) for name, dtype, shape in specs}
    rng = np.random.default_rng(seed)

    def produce(name: str) -> np.ndarray:
        dtype, shape = shapes[name]
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

    os.makedirs(directory, exist_ok=True)
    write_sharded(directory, specs, produce, max_shard_bytes=max_shard_bytes)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in specs)
