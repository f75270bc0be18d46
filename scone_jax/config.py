"""Every config key with its default and meaning; config files in configs/ override these.

Configs are ml_collections ConfigDicts, locked after construction, so a misspelled
`--config.model.num_layrs=4` is an error listing the valid keys (see `unknown_key_message`).
"""
from __future__ import annotations

import importlib.util
import json
import os

import ml_collections

from scone_jax.data import eval_sets, mixture
from scone_jax.runtime import storage, workdir as workdir_layout


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = m = ml_collections.ConfigDict()
    m.vocab_size = 0  # 0: the tokenizer's size rounded up to a multiple of 128
    m.d_model = 256
    m.num_layers = 4
    m.num_heads = 4
    m.head_dim = 0  # 0: d_model // num_heads
    m.d_ff = 1024  # MLP hidden width (SwiGLU: use 2/3 of the GELU width for equal size)
    m.max_seq_len = 128  # size of the learned position table (>= data.seq_len)
    m.norm = "layernorm"  # 'layernorm' | 'rmsnorm' | 'nonparametric_layernorm'
    m.mlp = "gelu"  # 'gelu' | 'swiglu'
    m.position = "learned"  # 'learned' | 'rope'
    m.rope_theta = 10000.0
    m.use_bias = True
    m.tie_embeddings = True
    m.init_std = 0.02
    m.embedding_multiplier = 1.0  # the decoder's input T(token) times this (not the tied head, not the
    #                               f-gram model's input: scone.input_multiplier, not f-gram rows); 1 = the
    #                               method. A control of docs/quality.md: the baseline with input rows near
    #                               the f-gram rows' scale.
    m.dtype = "float32"  # compute dtype: 'float32' | 'bfloat16'
    m.param_dtype = "float32"  # master weights
    m.scan_layers = True  # blocks as one scan over stacked parameters (compiles once); False: a
    #                       Python loop of separate blocks, for debugging (same math)
    m.remat = "none"  # what each block keeps for the backward pass; see model/remat.py:
    #                   'none' (everything) | 'full' (only its input) | 'save_dots' (matmul outputs
    #                   without batch dims) | 'save_qkv_proj' (q/k/v/attention-output projections)
    m.attention = "auto"  # 'auto' | 'xla' | 'cudnn' | 'splash' | 'reference'; see model/attention.py

    c.scone = s = ml_collections.ConfigDict()
    s.enabled = False  # train the f-gram model jointly and replace embeddings at matches
    s.vocab_path = ""  # f-gram vocabulary; '' = extract into <workdir>/fgrams on first run
    s.max_len = 5  # K: longest f-gram, in tokens
    s.num_fgrams = 100_000  # S: f-grams kept (top S by count, all lengths ranked together)
    s.min_count = 5  # extraction's minimum count from the second scan on
    s.extract_max_tokens = 50_000_000  # extraction reads at most this many training tokens
    s.fgram_capacity = 1024  # U: unique f-grams per data shard per step (static shape)
    s.num_layers = 4  # f-gram model depth (its size relative to the main model)
    s.d_model = 0  # f-gram model width; 0 = the main model's (else projected to it)
    s.num_heads = 0  # 0 = the main model's
    s.d_ff = 0  # 0 = the main model's
    s.output_gain_init = 0.0  # 0 = off (the method); > 0: f-gram embeddings times a learned scalar gain that
    #                           starts here (an experiment on their scale, docs/quality.md)
    s.input_multiplier = 1.0  # the f-gram model's input T(t_i) times this, before its position embeddings;
    #                           1 = the method. An experiment of docs/quality.md: model.embedding_multiplier's
    #                           scaled input for the f-gram model's blocks too
    s.output_norm = True  # the f-gram embedding is the hidden state after the f-gram model's final norm
    #                       (docs/method.md §4); False: its last block's residual stream, at the scale of
    #                       the token inputs it replaces (docs/quality.md: the final norm's rows collapse)
    s.learning_rate_multiplier = 1.0  # the f-gram model's parameters (model/roles.py) train at this multiple
    #                       of the learning rate (its whole schedule; the decoder and the shared T keep the
    #                       rate); 1 = the method. > 0; != 1 only with enabled (docs/training.md)
    s.gate = False  # the method (False): a matched position's input is the f-gram embedding f. True: a learned
    #               scalar g, starting at 0, mixes it with the token's own input, (1 - g) T(token) + g f, so
    #               training starts as the baseline's and reaches the method's replacement at g = 1; the
    #               export bakes g into the table's rows (docs/training.md). Only with enabled

    c.data = d = ml_collections.ConfigDict()
    d.source = "kjv"  # 'kjv' (embedded corpus) | 'text' | 'jsonl' | 'arrayrecord'
    d.train_files = ""  # glob pattern(s), comma-separated; or a mixture of named, weighted components,
    #                     'web=/d/web/*.jsonl@0.7;books=/d/books/*.jsonl.gz@0.3' (data/mixture.py)
    d.eval_files = ""  # held-out data: globs, or named sets 'web=/d/web/*.jsonl;books=/d/b/*.txt' evaluated one by
    #                    one with their average (data/eval_sets.py); '' with kjv = its built-in held-out split
    d.text_field = "text"  # jsonl field holding the document
    d.document_unit = "line"  # text files: one document per 'line' or per 'file'
    d.eval_fraction = 0.02  # kjv: fraction of documents held out
    d.tokenizer_path = ""  # a SentencePiece .model or a Hugging Face tokenizer.json (local or gs://; the kind is
    #                        read from the content); '' = train a SentencePiece model into <workdir>/tokenizer.model
    d.vocab_size = 8000  # only used to train the tokenizer
    d.character_coverage = 0.9995  # tokenizer training: share of the text's characters that get pieces of their
    #                                own; the rest are spelled in bytes (lossless). Lower it for small vocabularies
    #                                over many scripts (2,048 pieces over text with CJK passages: 0.99)
    d.tokenizer_size = 0  # 0: any tokenizer of at most model.vocab_size tokens; else the exact number of tokens
    #                       (added tokens included) the tokenizer must have: paper configs pin their tokenizers
    # The pipeline's special ids (data/tokenizer.py): each document is packed as [bos] + ids + [eos]; pad fills
    # only positions masked out of the loss, so it may equal eos. '' = the tokenizer's own: a SentencePiece
    # model's pieces; a tokenizer.json's declared bos/eos/pad, and a lone special token such as GPT-2's
    # <|endoftext|> serves as all three. Else a token of its vocabulary, e.g. --config.data.pad_token='<pad>'.
    # The resolved ids are part of the tokenizer's fingerprint (and travel into export bundles).
    d.bos_token = ""
    d.eos_token = ""
    d.pad_token = ""
    d.seq_len = 128
    d.global_batch_size = 16
    d.shuffle_seed = 0
    d.worker_count = -1  # processes building batches: -1 = half the host's cores (1..16); 0 = a thread
    #                      of the training process. Batches do not depend on it (data/packing.py).
    d.prefetch_buffer = 8  # batches each worker (or the builder thread) keeps ready

    c.train = t = ml_collections.ConfigDict()
    t.seed = 0
    t.num_steps = 1000
    t.max_steps_per_run = 0  # stop this invocation after so many steps (0 = no limit); rerun resumes
    t.learning_rate = 1e-3
    t.warmup_steps = 100
    t.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio
    t.weight_decay = 0.1  # AdamW, decoupled; on weight matrices only (every Linear kernel, an untied head
    #                       included), never on embeddings, norms or biases (model/roles.py)
    t.b1 = 0.9
    t.b2 = 0.95
    t.eps = 1e-8
    t.grad_clip_norm = 1.0  # 0 disables clipping
    t.fgram_model_delay_steps = 0  # SCONE: the f-gram model's updates are 0 for steps 1..D (D = this), then
    #                       ramp linearly, D+k getting k/D, to full from step 2D on (0 = the method's joint
    #                       training from step 1; docs/training.md). Switching between 0 and > 0 on resume is refused.
    t.fgram_model_delay_steps_per_layer = 0  # the same delay scaled with the f-gram model's depth: D = this x
    #                       scone.num_layers (so 20 gives a 1-, 2-, 4-block f-gram model D = 20, 40, 80);
    #                       0 = off. At most one of the two delay keys may be > 0.
    t.grad_accum_steps = 1  # micro-batches per step; must divide the rows per data shard (and, with
    #                         SCONE, scone.fgram_capacity, which is split evenly across micro-batches)
    t.log_every = 10
    t.eval_every = 100  # 0 disables periodic evaluation
    t.eval_batches = 0  # 0 = the whole held-out set
    t.checkpoint_every = 100
    t.keep_checkpoints = 3
    t.peak_flops_per_device = 0.0  # for MFU; 0 = look up the device kind (CPU: measured)
    t.profile_steps = ""  # 'START:END': a jax.profiler trace of those steps into <workdir>/profile (training/profile.py)
    t.profile_all_processes = False  # trace on every process, not only process 0
    t.compilation_cache_dir = "compilation_cache"  # JAX's persistent compilation cache, so a restart loads the
    #                       compiled steps (and the traced train step, training/exported_step.py): relative =
    #                       inside the workdir, absolute or gs:// as is, '' = off (runtime/compile_cache.py)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: all devices not used by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    return c


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Load `path/to/config.py[:arg]` the way `--config` does (for tools and tests)."""
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise FileNotFoundError(f"Config file {path!r} not found; pass e.g. configs/tiny.py.")
    spec_obj = importlib.util.spec_from_file_location("_scone_config", path)
    module = importlib.util.module_from_spec(spec_obj)
    try:
        spec_obj.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(f"Config file {path!r} does not parse: {e.msg} at line {e.lineno}. Fix: correct it.") from None
    except Exception as e:  # noqa: BLE001 - any error of the file's own code, in one line
        raise ValueError(f"Config file {path!r} fails when loaded: {type(e).__name__}: {e}. Fix: correct it.") from None
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"Config file {path!r} defines no get_config(arg). Fix: define one that returns the config "
                         "(see configs/tiny.py).")
    try:
        return module.get_config(arg or None)
    except ValueError:
        raise  # the config's own message (e.g. an unknown variant): already says what to pass
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"Config file {path!r}: get_config({arg or None!r}) failed: {type(e).__name__}: {e}. "
                         "Fix: correct the config file.") from None


def load_beside(config_file: str, name: str):
    """The Python module `name` in the directory of `config_file` (a config's `__file__`), loaded by
    path: --config loads config files by path, not as a package, so their shared helpers
    (configs/common.py) cannot be imported by name from every working directory."""
    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), name)
    spec = importlib.util.spec_from_file_location(f"_scone_config_{os.path.splitext(name)[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unknown_key_message(config: ml_collections.ConfigDict, dotted: str) -> str | None:
    """Explain a bad `--config.a.b` override (which part is unknown, what is valid there);
    None if the key exists."""
    node, parts = config, dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            where = ".".join(parts[:i]) or "config"
            valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            return f"Unknown config key {dotted!r}: {where} has no field {part!r}. Valid keys there: {valid}"
        node = node[part]
    return None


def apply_override(config: ml_collections.ConfigDict, item: str, flag: str = "--override", joint: str = "=") -> None:
    """Set one KEY=VALUE of a tool's `flag` (tools/trace_steps.py's --override=KEY=VALUE; `joint` "." for
    --config.KEY=VALUE) on the unlocked `config`, VALUE read as the key's current type; a bad item is a
    ValueError naming the flag as written and the fix."""
    key, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"{flag}{joint}{item} has no '='. Fix: write KEY=VALUE, e.g. {flag}{joint}train.seed=1.")
    unknown = unknown_key_message(config, key)
    if unknown:
        raise ValueError(f"{flag}{joint}{item}: {unknown}")
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    old = node[leaf]
    if isinstance(old, ml_collections.ConfigDict):
        raise ValueError(f"{flag}{joint}{item}: {key} is a group of keys. Fix: set one of them, e.g. "
                         f"{flag}{joint}{key}.{sorted(old.keys())[0]}=VALUE.")
    if isinstance(old, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{flag}{joint}{item}: {key} is true or false, not {value!r}.")
        node[leaf] = value.lower() in ("true", "1")
        return
    try:
        node[leaf] = type(old)(value)
    except (TypeError, ValueError):
        kind = {int: "an integer", float: "a number"}.get(type(old), type(old).__name__)
        raise ValueError(f"{flag}{joint}{item}: {key} takes {kind} (it is {old!r} now), not {value!r}.") from None


def override_flag_error(argv, config: ml_collections.ConfigDict) -> str | None:
    """Why argv's --config.KEY=VALUE flags do not fit `config` (a tool whose --config is a fixed config's
    keys: tools/bench_quality.py), in apply_override's one line; None if they all do."""
    trial = config.copy_and_resolve_references()
    with trial.unlocked():
        for arg in argv:
            if arg.startswith("--config."):
                try:
                    apply_override(trial, arg[len("--config."):], flag="--config", joint=".")
                except ValueError as e:
                    return str(e)
    return None


