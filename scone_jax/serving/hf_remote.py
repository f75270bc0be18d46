"""`--format=hf` for a run whose input no stock family expresses: a SCONE run (its f-gram rows replace T(token) where an
f-gram ends) or a run with model.embedding_multiplier != 1. serving/hf_export.py hands such a run here; the directory
opens with `AutoModelForCausalLM.from_pretrained(H, trust_remote_code=True)`.

H gets, besides the tokenizer files and the marker hf_export writes:
  model.safetensors (or shards + index)  the decoder as its family's checkpoint (hf/write.py), every name under
                                         `decoder.` (the stock model inside SconeForCausalLM)
  config.json              model_type "scone", auto_map -> the remote code, text_config = the family's config.json,
                           embedding_multiplier, fgrams = {num_fgrams, max_len, vocab_size, width, dtype, table,
                           vocabulary} (null without SCONE)
  generation_config.json   the family's
  fgram_table.safetensors  "rows" [S, d]: the f-gram model run over all S f-grams exactly as the bundle export runs it
                           (export.embed_fn on the same per-device batches: the same values, bit for bit), bf16 unless
                           --dtype says otherwise; streamed to disk batch by batch, never held whole
  fgram_vocab.safetensors  "tokens" [S, K] and "lengths" [S], int32: the run's f-gram vocabulary
  config.json's fgrams also holds table_crc32 (of the table file's bytes after its header) and tokenizer_sha256 (of
  the export's tokenizer.json): the vLLM plugin (serving/vllm_plugin) refuses a damaged table or another tokenizer
  configuration_scone.py, modeling_scone.py, scone_fgrams.py  the model class (scone_jax/hf/remote_code/, copied as
                           they are: they import only transformers, torch and numpy)
Every process computes rows; process 0 gathers each batch and writes it, as hf/write.py does for tensors.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import zlib

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from scone_jax import sharding
from scone_jax.hf import safetensors as st, write as hf_write
from scone_jax.hf.families.base import Family
from scone_jax.hf.remote_code import scone_fgrams
from scone_jax.runtime.progress import Progress
from scone_jax.serving import export as bundle_export

REMOTE_CODE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf", "remote_code")
REMOTE_FILES = ("configuration_scone.py", "modeling_scone.py", "scone_fgrams.py")
WRITES = (*REMOTE_FILES, scone_fgrams.TABLE_FILE, scone_fgrams.VOCAB_FILE)  # beside the stock checkpoint's files
DECODER_PREFIX = "decoder."
TABLE_DTYPES = {"bfloat16": "BF16", "float32": "F32"}


def needed(config) -> bool:
    """Whether the run's input needs the remote-code model: SCONE, or an input scaling no family has."""
    return bool(config.scone.enabled) or config.model.embedding_multiplier != 1.0


def stock_model(model) -> dict:
    """Our model section as the stock decoder inside sees it: the input's multiplier is the remote code's job."""
    return {**model.to_dict(), "embedding_multiplier": 1.0}


class _Prefixed:
    """A family whose tensor names carry `prefix` (the stock model's place inside SconeForCausalLM)."""

    def __init__(self, family: Family, prefix: str):
        self.family, self.prefix = family, prefix

    def __getattr__(self, name):
        return getattr(self.family, name)

    def tensors(self, model):
        return [dataclasses.replace(t, name=self.prefix + t.name) for t in self.family.tensors(model)]


def write(output: str, family: Family, config, run, *, dtype: str, table_dtype: str, batch_rows: int,
          max_shard_bytes: int) -> None:
    """The decoder, the f-gram files, config.json and the remote code into the local directory `output` (module
    docstring). Every process calls it."""
    model = run.model()
    scone = bool(config.scone.enabled)
    params = nnx.state(model.decoder if scone else model, nnx.Param)
    decoder = stock_model(config.model)
    special_ids = run.tokenizer.special_ids
    hf_write.write_checkpoint(output, _Prefixed(family, DECODER_PREFIX), decoder, params, dtype=dtype,
                              special_ids=special_ids, max_shard_bytes=max_shard_bytes)
    fgrams = None
    if scone:
        stored = TABLE_DTYPES[table_dtype]
        _, crc = write_table(os.path.join(output, scone_fgrams.TABLE_FILE), model, run.mesh, run.vocab, table_dtype,
                             batch_rows)
        if jax.process_index() == 0:
            write_vocab(os.path.join(output, scone_fgrams.VOCAB_FILE), run.vocab)
        fgrams = {"num_fgrams": run.vocab.num_fgrams, "max_len": run.vocab.max_len,
                  "vocab_size": run.vocab.vocab_size, "width": int(config.model.d_model), "dtype": stored,
                  "table": scone_fgrams.TABLE_FILE, "vocabulary": scone_fgrams.VOCAB_FILE, "table_crc32": crc,
                  "tokenizer_sha256": _tokenizer_sha256(run.tokenizer, config)}
    if jax.process_index() == 0:
        for name in REMOTE_FILES:
            shutil.copyfile(os.path.join(REMOTE_CODE_DIR, name), os.path.join(output, name))
        text = hf_write.hf_config(family, decoder, dtype, special_ids)
        _write_json(os.path.join(output, "config.json"), remote_config(text, config.model, fgrams))


