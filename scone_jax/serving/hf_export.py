"""`python -m scone_jax.serving.export --workdir=W --output=H --format=hf`: a run's decoder as a stock Hugging Face
checkpoint of its family, which `transformers.AutoModelForCausalLM.from_pretrained(H)` opens with no custom code.

The family is the run's: the model_type of the checkpoint it was imported from (model.init_from_hf), or, for a run
trained from scratch, the family its model section matches exactly (hf/families: a GPT-2-style config -> gpt2;
RoPE + RMSNorm + SwiGLU -> llama, with model.qk_norm -> qwen3; non-parametric LayerNorm -> olmo); a model that
matches none is refused in one line naming what does not fit. A SCONE run, or one with model.embedding_multiplier
!= 1 (no family scales its input), is written by serving/hf_remote.py instead: the same decoder inside a
`trust_remote_code` model that feeds it the run's input (the f-gram rows beside it).

H (local) gets the weights and config.json (hf/write.py: one tensor gathered at a time, written by process 0),
generation_config.json (bos/eos/pad ids, so `generate` stops at the run's eos; an imported checkpoint's own, with
the run's ids, when the run kept its tokenizer), and the run's tokenizer as
`transformers.AutoTokenizer.from_pretrained(H)` opens it (PreTrainedTokenizerFast, no custom code; vLLM reads the
same files), encoding and decoding as the run did (`tokenizer_files`):
  tokenizer.json         a run with a tokenizer.json: that file as the run used it; a SentencePiece run: the same
                         model built with `tokenizers` (hf/sp_tokenizer.py: its pieces and scores, byte fallback,
                         normalization and dummy prefix; checked against sentencepiece before anything is written),
                         beside its tokenizer.model
  tokenizer_config.json  the imported checkpoint's own when the run's tokenizer is that checkpoint's (its files
                         special_tokens_map.json, chat_template.jinja, vocab.json, merges.txt, ... come along), with
                         the run's special tokens where it names others (the same for the files beside a
                         data.tokenizer_path of a run of our own, with model_max_length = model.max_seq_len); else one
                         naming the run's bos/eos/pad (and a SentencePiece model's unk) for PreTrainedTokenizerFast,
                         model_max_length = model.max_seq_len
  chat_template.jinja    a chat run's template (data.chat_template, else the one beside data.tokenizer_path), as
                         training rendered conversations with it
The tensors' dtype is --dtype when given, else the imported checkpoint's (a round trip gives back bit-identical
tensors), else model.param_dtype. Writing the tensors (and a SCONE run's f-gram table) logs progress: a line every
tenth, with the rate (MB/s; rows/s) and the time left.

HF_EXPORT (scone_export_hf.json) is written first, with the export's identity (the run's step and parameters'
fingerprint, family, dtype, tokenizer), and marked complete last. Rerunning a finished export does nothing; an
unfinished one of the same run is written again, after removing the temporary files a killed export of it left
(only names this exporter gives its temporaries); a directory holding anything else (another export, another
checkpoint, any file) is refused and nothing is overwritten.
"""
from __future__ import annotations

import json
import os

import jax
from flax import nnx
from jax.experimental import multihost_utils

from scone_jax.data import chat_template, tokenizer as tokenizer_lib
from scone_jax.hf import families, sp_tokenizer, write as hf_write
from scone_jax.hf.checkpoint_dir import CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG, TORCH_DTYPES, read_json
from scone_jax.runtime import storage
from scone_jax.saved_config import run_config
from scone_jax.serving import bundle, hf_remote, output_dir
from scone_jax.serving.export import open_run
from scone_jax.training import run as run_lib

HF_EXPORT = "scone_export_hf.json"
PARAM_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
TOKENIZER_MODEL, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE = "tokenizer.model", "special_tokens_map.json", chat_template.JINJA_FILE
# A checkpoint's tokenizer files besides tokenizer.json: kept when the run's tokenizer is that checkpoint's.
SOURCE_TOKENIZER_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE, "added_tokens.json", "vocab.json",
                          "merges.txt", TOKENIZER_MODEL)