def config_flag_error(argv) -> str | None:
    """Why `--config=...`/`--config.*` flags in argv failed to parse, in one line (for CLIs)."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return None
    try:
        base = load_config_file(spec)
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    overrides = [a.split("=", 1)[0][len("--config."):] for a in argv if a.startswith("--config.")]
    return next(filter(None, (unknown_key_message(base, key) for key in overrides)), None)


# Numeric keys and the values they accept; `validate` names the key and the rule when one is broken.
# "-1 | >= 1" accepts -1 (automatic) or any value of at least 1.
NUMERIC_RULES = {
    "model.vocab_size": ">= 0", "model.d_model": ">= 1", "model.num_layers": ">= 1", "model.num_heads": ">= 1",
    "model.head_dim": ">= 0", "model.d_ff": ">= 1", "model.max_seq_len": ">= 1", "model.rope_theta": "> 0",
    "model.init_std": "> 0", "model.embedding_multiplier": "> 0",
    "scone.max_len": ">= 2", "scone.num_fgrams": ">= 1", "scone.min_count": ">= 1",
    "scone.extract_max_tokens": ">= 1", "scone.fgram_capacity": ">= 1", "scone.num_layers": ">= 1",
    "scone.d_model": ">= 0", "scone.num_heads": ">= 0", "scone.d_ff": ">= 0",
    "scone.input_multiplier": "> 0", "scone.learning_rate_multiplier": "> 0",
    "data.eval_fraction": "in (0, 1)", "data.vocab_size": ">= 1", "data.tokenizer_size": ">= 0",
    "data.character_coverage": "in (0, 1]", "data.seq_len": ">= 1",
    "data.global_batch_size": ">= 1", "data.worker_count": ">= -1", "data.prefetch_buffer": ">= 1",
    "train.num_steps": ">= 1", "train.max_steps_per_run": ">= 0", "train.learning_rate": "> 0",
    "train.warmup_steps": ">= 0", "train.min_lr_ratio": "in [0, 1]", "train.weight_decay": ">= 0",
    "train.b1": "in [0, 1)", "train.b2": "in [0, 1)", "train.eps": "> 0", "train.grad_clip_norm": ">= 0",
    "train.fgram_model_delay_steps": ">= 0", "train.fgram_model_delay_steps_per_layer": ">= 0",
    "train.grad_accum_steps": ">= 1", "train.log_every": ">= 1", "train.eval_every": ">= 0",
    "train.eval_batches": ">= 0", "train.checkpoint_every": ">= 1", "train.keep_checkpoints": ">= 1",
    "train.peak_flops_per_device": ">= 0",
    "mesh.data": "-1 | >= 1", "mesh.fsdp": "-1 | >= 1", "mesh.tensor": "-1 | >= 1",
}
_RULE_TESTS = {
    ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, ">= 2": lambda v: v >= 2, "> 0": lambda v: v > 0,
    ">= -1": lambda v: v >= -1, "-1 | >= 1": lambda v: v == -1 or v >= 1,
    "in (0, 1)": lambda v: 0 < v < 1, "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
}
_RULE_HINTS = {
    "train.keep_checkpoints": " (the number of checkpoints kept; a run must never end without one)",
    "train.checkpoint_every": " (steps between checkpoints; the last step is always saved)",
    "train.log_every": " (steps between log lines)",
    "train.grad_accum_steps": " (1 = no accumulation)",
    "scone.learning_rate_multiplier": " (the f-gram model's learning rate over train.learning_rate; 1 = the same)",
    "data.tokenizer_size": " (0 = any tokenizer that fits model.vocab_size)",
    "data.worker_count": " (-1 = half the cores, 0 = a thread of the training process)",
    "mesh.data": " (-1 = all devices the other axes leave)", "mesh.fsdp": " (-1 = all devices the other axes leave)",
    "mesh.tensor": " (-1 = all devices the other axes leave)",
}


def _check_numbers(config: ml_collections.ConfigDict) -> None:
    for key, rule in NUMERIC_RULES.items():
        section, name = key.split(".")
        value = config[section][name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _RULE_TESTS[rule](value):
            raise ValueError(f"{key}={value!r} is not valid: it must be {rule}{_RULE_HINTS.get(key, '')}.")


def _check_special_tokens(d: ml_collections.ConfigDict) -> None:
    """data.bos_token/eos_token/pad_token are token strings; whether the tokenizer has them is checked when it
    loads (data/tokenizer.py), with the same key named."""
    for role in ("bos", "eos", "pad"):
        value = d.get(f"{role}_token", "")
        if not isinstance(value, str):
            raise ValueError(f"data.{role}_token={value!r} is not valid: it must be '' (the tokenizer's own) or the "
                             f"spelling of one token of its vocabulary, e.g. --config.data.{role}_token='<|endoftext|>'.")


def _check_fgram_training(config: ml_collections.ConfigDict) -> None:
    """The f-gram model's own settings mean nothing without one (a baseline run), and the delay has one value."""
    s, t = config.scone, config.train
    if not s.enabled:
        for key, value, default in (("learning_rate_multiplier", s.learning_rate_multiplier, 1.0),
                                    ("gate", s.gate, False)):
            if value != default:
                raise ValueError(f"scone.{key}={value!r} is set on a run without SCONE (scone.enabled=False): it "
                                 "applies to the f-gram model only. Fix: set --config.scone.enabled=True, or leave "
                                 f"scone.{key} at {default!r}.")
    if t.fgram_model_delay_steps and t.fgram_model_delay_steps_per_layer:
        raise ValueError(f"train.fgram_model_delay_steps={t.fgram_model_delay_steps} and "
                         f"train.fgram_model_delay_steps_per_layer={t.fgram_model_delay_steps_per_layer} are both set; "
                         "they are two ways to give the one delay. Fix: set one of them to 0.")


