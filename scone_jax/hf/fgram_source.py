"""The f-gram model grown from a pretrained Hugging Face checkpoint (scone.init_from_hf; docs/method.md §4,
docs/training.md "SCONE on a pretrained model").

`apply(config)` opens and checks the source checkpoint (checkpoint_dir.py: config.json, every safetensors header,
every tensor's name, shape and dtype) and writes into `config`:
  scone.init_from_hf   its absolute path;
  scone.source_model   the source's model keys (families/: norm, epsilon, MLP, biases, key/value heads, head_dim, q/k
                       norm, positions, RoPE's theta and scaling, vocab_size) as JSON: the f-gram model's blocks take
                       them (model/fgram_model.py), and checkpoints and exports carry them, so a resume or an export
                       rebuilds the same model without the directory;
  scone.num_layers, d_model, num_heads, d_ff  the source's (a different value the user set is refused).
Refused in one line, before anything is read or written: a run without SCONE, or that would not start at the plain
fine-tune (neither scone.gate nor scone.combine=add with a zero projection: config.py);
a source with fewer positions than K; one whose f-gram model would exceed scone.max_source_params; a source whose
tokenizer is not the run's (the f-gram model reads the run's ids: they must name the same tokens in both, so
tokenizer.json files that differ only in ways that keep every id's token are accepted and said so in the log).
`derive_architecture` does the config part from a config.json alone (tools/aot_compile.py, without weights).

`load(checkpoint, abstract, max_len)` reads the source's tensors straight into the f-gram model's shardings with
hf/load.py's machinery: its token table (scone.own_token_embedding), blocks and final norm, and for a GPT-2 source
the first K rows of its learned positions. The projections and the gate are the run's own (the gate starts at 0,
so step 0 is the plain fine-tune of the main model).
"""
from __future__ import annotations

import dataclasses
import json
import math

import tokenizers
from absl import logging
from flax import nnx

from scone_jax import config as config_lib, config_keys
from scone_jax.data import tokenizer as tokenizer_lib
from scone_jax.hf import load as hf_load
from scone_jax.hf.checkpoint_dir import CONFIG, HfCheckpoint, HfCheckpointError, open_cached
from scone_jax.hf.families.base import Family, Part

# The f-gram model's parameters a source fills (the rest, projections, gate and gain, are the run's own).
SOURCE_MODULES = ("token_embed", "pos_embed", "stack")
# scone keys the source's model keys fix.
SIZES = {"num_layers": "num_layers", "d_model": "d_model", "num_heads": "num_heads", "d_ff": "d_ff"}


def apply(config) -> HfCheckpoint | None:
    """Derive the scone section from scone.init_from_hf (module docstring); the source, None when it is ''."""
    directory = config.scone.get("init_from_hf", "")
    if not directory:
        return None
    checkpoint = open_cached(directory)
    config.scone.init_from_hf = checkpoint.directory
    derive_architecture(config, checkpoint.family, checkpoint.model, checkpoint.path(CONFIG))
    check_tokenizer(config, checkpoint)
    return checkpoint


def derive_architecture(config, family: Family, model: dict, where: str) -> None:
    """The scone section from the source's model keys `model` (of the config.json at `where`): sizes, the
    architecture (scone.source_model), and the position and capacity checks."""
    s = config.scone
    config_lib.check_fgram_source(config)
    if model["max_seq_len"] < s.max_len:
        raise HfCheckpointError(f"{where}: the source has {model['max_seq_len']} positions "
                                f"(max_position_embeddings) but f-grams have up to scone.max_len={s.max_len} tokens. "
                                f"Fix: a source with at least {s.max_len} positions, or a smaller scone.max_len.")
    for key, value in SIZES.items():
        have, default = s[key], config_keys.BY_NAME[f"scone.{key}"].default
        if have != default and have != model[value]:
            raise HfCheckpointError(f"scone.{key}={have!r} conflicts with {where}, from which scone.init_from_hf "
                                    f"derives scone.{key}={model[value]!r}. Fix: leave scone.{key} unset (the source "
                                    "sets it), or drop scone.init_from_hf.")
        s[key] = model[value]
    architecture = json.dumps(model, sort_keys=True)
    if s.source_model not in ("", architecture):
        raise HfCheckpointError(f"scone.source_model is set to another architecture than {where}'s: it is derived "
                                "from scone.init_from_hf. Fix: leave scone.source_model ''.")
    s.source_model = architecture
    count = source_params(family, model, config)
    if s.max_source_params and count > s.max_source_params:
        raise HfCheckpointError(f"{where}: the f-gram model grown from it would have {count:,} parameters, more than "
                                f"scone.max_source_params={s.max_source_params:,}. Fix: a smaller source, or raise "
                                "scone.max_source_params after checking the slice's memory with tools/aot_compile.py.")


