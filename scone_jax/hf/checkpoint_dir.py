"""A local Hugging Face checkpoint directory, opened and checked whole before anything is loaded or written.

What it reads: config.json (the family and our model keys, families/), the weights (`model.safetensors`, or the
shards that `model.safetensors.index.json` lists), tokenizer.json and tokenizer_config.json (the run's tokenizer
and its special tokens) and generation_config.json. `HfCheckpoint.open` checks, each failure one HfCheckpointError
line naming the file and what to do: config.json present and of a supported family; weights present, every
safetensors header valid (hf/safetensors.py: a truncated or damaged file is named); every tensor the family
expects for config.json present with its shape and with config.json's dtype; no tensor it does not expect (a tied
head's copy of the embedding table and GPT-2's causal-mask buffers are read past). Only the headers are read.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from scone_jax.hf import families, safetensors
from scone_jax.hf.families.base import Family, HfConfigError, Tensor

CONFIG, TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # config.json's dtype -> safetensors'
FLOAT_DTYPES = ("F32", "BF16", "F16")


class HfCheckpointError(ValueError):
    """A directory that is not a checkpoint we can load, in one line naming the file and the fix."""


@dataclasses.dataclass(frozen=True)
class HfCheckpoint:
    directory: str
    config: dict  # config.json
    family: Family
    model: dict  # our model keys, derived from config.json (families/)
    files: dict  # tensor name as the file spells it -> its SafetensorsFile
    names: dict  # tensor name as the family spells it (prefixed) -> as the file spells it
    dtype: str  # the tensors' safetensors dtype ('F32', 'BF16', 'F16')

    @classmethod
    def open(cls, directory: str) -> "HfCheckpoint":
        require_local(directory, "model.init_from_hf")
        if not os.path.isdir(directory):
            raise HfCheckpointError(f"{directory} is not a directory. Fix: point at a local Hugging Face checkpoint "
                                    "directory (config.json, model.safetensors, tokenizer.json).")
        config = read_json(directory, CONFIG, required=True)
        where = os.path.join(directory, CONFIG)
        try:
            family = families.of_config(config, where)
            model = family.model_keys(config, where)
        except HfConfigError as e:
            raise HfCheckpointError(str(e)) from None
        files = _open_weights(directory)
        names = _check_tensors(directory, family, model, files)
        dtype = _dtype(config, where, files, names)
        return cls(directory, config, family, model, files, names, dtype)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    @functools.cached_property
    def tensors(self) -> list[Tensor]:
        return self.family.tensors(self.model)

    def read(self, tensor: Tensor, layer: int | None, block: tuple[slice, ...]) -> np.ndarray:
        """The block `block` of `tensor` (of layer `layer` for a per-layer one) as stored (HF layout and dtype)."""
        name = self.names[tensor.name.format(i=layer)]
        return self.files[name].read(name, block)

    def read_into(self, tensor: Tensor, layer: int | None, block: tuple[slice, ...], out: np.ndarray) -> None:
        """read(), into `out` (the block's shape and the stored dtype): no copy besides the read itself."""
        name = self.names[tensor.name.format(i=layer)]
        self.files[name].read_into(name, block, out)

    @property
    def tokenizer_path(self) -> str | None:
        """tokenizer.json, used as is, if the directory has one."""
        path = self.path(TOKENIZER)
        return path if os.path.isfile(path) else None

    @functools.cached_property
    def tokenizer_config(self) -> dict:
        return read_json(self.directory, TOKENIZER_CONFIG) or {}

    def special_token(self, role: str) -> str:
        """tokenizer_config.json's `{role}_token` ('bos', 'eos'): its spelling, '' if it names none."""
        value = self.tokenizer_config.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else ""

    def adds_bos(self) -> bool:
        """Whether the checkpoint's tokenizer starts a document with its BOS token: tokenizer_config.json's
        add_bos_token, else whether tokenizer.json's post-processor puts a special token first (Llama 3's does;
        GPT-2's, OLMo's and Qwen's do not)."""
        flag = self.tokenizer_config.get("add_bos_token")
        if isinstance(flag, bool):
            return flag
        spec = read_json(self.directory, TOKENIZER) if self.tokenizer_path else None
        post = (spec or {}).get("post_processor") or {}
        processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
        for proc in processors:
            if isinstance(proc, dict) and proc.get("type") == "TemplateProcessing":
                single = proc.get("single") or []
                return bool(single) and isinstance(single[0], dict) and "SpecialToken" in single[0]
        return False


def require_local(directory: str, key: str) -> None:
    """HfCheckpointError, one line, if `directory` (the value of `key`) is a URL (gs://, hf://, ...): checkpoints are
    read from local files only (before os.path.abspath, which would make 'gs://b/x' a missing local 'gs:/b/x')."""
    if "://" in directory:
        scheme = directory.split("://", 1)[0]
        raise HfCheckpointError(f"{key}={directory!r} is a remote path ({scheme}://), and remote checkpoints are not "
                                "supported: a Hugging Face checkpoint is read from a local directory. Fix: copy it to "
                                "local disk first (e.g. gcloud storage cp -r, or huggingface-cli download --local-dir) "
                                f"and set {key} to that directory.")


def open_cached(directory: str) -> HfCheckpoint:
    """HfCheckpoint.open, once per process for unchanged files (keyed by the directory's files' sizes and times), so
    the train loop's and the run builder's calls cost one check."""
    require_local(directory, "model.init_from_hf")
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


def read_json(directory: str, name: str, required: bool = False) -> dict | None:
    """A JSON object file of the directory; None if absent (HfCheckpointError if `required`), and one line if it
    does not parse."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        if required:
            raise HfCheckpointError(f"{directory} has no {name}: not a Hugging Face checkpoint directory. Fix: point "
                                    "at the directory that holds config.json and the weights.")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise HfCheckpointError(f"{path} cannot be read as JSON ({' '.join(str(e).split())[:200]}). Fix: copy it "
                                "again from its source.") from None
    if not isinstance(value, dict):
        raise HfCheckpointError(f"{path} is not a JSON object. Fix: copy it again from its source.")
    return value


def _open_weights(directory: str) -> dict:
    """{tensor name as stored: its opened SafetensorsFile} from the index's shards or model.safetensors."""
    index = read_json(directory, safetensors.INDEX)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HfCheckpointError(f"{os.path.join(directory, safetensors.INDEX)} has no weight_map. Fix: copy it "
                                    "again from its source.")
        opened = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(directory, str(shard))
            if not os.path.isfile(path):
                raise HfCheckpointError(f"{path}, listed in {safetensors.INDEX}, is missing. Fix: copy every shard "
                                        "of the checkpoint.")
            opened[shard] = _open(path)
        files = {}
        for shard, file in opened.items():
            for name in file.tensors:
                if weight_map.get(name) != shard:
                    raise HfCheckpointError(f"{file.path} holds tensor {name}, which {safetensors.INDEX} places "
                                            f"{'in ' + weight_map[name] if name in weight_map else 'nowhere'}. Fix: "
                                            "copy the checkpoint again from its source.")
                files[name] = file
        listed = sorted(set(weight_map) - set(files))
        if listed:
            raise HfCheckpointError(f"{safetensors.INDEX} lists tensor {listed[0]} in {weight_map[listed[0]]}, which "
                                    "does not hold it. Fix: copy the checkpoint again from its source.")
        return files
    path = os.path.join(directory, safetensors.SINGLE)
    if os.path.isfile(path):
        file = _open(path)
        return {name: file for name in file.tensors}
    others = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack")))
    found = f" (it has {', '.join(others[:3])}: only safetensors files are read)" if others else ""
    raise HfCheckpointError(f"{directory} has no weights: neither {safetensors.SINGLE} nor {safetensors.INDEX}"
                            f"{found}. Fix: point at a directory with safetensors weights (transformers' "
                            "save_pretrained writes them).")


def _open(path: str) -> safetensors.SafetensorsFile:
    try:
        return safetensors.SafetensorsFile(path)
    except safetensors.SafetensorsError as e:
        raise HfCheckpointError(str(e)) from None


def _dtype(config: dict, where: str, files: dict, names: dict) -> str:
    """The one floating dtype of every tensor we read (`names`' stored names): config.json's dtype (torch_dtype in
    transformers 4) when it names one, else theirs; HfCheckpointError naming the first tensor that disagrees."""
    named = config.get("dtype", config.get("torch_dtype"))
    if named is not None and named not in TORCH_DTYPES:
        raise HfCheckpointError(f"{where}: dtype={named!r} is not supported; supported: {', '.join(TORCH_DTYPES)}. "
                                "Fix: convert the checkpoint to one of them.")
    want = TORCH_DTYPES.get(named)
    for name in sorted(names.values()):
        file = files[name]
        have = file.tensors[name].dtype_name
        if want is None and have in FLOAT_DTYPES:
            want = have
        if have != want:
            said = f"config.json's dtype={named!r}" if named else f"the other tensors' {want}"
            raise HfCheckpointError(f"{file.path}: tensor {name} is {have} but {said} says {want}. Fix: use a "
                                    "checkpoint whose tensors all have its config's dtype.")
    return want or "F32"


def _check_tensors(directory: str, family: Family, model: dict, files: dict) -> dict:
    """{expected name: stored name} after checking each expected tensor is stored with its shape, and nothing
    else is (a file saved from the base model may leave out the family's prefix, e.g. 'model.')."""
    expected = {t.name.format(i=i): t for t in family.tensors(model)
                for i in (range(model["num_layers"]) if t.per_layer else (None,))}
    names, unexpected = {}, []
    for stored in sorted(files):
        name = stored if stored in expected else family.prefix + stored
        if name in expected and name not in names:
            names[name] = stored
        elif not family.ignored(stored, model) and not family.ignored(name, model):
            unexpected.append(stored)
    if unexpected:
        first = unexpected[0]
        raise HfCheckpointError(f"{files[first].path} holds tensor {first}, which a {family.model_type} "
                                f"model of its config.json has no place for ({len(unexpected)} such tensors). Fix: "
                                "check that config.json belongs to these weights.")
    missing = [name for name in expected if name not in names]
    if missing:
        raise HfCheckpointError(f"{directory} lacks tensor {missing[0]}, which its config.json's {family.model_type} "
                                f"model needs ({len(missing)} missing). Fix: copy every weight file of the "
                                "checkpoint, or check that config.json belongs to them.")
    for name, stored in names.items():
        shape = files[stored].tensors[stored].shape
        if shape != expected[name].shape:
            raise HfCheckpointError(f"{files[stored].path}: tensor {stored} has shape {list(shape)} but config.json "
                                    f"implies {list(expected[name].shape)}. Fix: check that config.json belongs to "
                                    "these weights.")
    return names