def validate(config: ml_collections.ConfigDict) -> None:
    """Every numeric key's range (NUMERIC_RULES), then cross-field checks that ml_collections
    cannot express; each error names the key and says the fix."""
    _check_numbers(config)
    m, d, t = config.model, config.data, config.train
    _check_special_tokens(d)
    _check_fgram_training(config)
    eval_sets.parse(d.eval_files)  # named held-out sets: a set without files or a name used twice
    mixture.parse(d.train_files)  # a training mixture: a component without files, a bad weight, a name used twice
    if t.profile_steps:
        start, sep, end = t.profile_steps.partition(":")
        if not (sep and start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
            raise ValueError(f"train.profile_steps={t.profile_steps!r} is not START:END with 1 <= START <= END "
                             "(steps, 1-based, inclusive). Fix: e.g. --config.train.profile_steps=10:15, or '' for none.")
        if int(end) > t.num_steps:  # the run never reaches it (a start that only misses it is warned about)
            raise ValueError(f"train.profile_steps={t.profile_steps!r} ends after train.num_steps={t.num_steps}: the "
                             f"run never reaches step {end}. Fix: a range within 1:{t.num_steps}, or '' for none.")
    if m.d_model % m.num_heads and not m.head_dim:
        raise ValueError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; set model.head_dim.")
    if m.position == "learned" and d.seq_len > m.max_seq_len:
        raise ValueError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len.")
    if d.global_batch_size % t.grad_accum_steps:
        raise ValueError(
            f"data.global_batch_size={d.global_batch_size} is not divisible by "
            f"train.grad_accum_steps={t.grad_accum_steps}."
        )


def validate_batch_split(config: ml_collections.ConfigDict, num_batch_shards: int) -> None:
    """Checks that need the mesh: the global batch splits into data shards, each shard's rows
    into train.grad_accum_steps micro-batches and (SCONE) its f-gram capacity likewise."""
    d, accum = config.data, config.train.grad_accum_steps
    if d.global_batch_size % num_batch_shards:
        raise ValueError(
            f"data.global_batch_size={d.global_batch_size} does not split over the {num_batch_shards} data "
            f"shards of the mesh (mesh.data x mesh.fsdp). Fix: use a multiple of {num_batch_shards}."
        )
    rows = d.global_batch_size // num_batch_shards
    if rows % accum:
        works = [a for a in range(1, rows + 1) if rows % a == 0]
        raise ValueError(
            f"train.grad_accum_steps={accum} does not divide the {rows} rows per data shard "
            f"(data.global_batch_size={d.global_batch_size} over {num_batch_shards} shards); micro-batches "
            f"take equal blocks of every shard. Values that work: {', '.join(map(str, works))}."
        )
    capacity = config.scone.fgram_capacity
    if config.scone.enabled and capacity % accum:
        lower = capacity // accum * accum
        choices = f"{lower} or {lower + accum}" if lower else f"{accum}"
        raise ValueError(
            f"scone.fgram_capacity={capacity} (f-gram rows per data shard and step) does not split into "
            f"train.grad_accum_steps={accum} equal micro-batches. Fix: use a multiple of {accum}, e.g. {choices}."
        )


# What a checkpoint's state and the batches after it mean: resuming with another value of any of
# these is refused (train.run), unless named in --allow_config_change. Everything else (learning-rate
# schedule, optimizer constants, mesh, attention implementation, remat, scan_layers (converted on
# restore), compute dtype, evaluation, logging) may change between runs, but for the f-gram model's
# learning-rate multiplier: a run trained at two ratios of the rates would be neither experiment's.
# The tokenizer and the f-gram vocabulary are pinned by their fingerprints instead of their paths, so
# moved files still resume.
RESUME_KEYS = (
    "model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads", "model.head_dim", "model.d_ff",
    "model.max_seq_len", "model.norm", "model.mlp", "model.position", "model.rope_theta", "model.use_bias",
    "model.tie_embeddings", "model.param_dtype", "model.embedding_multiplier",
    "scone.enabled", "scone.max_len", "scone.num_fgrams", "scone.min_count", "scone.extract_max_tokens",
    "scone.fgram_capacity", "scone.num_layers", "scone.d_model", "scone.num_heads", "scone.d_ff",
    "scone.output_gain_init", "scone.input_multiplier", "scone.output_norm", "scone.learning_rate_multiplier",
    "scone.gate",
    "data.source", "data.train_files", "data.text_field", "data.document_unit", "data.eval_fraction",
    "data.seq_len", "data.global_batch_size", "data.shuffle_seed",
)


def resume_changes(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
    """'key: saved -> now' for every RESUME_KEYS value that differs from the saved config (a plain
    dict, as checkpoints store it); keys the saved config predates are not compared."""
    changes = []
    for key in RESUME_KEYS:
        section, name = key.split(".")
        if section == "scone" and name != "enabled" and not config.scone.enabled:
            continue  # the f-gram settings of a run without f-grams mean nothing
        if name in saved.get(section, {}) and saved[section][name] != config[section][name]:
            changes.append(f"{key}: {saved[section][name]!r} -> {config[section][name]!r}")
    return changes


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Write the resolved config next to the checkpoints (local or gs://), for humans and for restarts."""
    storage.write_bytes(workdir, workdir_layout.CONFIG, to_json(config).encode())