def source_params(family: Family, model: dict, config) -> int:
    """Parameters of the f-gram model this run builds from the source's keys `model`: the blocks and final norm,
    its token table with scone.own_token_embedding, K learned positions for a GPT-2 source, and the projections
    to and from the main model's width where the widths differ (the one out of it, zero-initialised, at equal widths
    with scone.output_projection_init='zeros'). What scone.max_source_params bounds."""
    own, k = bool(config.scone.own_token_embedding), config.scone.max_len
    total = 0
    for tensor in family.tensors(model):
        for part in tensor.parts:
            top = part.path[0]
            if top == "head" or (top == "token_embed" and not own):
                continue
            count = math.prod(tensor.part_shape(part))
            if top == "pos_embed":
                count = count // model["max_seq_len"] * k
            total += count * (model["num_layers"] if tensor.per_layer else 1)
    d, main = model["d_model"], config.model.d_model
    bias = bool(model.get("use_bias"))
    if d != main:
        total += d * main + main * bias + (0 if own else main * d + d * bias)
    elif config.scone.get("output_projection_init", "normal") == "zeros":  # out_proj at equal widths too
        total += d * main + main * bias
    return total


def check_tokenizer(config, checkpoint: HfCheckpoint) -> None:
    """The run's tokenizer (data.tokenizer_path) maps every id to the token the source's tokenizer.json maps it to,
    and the source has an embedding row for each; HfCheckpointError naming both files and the first id that
    differs otherwise (module docstring)."""
    source_path, main_path = checkpoint.tokenizer_path, config.data.tokenizer_path
    if source_path is None:
        raise HfCheckpointError(f"{checkpoint.directory} (scone.init_from_hf) has no tokenizer.json, so it cannot be "
                                "checked that the f-gram model's source reads the run's token ids as the same tokens. "
                                "Fix: copy the source's tokenizer.json into that directory.")
    if not main_path:
        raise HfCheckpointError(f"scone.init_from_hf={checkpoint.directory} needs the run's tokenizer to be the "
                                "source's, but data.tokenizer_path is '' (a SentencePiece model trained in the "
                                f"workdir). Fix: set data.tokenizer_path={source_path}, or start the main model from a "
                                "checkpoint with the same tokenizer (model.init_from_hf).")
    try:
        main = tokenizer_lib.Tokenizer.load(main_path, tokenizer_lib.special_tokens_of(config.data))
    except FileNotFoundError:
        raise HfCheckpointError(f"data.tokenizer_path={main_path!r} does not exist. Fix: point it at the run's "
                                "tokenizer.json.") from None
    with open(source_path, "rb") as f:
        source_bytes = f.read()
    if main.file_bytes == source_bytes:
        mismatch = None
    elif main.kind != tokenizer_lib.HUGGINGFACE:
        mismatch = f"the first is a {main.kind} model, the second a tokenizer.json"
    else:
        mismatch = _first_difference(_id_to_token(main.file_bytes), _id_to_token(source_bytes))
    if mismatch:
        raise HfCheckpointError(f"The run's tokenizer {main_path} (data.tokenizer_path) and the f-gram model's source "
                                f"tokenizer {source_path} (scone.init_from_hf) differ: {mismatch}. The f-gram model "
                                "reads the run's token ids, which would name other tokens than the ones its weights "
                                "were trained on. Fix: use a source checkpoint with the run's tokenizer (Qwen3-4B, 8B "
                                "and 14B share one).")
    if main.file_bytes != source_bytes:
        logging.info("The run's tokenizer %s and the f-gram model's source tokenizer %s are different files that map "
                     "every id to the same token.", main_path, source_path)
    rows = checkpoint.model["vocab_size"]
    if main.vocab_size > rows:
        raise HfCheckpointError(f"The tokenizer {main_path} has {main.vocab_size} tokens but the f-gram model's source "
                                f"{checkpoint.directory} has {rows} embedding rows: ids past them have no row. Fix: a "
                                "source whose embedding covers the tokenizer.")


def _id_to_token(raw: bytes) -> dict:
    """{id: token} of a tokenizer.json, its added tokens included."""
    vocab = tokenizers.Tokenizer.from_str(raw.decode("utf-8")).get_vocab(with_added_tokens=True)
    return {i: token for token, i in vocab.items()}


def _first_difference(ours: dict, theirs: dict) -> str | None:
    """'id 17 is 'ab' in the first and 'cd' in the second (300 and 301 ids)', or None when they agree."""
    for i in sorted(set(ours) | set(theirs)):
        if ours.get(i) != theirs.get(i):
            return (f"id {i} is {ours.get(i, '(none)')!r} in the first and {theirs.get(i, '(none)')!r} in the second "
                    f"({len(ours)} and {len(theirs)} ids)")
    return None


def placement(checkpoint: HfCheckpoint, max_len: int) -> dict:
    """hf/load.py's placement for the f-gram model: the same tensors, except that a learned position table (GPT-2's
    wpe) gives only its first K rows."""
    where = hf_load.placement(checkpoint)
    if ("pos_embed", "embedding") in where:
        tensor, _ = where[("pos_embed", "embedding")]
        rows = dataclasses.replace(tensor, parts=(Part(("pos_embed", "embedding"), 0, max_len),), axis=0)
        where[("pos_embed", "embedding")] = (rows, rows.parts[0])
    return where


def load(checkpoint: HfCheckpoint, abstract: nnx.State, max_len: int) -> tuple[nnx.State, hf_load.LoadReport]:
    """The source's parameters of the f-gram model whose abstract state (ShapeDtypeStructs with shardings) is
    `abstract`, each read straight into its sharding (hf/load.py); the state holds only those (SOURCE_MODULES)."""
    wanted = [(path, v) for path, v in nnx.to_flat_state(abstract) if path[0] in SOURCE_MODULES]
    return hf_load.load_decoder(checkpoint, nnx.from_flat_state(wanted), where=placement(checkpoint, max_len))
