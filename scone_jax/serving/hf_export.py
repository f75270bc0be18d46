"""`python -m scone_jax.serving.export --workdir=W --output=H --format=hf`: a run's decoder as a stock Hugging Face
checkpoint of its family, which `transformers.AutoModelForCausalLM.from_pretrained(H)` opens with no custom code.

The family is the run's: the model_type of the checkpoint it was imported from (model.init_from_hf), or, for a run
trained from scratch, the family its model section matches exactly (hf/families: a GPT-2-style config -> gpt2;
RoPE + RMSNorm + SwiGLU -> llama, with model.qk_norm -> qwen3; non-parametric LayerNorm -> olmo); a model that
matches none is refused in one line naming what does not fit. A SCONE run, or one with model.embedding_multiplier
!= 1 (no family scales its input), is written by serving/hf_remote.py instead: the same decoder inside a
`trust_remote_code` model that feeds it the run's input (the f-gram rows beside it).

H (local) gets the weights and config.json (hf/write.py: one tensor gathered at a time, written by process 0),
generation_config.json, and the run's tokenizer: a tokenizer.json as the run used it, with tokenizer_config.json
(the imported checkpoint's own when the tokenizer is that checkpoint's, else one naming the run's special tokens
for PreTrainedTokenizerFast); a SentencePiece run gets its tokenizer.model and a tokenizer_config.json naming
the special tokens, which `sentencepiece` reads exactly (transformers' own SentencePiece classes assume Llama's
normalisation, so AutoTokenizer is not promised there). The tensors' dtype is --dtype when given, else the
imported checkpoint's (a round trip gives back bit-identical tensors), else model.param_dtype.

HF_EXPORT (scone_export_hf.json) is written first, with the export's identity (the run's step and parameters'
fingerprint, family, dtype, tokenizer), and marked complete last. Rerunning a finished export does nothing; an
unfinished one of the same run is written again; a directory holding anything else (another export, another
checkpoint, any file) is refused and nothing is overwritten.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
from flax import nnx
from jax.experimental import multihost_utils

from scone_jax.hf import families, write as hf_write
from scone_jax.hf.checkpoint_dir import CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG, TORCH_DTYPES, read_json
from scone_jax.runtime import storage
from scone_jax.saved_config import run_config
from scone_jax.serving import bundle, hf_remote, output_dir
from scone_jax.serving.export import open_run
from scone_jax.training import run as run_lib

HF_EXPORT = "scone_export_hf.json"
PARAM_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def plan(config) -> tuple[families.Family, str | None]:
    """(the family, the imported checkpoint's safetensors dtype or None) of a run's config; ValueError in one line
    for a run outside every family's stock format."""
    m = config.model
    if config.overencoding.enabled:
        raise ValueError("The run uses Over-Encoding (overencoding.enabled): no Hugging Face family has its n-gram "
                         "tables. Fix: export it as a bundle (--format=bundle), which serving.evaluate, generate "
                         "and lm_eval read.")
    if hf_remote.needed(config):  # the remote-code model applies the input; the decoder inside is stock
        m = hf_remote.stock_model(m)
    source = m.get("init_from_hf", "")
    if not source:
        return families.of_model(m), None
    hf = read_json(source, CONFIG, required=True)
    family = families.of_config(hf, os.path.join(source, CONFIG))
    misfit = family.misfit(m)
    if misfit:
        raise ValueError(f"The run was imported from the {family.model_type} checkpoint {source} but its model has "
                         f"{', '.join(misfit)}. Fix: export it as a bundle (--format=bundle).")
    return family, TORCH_DTYPES.get(hf.get("dtype", hf.get("torch_dtype")))


def export_hf(workdir: str, output: str, *, dtype: str | None = None,
              max_shard_bytes: int = hf_write.DEFAULT_SHARD_BYTES, batch_rows: int = 8192) -> dict:
    """Write the latest checkpoint of `workdir` to the local directory `output` (module docstring). `dtype`:
    'float32' | 'bfloat16' | None (the imported checkpoint's, else model.param_dtype); for a SCONE run it is also
    the f-gram table's (None: bfloat16, as the bundle's), computed `batch_rows` f-grams a step (serving/hf_remote.py).
    Returns the export's identity (what HF_EXPORT holds)."""
    if storage.is_remote(output):
        raise ValueError(f"--output={output}: --format=hf writes a local directory (what transformers opens). Fix: "
                         "export to local disk, then copy it.")
    latest = run_lib.Latest.open(workdir)
    config = run_config(latest.meta)
    try:
        family, source_dtype = plan(config)
    except BaseException:
        latest.checkpointer.close()
        raise
    table_dtype = dtype or "bfloat16"
    dtype = PARAM_DTYPES[dtype] if dtype else source_dtype or PARAM_DTYPES[config.model.param_dtype]
    _refuse_foreign(output)
    run = open_run(workdir, config, latest)
    try:
        params = nnx.state(run.model(), nnx.Param)
        meta = {"format": "hf", "family": family.model_type, "step": run.step, "dtype": dtype,
                "model_fingerprint": bundle.params_fingerprint(params), **run.expect}
        remote = hf_remote.needed(config)
        if remote:
            meta.update(remote_code=True, table_dtype=table_dtype if config.scone.enabled else None)
        if _prepare(output, meta):
            return meta
        if remote:
            hf_remote.write(output, family, config, run, dtype=dtype, table_dtype=table_dtype, batch_rows=batch_rows,
                            max_shard_bytes=max_shard_bytes)
        else:
            hf_write.write_checkpoint(output, family, {**config.model.to_dict()}, params, dtype=dtype,
                                      special_ids=run.tokenizer.special_ids, max_shard_bytes=max_shard_bytes)
        if jax.process_index() == 0:
            _write_tokenizer(output, run.tokenizer, config)
            _write_marker(output, {**meta, "complete": True})
        multihost_utils.sync_global_devices("scone_hf_export_written")
        return meta
    finally:
        run.close()


# What an export of this format writes into its directory (output_dir.claim: anything else there is refused).
_WRITES = (CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG, "special_tokens_map.json", "tokenizer.model",
           "model.safetensors", "model.safetensors.index.json", HF_EXPORT, HF_EXPORT + ".tmp", *hf_remote.WRITES)
_WRITE_PREFIXES = ("model-", ".safetensors-")  # shards, and a shard or table file being written


def _refuse_foreign(output: str) -> None:
    """Refuse, reading only, a directory that holds anything this exporter does not write, or its files without
    an HF_EXPORT marker of ours (serving/output_dir.py: nothing of the user's is overwritten)."""
    output_dir.claim(output, names=_WRITES, prefixes=_WRITE_PREFIXES, marker=HF_EXPORT, is_ours=_is_marker,
                     kind="a Hugging Face export of scone_jax")


def _is_marker(raw: bytes) -> bool:
    try:
        value = json.loads(raw)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("format") == "hf" and isinstance(value.get("family"), str)


def _prepare(output: str, meta: dict) -> bool:
    """True if `output` already holds this export complete; refuses another export's directory; else marks the
    export started. Decided on process 0, for all."""
    done = False
    if jax.process_index() == 0:
        marker = _read_marker(output)
        if marker is not None:
            existing = {k: v for k, v in marker.items() if k != "complete"}
            if existing != meta:
                differ = sorted(k for k in set(meta) | set(existing) if meta.get(k) != existing.get(k))
                raise bundle.BundleError(f"{output!r} already holds an export that differs from this one in {differ}; "
                                         "nothing was overwritten. Fix: choose another --output, or delete that one "
                                         "first.")
            done = bool(marker.get("complete"))
        if not done:
            os.makedirs(output, exist_ok=True)
            _write_marker(output, {**meta, "complete": False})
    return bool(multihost_utils.broadcast_one_to_all(jax.numpy.int32(done)))


def _read_marker(output: str) -> dict | None:
    path = os.path.join(output, HF_EXPORT)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_marker(output: str, value: dict) -> None:
    path = os.path.join(output, HF_EXPORT)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def _write_tokenizer(output: str, tokenizer, config) -> None:
    """The run's tokenizer files (module docstring)."""
    source = config.model.get("init_from_hf", "")
    raw = tokenizer.file_bytes
    if tokenizer.kind == "sentencepiece":
        with open(os.path.join(output, "tokenizer.model"), "wb") as f:
            f.write(raw)
        settings = {}
    else:
        with open(os.path.join(output, TOKENIZER), "wb") as f:
            f.write(raw)
        settings = {"tokenizer_class": "PreTrainedTokenizerFast"}
        own = source and os.path.isfile(os.path.join(source, TOKENIZER))
        if own and open(os.path.join(source, TOKENIZER), "rb").read() == raw:  # the imported checkpoint's tokenizer
            for name in (TOKENIZER_CONFIG, GENERATION_CONFIG, "special_tokens_map.json"):
                if os.path.isfile(os.path.join(source, name)):
                    shutil.copyfile(os.path.join(source, name), os.path.join(output, name))
            if os.path.isfile(os.path.join(source, TOKENIZER_CONFIG)):
                return
    ids = tokenizer.special_ids
    config_json = {**settings, **{f"{role}_token": tokenizer.id_to_token(ids[role]) for role in ("bos", "eos", "pad")},
                   "model_max_length": int(config.model.max_seq_len)}
    with open(os.path.join(output, TOKENIZER_CONFIG), "w") as f:
        json.dump(config_json, f, indent=2)
