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
Then scone.init_from_hf, the f-gram model's source, derives the scone section (hf/fgram_source.py).
It is idempotent (a derived config derives to itself) and touches neither the workdir nor a device, so a bad
checkpoint is refused before a run writes anything. A checkpoint opened once per process is kept (keyed by the
directory's files' sizes and times), so the train loop's and the run builder's calls cost one check.
"""
from __future__ import annotations

import os

from scone_jax import config_keys
from scone_jax.data import tokenizer as tokenizer_lib
from scone_jax.hf import families, fgram_source
from scone_jax.hf.checkpoint_dir import CONFIG, HfCheckpoint, HfCheckpointError, open_cached, read_json, require_local
from scone_jax.hf.families.base import Family, HfConfigError, canonical


def apply(config) -> HfCheckpoint | None:
    """Derive `config` (changed in place, locked or not) from model.init_from_hf, then the f-gram model's section
    from scone.init_from_hf (hf/fgram_source.py); the main checkpoint, None when model.init_from_hf is ''."""
    for section in ("model", "scone"):  # a URL named as what it is, whichever key gives it
        require_local(config[section].get("init_from_hf", ""), f"{section}.init_from_hf")
    checkpoint = _apply_main(config)
    fgram_source.apply(config)
    return checkpoint


def _apply_main(config) -> HfCheckpoint | None:
    directory = config.model.get("init_from_hf", "")
    if not directory:
        return None
    checkpoint = open_checkpoint(directory)
    config.model.init_from_hf = checkpoint.directory  # absolute: the export reads it from wherever it runs
    apply_model_keys(config, checkpoint.model, checkpoint.path(CONFIG))
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
    return open_cached(directory)


def config_json(path: str) -> tuple[Family, dict, str]:
    """(family, model keys, where) of a config.json alone, or of the one in directory `path`: what an ahead-of-time
    compile needs (tools/aot_compile.py), without weights or a tokenizer. HfCheckpointError in one line."""
    if not os.path.exists(path):
        raise HfCheckpointError(f"{path} does not exist. Fix: give a Hugging Face config.json, or the directory that "
                                "holds one.")
    where = os.path.join(path, CONFIG) if os.path.isdir(path) else path
    hf = read_json(os.path.dirname(where) or ".", os.path.basename(where), required=True)
    try:
        family = families.of_config(hf, where)
        return family, family.model_keys(hf, where), where
    except HfConfigError as e:
        raise HfCheckpointError(str(e)) from None


def from_config_files(config, hf_config: str = "", fgram_hf_config: str = "") -> None:
    """The model section from the main checkpoint's config.json and the f-gram model's from its source's, as apply
    derives them, from the config.json files alone (a path to one, or to a directory holding one): what an
    ahead-of-time compile needs (tools/aot_compile.py), without weights or tokenizers. A given path replaces the
    directory the config names (model.init_from_hf, scone.init_from_hf), which need not exist on this machine; ''
    = that directory's config.json, if it names one. HfCheckpointError in one line."""
    for flag, section, path in (("--hf_config", "model", hf_config), ("--fgram_hf_config", "scone", fgram_hf_config)):
        named = config[section].get("init_from_hf", "")
        if not path and named and not os.path.exists(named):
            raise HfCheckpointError(f"{section}.init_from_hf={named!r} does not exist on this machine. Fix: pass "
                                    f"{flag}=DIR with its config.json alone (configs/hf/ holds Qwen3's), or copy the "
                                    "checkpoint here.")
        path = path or named
        if not path:
            continue
        family, keys, where = config_json(path)
        config[section].init_from_hf = os.path.abspath(os.path.dirname(where))
        if section == "model":
            apply_model_keys(config, keys, where)
        else:
            fgram_source.derive_architecture(config, family, keys, where)


def apply_model_keys(config, derived: dict, where: str) -> None:
    """config.model's keys set to `derived` (a family's model keys of the config.json at `where`), refusing a value
    the user set (not the key's default) that differs."""
    for key, value in derived.items():
        _set(config, f"model.{key}", value, where, derived)


def _set(config, key: str, value, where: str, derived: dict) -> None:
    """config[key] = value, refusing a user's value that differs (module docstring)."""
    section, name = key.split(".")
    have, default = config[section][name], config_keys.BY_NAME[key].default
    model = {**derived, **{k: config.model[k] for k in ("d_model", "num_heads") if k not in derived}}
    if have != default and canonical(name, have, model) != canonical(name, value, model):
        raise HfCheckpointError(f"{key}={have!r} conflicts with {where}, from which model.init_from_hf derives "
                                f"{key}={value!r}. Fix: leave {key} unset (the checkpoint sets it), or drop "
                                "model.init_from_hf.")
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
