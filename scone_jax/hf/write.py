"""A decoder's parameters written as a stock Hugging Face checkpoint of its family, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` opens with no custom code.

`write_checkpoint(directory, family, model, params, ...)` writes config.json (the family's architecture fields,
architectures, model_type, dtype, the special ids), generation_config.json, and the weights: model.safetensors, or
above `max_shard_bytes` shards with model.safetensors.index.json (hf/safetensors.py). Tensors are made one at a
time, in the family's order, each from our parameter(s) by the family's inverse transform (kernels transposed back
to [out, in], GPT-2's q, k, v fused into c_attn): every process takes part in gathering that one tensor (one
layer of a stacked parameter), process 0 writes it, so no host ever holds more than one tensor of the model. The
values are converted to `dtype` (the checkpoint's own on a round trip: bf16 -> fp32 -> bf16 is exact).
Other writers (the SCONE remote-code export) reuse it: it knows nothing about runs or tokenizers.
"""
from __future__ import annotations

import json
import math
import os

import jax
from absl import logging
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from scone_jax.hf import safetensors as st
from scone_jax.hf.families.base import Family, HfConfigError, Tensor
from scone_jax.hf.load import locate
from scone_jax.runtime.progress import Progress

TORCH_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' own default max_shard_size


def hf_config(family: Family, model, dtype: str, special_ids: dict) -> dict:
    """config.json for our model section: the family's fields, its class, the tensors' dtype and the token ids."""
    ids = {f"{role}_token_id": int(special_ids[role]) for role in ("bos", "eos", "pad")
           if special_ids.get(role) is not None}
    return {"architectures": [family.architecture], "model_type": family.model_type, **family.hf_config(model),
            "dtype": TORCH_NAMES[dtype], "use_cache": True, **ids}


def write_checkpoint(directory: str, family: Family, model, params: nnx.State, *, dtype: str = "F32",
                     special_ids: dict | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     extra_config: dict | None = None) -> list[str]:
    """Write `params` (a decoder's nnx.Param state, either block layout, global arrays) with `model` (our model
    section, a mapping) as a `family` checkpoint in the local `directory` (made if needed). Every process calls it;
    process 0 writes. Returns the file names written. HfConfigError if `model` is not of `family`."""
    misfit = family.misfit(model)
    if misfit:
        raise HfConfigError(f"The model is not a {family.model_type} model: it has {', '.join(misfit)}.")
    if dtype not in TORCH_NAMES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(TORCH_NAMES)}.")
    tensors = {t.name.format(i=i): (t, i) for t in family.tensors(model)
               for i in (range(model["num_layers"]) if t.per_layer else (None,))}
    specs = [(name, st.DTYPES[dtype], t.shape) for name, (t, _) in tensors.items()]
    flat = dict(nnx.to_flat_state(params))
    where = {p.path: (t, p) for t in family.tensors(model) for p in t.parts}
    ours = {}  # (part path, layer) -> our parameter's path and whether it is stacked
    for path in flat:
        tensor, part, stacked, layer = locate(path, where)
        ours[(part.path, layer)] = (path, stacked)
        if stacked:
            for i in range(model["num_layers"]):
                ours[(part.path, i)] = (path, True)

    chief = jax.process_index() == 0
    total = sum(math.prod(shape) * np.dtype(kind).itemsize for _, kind, shape in specs)
    progress = Progress("hf export: tensors", total, "MB", scale=1e6, log=logging.info if chief else _silent)

    def produce(name: str) -> np.ndarray:
        tensor, layer = tensors[name]
        out = _tensor(tensor, layer, flat, ours).astype(st.DTYPES[dtype])
        progress.add(out.nbytes)
        return out

    if chief:
        os.makedirs(directory, exist_ok=True)
        written = st.write_sharded(directory, specs, produce, max_shard_bytes, metadata={"format": "pt"})
        config = {**hf_config(family, model, dtype, special_ids or {}), **(extra_config or {})}
        _write_json(directory, "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        _write_json(directory, "generation_config.json", generation)
        return [*written, "config.json", "generation_config.json"]
    for name, _, _ in specs:  # the same gathers, in the same order, as process 0's
        produce(name)
    return []


def _silent(*args) -> None:
    """Progress on processes other than 0: they gather the same tensors, process 0 reports."""


def _tensor(tensor: Tensor, layer: int | None, flat: dict, ours: dict) -> np.ndarray:
    """One Hugging Face tensor (of one layer) from our parameter(s), in float32."""
    out = np.empty(tensor.shape, np.float32)
    axis = tensor.axis % len(tensor.shape)
    for part in tensor.parts:
        path, stacked = ours[(part.path, layer)]
        value = _gather(flat[path].get_value(), layer if stacked else None)
        block = value.T if tensor.transpose else value
        index = [slice(None)] * len(tensor.shape)
        index[axis] = slice(part.start, part.stop)
        out[tuple(index)] = block
    return out


@jax.jit
def _layer(array, i):
    return jax.lax.dynamic_index_in_dim(array, i, keepdims=False)


def _gather(array: jax.Array, layer: int | None) -> np.ndarray:
    """The whole of `array` (its slice `layer` of the leading axis, if given) on this host, as float32."""
    if layer is not None:
        array = _layer(array, np.int32(layer))
    if not array.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(array, tiled=True), np.float32)
    return np.asarray(jax.device_get(array), np.float32)


def _write_json(directory: str, name: str, value: dict) -> None:
    path = os.path.join(directory, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
