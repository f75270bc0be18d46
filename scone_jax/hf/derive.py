"""A run's config from the Hugging Face checkpoint it starts from (model.init_from_hf): the model section derived
from config.json, the data section's tokenizer and special tokens from tokenizer.json and tokenizer_config.json.

`apply(config)` opens and checks the checkpoint (checkpoint_dir.py: config.json, every safetensors header, every
tensor's name, shape and dtype) and the tokenizer, then writes into `config`:
  model.init_from_hf its absolute path (the export reads the directory again, from wherever it runs);
  model.*            every key the checkpoint's architecture fixes (families/), vocab_size included: exactly the
                     embedding's rows. A value the user set (not the key's default) that differs is refused in one
                     line naming both; the same value is fine.
  data.tokenizer_path  its tokenizer.json (used as is), unless the user named another;
  data.eos_token / data.bos_token  tokenizer_config.json's eos_token / bos_token, where the user left them '';
  data.add_bos       False when the checkpoint's tokenizer starts no document with BOS (tokenizer_config.json's
                     add_bos_token, else tokenizer.json's post-processor): Qwen, GPT-2 and OLMo pack documents
                     without one, Llama 3 with one.
It is idempotent (a derived config derives to itself) and touches neither the workdir nor a device, so a bad
checkpoint is refused before a run writes anything. A checkpoint opened once per process is kept (keyed by the
directory's files' sizes and times), so the train loop's and the run builder's calls cost one check.
"""
from __future__ import annotations

import functools
import os

from scone_jax import config_keys
from scone_jax.data import tokenizer as tokenizer_lib
from scone_jax.hf.checkpoint_dir import HfCheckpoint, HfCheckpointError
from scone_jax.hf.families.base import canonical


def apply(config) -> HfCheckpoint | None:
    """Derive `config` (changed in place, locked or not) from model.init_from_hf; None when it is ''."""
    directory = config.model.get("init_from_hf", "")
    if not directory:
        return None
    checkpoint = open_checkpoint(directory)
    config.model.init_from_hf = checkpoint.directory  # absolute: the export reads it from wherever it runs
    derived = dict(checkpoint.model)
    for key, value in derived.items():
        _set(config, f"model.{key}", value, checkpoint, derived)
    data = config.data
    if not data.tokenizer_path:
        if checkpoint.tokenizer_path is None:
            raise HfCheckpointError(f"{directory} has no tokenizer.json and data.tokenizer_path is ''. Fix: set "
                                    "data.tokenizer_path to the tokenizer.json the checkpoint was trained with.")
        data.tokenizer_path = checkpoint.tokenizer_path
    for role in ("eos", "bos"):
        if not data.get(f"{role}_token", "") and checkpoint.special_token(role):
            data[f"{role}_token"] = checkpoint.special_token(role)
    if "add_bos" in data and not checkpoint.adds_bos():
        data.add_bos = False
    _check_tokenizer(config, checkpoint)
    return checkpoint


def open_checkpoint(directory: str) -> HfCheckpoint:
    """HfCheckpoint.open, once per process for unchanged files."""
    return _open_cached(os.path.abspath(directory), _signature(directory))


@functools.lru_cache(maxsize=4)
def _open_cached(directory: str, signature: tuple) -> HfCheckpoint:
    del signature  # part of the cache key only
    return HfCheckpoint.open(directory)


def _signature(directory: str) -> tuple:
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)))
    except OSError:
        return ()


def _set(config, key: str, value, checkpoint: HfCheckpoint, derived: dict) -> None:
    """config[key] = value, refusing a user's value that differs (module docstring)."""
    section, name = key.split(".")
    have, default = config[section][name], config_keys.BY_NAME[key].default
    model = {**derived, **{k: config.model[k] for k in ("d_model", "num_heads") if k not in derived}}
    if have != default and canonical(name, have, model) != canonical(name, value, model):
        raise HfCheckpointError(f"{key}={have!r} conflicts with {checkpoint.path('config.json')}, from which "
                                f"model.init_from_hf derives {key}={value!r}. Fix: leave {key} unset (the checkpoint "
                                "sets it), or drop model.init_from_hf.")
    config[section][name] = type(default)(value) if isinstance(default, float) else value


def _check_tokenizer(config, checkpoint: HfCheckpoint) -> None:
    """The tokenizer loads with the derived special tokens and fits the embedding's rows."""
    path = config.data.tokenizer_path
    try:
        tokenizer = tokenizer_lib.Tokenizer.load(path, tokenizer_lib.special_tokens_of(config.data))
    except FileNotFoundError:
        raise HfCheckpointError(f"data.tokenizer_path={path!r} does not exist. Fix: point it at the checkpoint's "
                                "tokenizer.json.") from None
    rows = config.model.vocab_size
    if tokenizer.vocab_size > rows:
        raise HfCheckpointError(f"The tokenizer {path} has {tokenizer.vocab_size} tokens but the checkpoint "
                                f"{checkpoint.directory} has {rows} embedding rows (config.json vocab_size): ids past "
                                "them have no embedding. Fix: use the tokenizer the checkpoint was trained with.")