def plan(config) -> tuple[families.Family, str | None]:
    """(the family, the imported checkpoint's safetensors dtype or None) of a run's config; ValueError in one line
    for a run outside every family's stock format."""
    m = config.model
    if config.overencoding.enabled or config.get("engram", {}).get("enabled", False):
        which = "Over-Encoding (overencoding.enabled)" if config.overencoding.enabled else "Engram (engram.enabled)"
        raise ValueError(f"The run uses {which}: no Hugging Face family has its n-gram "
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
        tokenizer = tokenizer_files(run.tokenizer, config)  # refused here, before a byte is written
        params = nnx.state(run.model(), nnx.Param)
        meta = {"format": "hf", "family": family.model_type, "step": run.step, "dtype": dtype,
                "model_fingerprint": bundle.params_fingerprint(params), **run.expect}
        remote = hf_remote.needed(config)
        if remote:
            meta.update(remote_code=True, table_dtype=table_dtype if config.scone.enabled else None)
        if _prepare(output, meta):
            return meta
        if jax.process_index() == 0:
            _remove_temporaries(output)
        if remote:
            hf_remote.write(output, family, config, run, dtype=dtype, table_dtype=table_dtype, batch_rows=batch_rows,
                            max_shard_bytes=max_shard_bytes)
        else:
            hf_write.write_checkpoint(output, family, {**config.model.to_dict()}, params, dtype=dtype,
                                      special_ids=run.tokenizer.special_ids, max_shard_bytes=max_shard_bytes)
        if jax.process_index() == 0:
            for name, data in tokenizer.items():
                with open(os.path.join(output, name), "wb") as f:
                    f.write(data)
            _write_marker(output, {**meta, "complete": True})
        multihost_utils.sync_global_devices("scone_hf_export_written")
        return meta
    finally:
        run.close()


# What an export of this format writes into its directory (output_dir.claim: anything else there is refused).
_FILES = (CONFIG, GENERATION_CONFIG, TOKENIZER, *SOURCE_TOKENIZER_FILES, "model.safetensors",
          "model.safetensors.index.json", HF_EXPORT, *hf_remote.WRITES)
_TEMPORARY = tuple(name + ".tmp" for name in _FILES)  # a JSON or table file being written (renamed when complete)
_TEMPORARY_SHARD = (hf_write.st.TEMPORARY_PREFIX, hf_write.st.TEMPORARY_SUFFIX)  # a tensor file being written
_WRITES = (*_FILES, *_TEMPORARY)
_WRITE_PREFIXES = ("model-", _TEMPORARY_SHARD[0])  # shards, and a shard being written


def _refuse_foreign(output: str) -> None:
    """Refuse, reading only, a directory that holds anything this exporter does not write, or its files without
    an HF_EXPORT marker of ours (serving/output_dir.py: nothing of the user's is overwritten)."""
    output_dir.claim(output, names=_WRITES, prefixes=_WRITE_PREFIXES, marker=HF_EXPORT, is_ours=_is_marker,
                     kind="a Hugging Face export of scone_jax")


def _remove_temporaries(output: str) -> None:
    """Delete what a killed export of this run left half written: only names this exporter gives its temporary
    files (a shard being written, or a file of ours + '.tmp'); _prepare has checked the directory is this export."""
    prefix, suffix = _TEMPORARY_SHARD
    for name in os.listdir(output):
        if name in _TEMPORARY or (name.startswith(prefix) and name.endswith(suffix)):
            os.unlink(os.path.join(output, name))


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


def tokenizer_files(tokenizer, config) -> dict[str, bytes]:
    """{file name: bytes} of the run's tokenizer for an export directory (module docstring). ValueError in one line
    for a SentencePiece model no tokenizer.json reproduces, or a chat run whose template cannot be read."""
    files, imported = {}, False
    names = {f"{role}_token": tokenizer.id_to_token(i) for role, i in tokenizer.special_ids.items()}
    if tokenizer.kind == tokenizer_lib.SENTENCEPIECE:
        files[TOKENIZER_MODEL] = tokenizer.file_bytes
        try:
            files[TOKENIZER], unk = sp_tokenizer.tokenizer_json(
                tokenizer.file_bytes, names["bos_token"] if config.data.get("add_bos", True) else None)
        except sp_tokenizer.UnsupportedModelError as e:
            raise ValueError(f"The run's SentencePiece tokenizer cannot be written as a tokenizer.json that encodes as "
                             f"it does: {e}. Fix: export a bundle (--format=bundle), which keeps the .model itself."
                             ) from None
        if unk is not None:
            names["unk_token"] = unk
    else:
        files[TOKENIZER] = tokenizer.file_bytes
        source = _tokenizer_home(config, files[TOKENIZER])
        if source is not None:
            for name in SOURCE_TOKENIZER_FILES:  # the checkpoint's tokenizer: its files come along
                if os.path.isfile(os.path.join(source, name)):
                    with open(os.path.join(source, name), "rb") as f:
                        files[name] = f.read()
            imported = source == config.model.get("init_from_hf", "")
            generation = read_json(source, GENERATION_CONFIG) if imported else None
            if generation is not None:  # its sampling defaults and stop ids, with the run's ids among them
                files[GENERATION_CONFIG] = _generation_config(generation, tokenizer.special_ids)
    if TOKENIZER_CONFIG in files:  # the checkpoint's own, naming the run's special tokens where it names any
        settings = json.loads(files[TOKENIZER_CONFIG])
        settings.update({key: token for key, token in names.items() if settings.get(key) is not None})
        if not imported:  # a checkpoint's tokenizer files for a model of our own: its length is ours
            settings["model_max_length"] = int(config.model.max_seq_len)
    else:
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", **names,
                    "model_max_length": int(config.model.max_seq_len), "clean_up_tokenization_spaces": False}
    template = _chat_template(config)
    if template is not None:
        files[CHAT_TEMPLATE] = template.encode("utf-8")
        settings.pop("chat_template", None)  # the file is the template
    files[TOKENIZER_CONFIG] = (json.dumps(settings, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def _tokenizer_home(config, raw: bytes) -> str | None:
    """The directory whose tokenizer.json is the run's (these bytes): the imported checkpoint's (model.init_from_hf),
    else the one data.tokenizer_path is in (a checkpoint's tokenizer files used for a run of our own); None if
    neither holds it (the run's tokenizer is another)."""
    tokenizer_path = config.data.get("tokenizer_path", "")
    for directory in (config.model.get("init_from_hf", ""), tokenizer_path and (os.path.dirname(tokenizer_path) or ".")):
        path = os.path.join(directory, TOKENIZER)
        if directory and not storage.is_remote(directory) and os.path.isfile(path):
            with open(path, "rb") as f:
                if f.read() == raw:
                    return directory
    return None


def _generation_config(source: dict, ids: dict) -> bytes:
    """The imported checkpoint's generation_config.json with the run's bos/eos/pad ids; an eos list (several stop
    tokens) that holds the run's eos is kept."""
    out = dict(source)
    for role, i in ids.items():
        key = f"{role}_token_id"
        if not (role == "eos" and isinstance(out.get(key), list) and i in out[key]):
            out[key] = int(i)
    return (json.dumps(out, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _chat_template(config) -> str | None:
    """The template a chat run rendered its conversations with (data.chat_template, else the files beside
    data.tokenizer_path); None for a run of plain text that names none."""
    data = config.data
    if data.get("source") != "chat" and not data.get("chat_template", ""):
        return None
    try:
        return chat_template.load(data.get("chat_template", ""), data.get("tokenizer_path", "")).source
    except chat_template.TemplateError as e:
        raise ValueError(f"The run's chat template cannot be read for the export: {e}") from None