def remote_config(text_config: dict, model, fgrams: dict | None) -> dict:
    """config.json of the remote-code model around the family's `text_config`."""
    shared = {k: text_config[k] for k in ("dtype", "bos_token_id", "eos_token_id", "pad_token_id") if k in text_config}
    return {"architectures": ["SconeForCausalLM"], "model_type": "scone",
            "auto_map": {"AutoConfig": "configuration_scone.SconeConfig",
                         "AutoModelForCausalLM": "modeling_scone.SconeForCausalLM"},
            "text_config": text_config, "embedding_multiplier": float(model.embedding_multiplier), "fgrams": fgrams,
            "max_position_embeddings": int(model.max_seq_len), "use_cache": True, **shared}


def _tokenizer_sha256(tokenizer, config) -> str | None:
    """sha256 of the tokenizer.json the export writes beside the model (hf_export.tokenizer_files), None if none."""
    from scone_jax.serving import hf_export  # it imports this module

    data = hf_export.tokenizer_files(tokenizer, config).get("tokenizer.json")
    return None if data is None else hashlib.sha256(data).hexdigest()


def write_table(path: str, model, mesh, vocab, table_dtype: str, batch_rows: int) -> tuple[int, str]:
    """The f-gram model's output for every f-gram, rows [S, d] in `table_dtype`, into the safetensors file `path`
    (process 0 writes; a temporary file renamed at the end). Batches are the bundle export's: batch_rows / shards rows
    per data shard through export.embed_fn, so each row is computed by the same compiled program on the same
    per-device shape and comes out bit-identical to the bundle's. Returns the rows written and the CRC32 (8 hex
    digits) of the bytes after the header."""
    shards = sharding.num_batch_shards(mesh)
    per_step = shards * max(1, batch_rows // shards)
    num, width = vocab.num_fgrams, int(model.decoder.cfg.d_model)
    dtype = st.DTYPES[TABLE_DTYPES[table_dtype]]
    embed = bundle_export.embed_fn(model, mesh, table_dtype)
    chief = jax.process_index() == 0
    out, crc = None, 0
    if chief:
        out = open(path + ".tmp", "wb")
        out.write(st.header_bytes([("rows", dtype, (num, width))], {"format": "pt"}))
    try:
        starts = list(range(0, num, per_step))
        progress = Progress("hf export: f-gram table", num, "rows", log=logging.info if chief else _silent)
        pending = None  # one batch in flight while the previous one is gathered and written
        for start in starts + [None]:
            result = None
            if start is not None:
                rows = np.arange(start, start + per_step)
                result = embed(*bundle_export.rows_inputs(vocab, np.where(rows < num, rows, -1), mesh))
            if pending is not None:
                first, values = pending
                host = _gather(values)
                if chief:
                    data = np.ascontiguousarray(host[: min(per_step, num - first)], dtype).tobytes()
                    out.write(data)
                    crc = zlib.crc32(data, crc)
                progress.add(min(per_step, num - first))
            pending = None if start is None else (start, result)
        if chief:
            out.close()
            os.replace(path + ".tmp", path)
    finally:
        if out is not None and not out.closed:
            out.close()
            os.unlink(path + ".tmp")
    multihost_utils.sync_global_devices("scone_hf_table_written")
    return num, f"{crc:08x}"


def _silent(*args) -> None:
    """Progress on processes other than 0 (process 0 reports)."""


def _gather(array: jax.Array) -> np.ndarray:
    """The whole of a row-sharded result on this host."""
    if not array.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(jax.device_get(array))


def write_vocab(path: str, vocab) -> None:
    """The vocabulary's tokens and lengths (int32) as one safetensors file."""
    arrays = {"tokens": np.asarray(vocab.tokens, np.int32), "lengths": np.asarray(vocab.lengths, np.int32)}
    specs = [(name, np.dtype(np.int32), a.shape) for name, a in arrays.items()]
    st.write_file(path, specs, arrays.__getitem__, metadata={"format": "pt", "vocab_size": vocab.vocab_size,
                                                             "fingerprint": vocab.fingerprint})


def _write_json(path: str, value: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
