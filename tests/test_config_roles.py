"""Every config key's class (config_keys.py: STATE, SETTING or LOOP), checked key by key against what the key does.

What each class promises: STATE keys are refused on resume (the checkpoint's arrays, their meaning or the data stream
follow them); SETTING keys may change on resume and are in the exported train step's key (the traced step reads
them, or they shape what a run computes from its start, so the study compares runs by them); LOOP keys may change
on resume, are left out of the exported step's key and of the study's comparisons: the traced step never reads
them and a run's training does not depend on them.

WHY below states, for every declared key, which of those it is and why. A key added to config_keys.py without a row
here fails test_every_key_has_a_stated_reason until its author adds one. The claims that can be measured are
measured: a "shape" key changes the train state's arrays, a "step" key changes the traced train step, and the
"loop" and "start" keys, changed all together, leave the traced step identical."""
import copy

import jax
import numpy as np
import pytest
from flax import nnx

from scone_jax import config_keys, sharding
from scone_jax.training import state as state_lib, steps

STATE, SETTING, LOOP = config_keys.STATE, config_keys.SETTING, config_keys.LOOP
# A reason's kind, and the class it requires.
KINDS = {
    "shape": STATE,    # the train state's arrays (structure, shapes, dtypes) follow it: a checkpoint of another fits not
    "meaning": STATE,  # the same arrays mean another model under another value: the weights were fitted to it
    "data": STATE,     # the batches (documents, order, layout) or the f-gram vocabulary follow it: another data stream
    "step": SETTING,   # the traced train step reads it (schedule, optimizer, numerics, layout): it may change, retraced
    "start": SETTING,  # read where a run starts (initial weights, tokenizer, vocabulary; a resume keeps what the
    #                    checkpoint pinned), never by the step; another value is another experiment: not LOOP
    "loop": LOOP,      # the loop's cadence, paths and switches: neither the step nor the training reads it
    "padding": SETTING,  # the batches' static shapes follow it, not their values (padded rows): retraced, same result
}
WHY = {
    "model.vocab_size": ("shape", "the token table's rows and the head's columns"),
    "model.d_model": ("shape", "every weight's width"),
    "model.num_layers": ("shape", "the stacked blocks' leading axis"),
    "model.num_heads": ("meaning", "how the attention projections split into heads (head_dim 0: same arrays)"),
    "model.head_dim": ("shape", "the attention projections' head width"),
    "model.d_ff": ("shape", "the MLP's hidden width"),
    "model.max_seq_len": ("shape", "the learned position table's rows"),
    "model.norm": ("shape", "rmsnorm has no bias; nonparametric none at all"),
    "model.mlp": ("shape", "SwiGLU has a gate projection GELU has not"),
    "model.position": ("shape", "learned positions are a table, RoPE has none"),
    "model.rope_theta": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.use_bias": ("shape", "the biases exist or not"),
    "model.tie_embeddings": ("shape", "an untied head is a matrix of its own"),
    "model.init_std": ("start", "the initial weights only"),
    "model.dtype": ("step", "the step's compute dtype"),
    "model.param_dtype": ("shape", "the master weights' dtype"),
    "model.embedding_multiplier": ("meaning", "the scale of the input rows the weights were fitted to"),
    "model.scan_layers": ("step", "the step's loop over blocks (a checkpoint of the other layout is converted)"),
    "model.remat": ("step", "what the step's backward pass recomputes"),
    "model.attention": ("step", "the step's attention kernel"),
    "model.num_kv_heads": ("shape", "the key and value projections' width"),
    "model.qk_norm": ("shape", "the per-head q/k norm scales exist or not"),
    "model.norm_eps": ("meaning", "the normalisation the weights were fitted to"),
    "model.rope_scaling": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.rope_scaling_factor": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.rope_low_freq_factor": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.rope_high_freq_factor": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.rope_original_max_len": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.rope_beta_fast": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.rope_beta_slow": ("meaning", "the rotation frequencies the attention weights were fitted to"),
    "model.init_from_hf": ("start", "the initial weights a fresh run reads; a resume keeps the checkpoint's"),
    "scone.enabled": ("shape", "the f-gram model exists or not"),
    "scone.vocab_path": ("start", "where the vocabulary is read at a fresh start; pinned by its fingerprint"),
    "scone.max_len": ("data", "K: the f-grams extracted and matched in every batch"),
    "scone.num_fgrams": ("data", "S: the f-grams extracted, so the matches in every batch"),
    "scone.min_count": ("data", "the f-grams extracted"),
    "scone.extract_max_tokens": ("data", "the text the f-grams are extracted from"),
    "scone.fgram_capacity": ("padding", "the f-gram rows per shard the step runs; the values at any capacity that "
                                        "holds them are the same (unused rows are padding: fgram/dedup.py)"),
    "scone.num_layers": ("shape", "the f-gram model's blocks"),
    "scone.d_model": ("shape", "the f-gram model's width and its projections"),
    "scone.num_heads": ("meaning", "how the f-gram model's projections split into heads (same arrays)"),
    "scone.d_ff": ("shape", "the f-gram model's MLP width"),
    "scone.output_gain_init": ("shape", "the learned gain exists from > 0"),
    "scone.input_multiplier": ("meaning", "the scale of the f-gram model's input it was fitted to"),
    "scone.output_norm": ("shape", "the f-gram model's final norm exists or not"),
    "scone.learning_rate_multiplier": ("meaning", "a run trained at two ratios of the rates is neither experiment"),
    "scone.gate": ("shape", "the learned gate exists or not"),
    "scone.combine": ("meaning", "the same arrays give the decoder another input: f, or T(token) + f"),
    "scone.output_projection_init": ("start", "the projection's initial weights only"),
    "scone.row_scale": ("meaning", "the same arrays give the decoder rows at another scale"),
    "scone.output_ramp_steps": ("shape", "the ramp's state variable exists from > 0"),
    "scone.init_from_hf": ("start", "the f-gram model's initial weights a fresh run reads; a resume keeps the "
                                    "checkpoint's (scone.source_model pins the architecture)"),
    "scone.source_model": ("shape", "the f-gram model's blocks take the source's kind (RoPE: no position table)"),
    "scone.own_token_embedding": ("shape", "the f-gram model's own token table exists or not"),
    "scone.max_source_params": ("loop", "a check of the source before a fresh start; nothing trains by it"),
    "scone.gate_learning_rate_multiplier": ("meaning", "a gate trained at two rates is neither experiment"),
    "overencoding.enabled": ("shape", "the n-gram tables and their projection exist or not"),
    "overencoding.n": ("shape", "k(n-1) tables: their number"),
    "overencoding.k": ("shape", "k(n-1) tables: their number and width"),
    "overencoding.m": ("shape", "the tables' rows, m + 2s + 1 each"),
    "engram.enabled": ("shape", "the Engram modules exist or not"),
    "engram.layers": ("shape", "one module per listed block: their number"),
    "engram.n": ("shape", "(n-1) x heads tables per module, and W_K's and W_V's rows"),
    "engram.heads": ("shape", "(n-1) x heads tables per module, and W_K's and W_V's rows"),
    "engram.head_width": ("shape", "the tables' width, and W_K's and W_V's rows"),
    "engram.rows": ("shape", "the tables' rows, the primes from rows on"),
    "engram.kernel_size": ("shape", "the convolution's taps"),
    "engram.dilation": ("meaning", "the same taps read other positions"),
    "engram.seed": ("meaning", "the hash's multipliers: every n-gram reads other rows"),
    "engram.compress_tokens": ("meaning", "the hash reads other token ids: every n-gram reads other rows"),
    "engram.init_std": ("start", "the initial weights only"),
    "data.source": ("data", "where the documents come from"),
    "data.train_files": ("data", "the training documents"),
    "data.mixture": ("data", "the training documents and the order of their rows"),
    "data.eval_files": ("loop", "what the loop evaluates on, never trains on"),
    "data.eval_sets": ("loop", "what the loop evaluates on, never trains on"),
    "data.text_field": ("data", "the text of each jsonl document"),
    "data.document_unit": ("data", "what a document is"),
    "data.messages_field": ("data", "the messages of each conversation"),
    "data.chat_template": ("data", "the text (and so the tokens) each conversation renders as"),
    "data.loss_on": ("data", "the batches' loss mask: which tokens are trained on"),
    "data.overlong": ("data", "which conversations (and how much of them) the rows hold"),
    "data.eval_fraction": ("data", "which kjv documents are held out of training"),
    "data.tokenizer_path": ("start", "the tokenizer a fresh run takes; pinned by its fingerprint"),
    "data.vocab_size": ("start", "the tokenizer a fresh run trains"),
    "data.tokenizer_size": ("start", "a check of the tokenizer a fresh run takes"),
    "data.character_coverage": ("start", "the tokenizer a fresh run trains"),
    "data.bos_token": ("start", "the special ids, part of the tokenizer's fingerprint"),
    "data.eos_token": ("start", "the special ids, part of the tokenizer's fingerprint"),
    "data.pad_token": ("start", "the special ids, part of the tokenizer's fingerprint"),
    "data.add_bos": ("data", "each document's positions: [bos] + ids, or the ids alone"),
    "data.seq_len": ("data", "the rows' length"),
    "data.global_batch_size": ("data", "the rows per step: which documents each step sees"),
    "data.shuffle_seed": ("data", "the order of the documents"),
    "data.worker_count": ("loop", "who builds the batches; the batches do not depend on it (data/packing.py)"),
    "data.prefetch_buffer": ("loop", "how many batches wait"),
    "train.seed": ("start", "the initial weights only"),
    "train.num_steps": ("step", "the learning-rate schedule's length"),
    "train.max_steps_per_run": ("loop", "where this invocation stops; the next resumes"),
    "train.learning_rate": ("step", "the schedule's peak"),
    "train.warmup_steps": ("step", "the schedule's warm-up"),
    "train.min_lr_ratio": ("step", "the schedule's floor"),
    "train.weight_decay": ("step", "AdamW's update"),
    "train.b1": ("step", "AdamW's update"),
    "train.b2": ("step", "AdamW's update"),
    "train.eps": ("step", "AdamW's update"),
    "train.grad_clip_norm": ("step", "the clipping of the gradient"),
    "train.fgram_model_delay_steps": ("step", "the f-gram model's update scale per step"),
    "train.fgram_model_delay_steps_per_layer": ("step", "the f-gram model's update scale per step"),
    "train.fgram_model_delay_fraction": ("step", "the f-gram model's update scale per step"),
    "train.grad_accum_steps": ("step", "the micro-batches the step splits each batch into"),
    "train.log_every": ("loop", "how often the loop logs"),
    "train.eval_every": ("loop", "how often the loop evaluates"),
    "train.eval_batches": ("loop", "how much of the held-out set the loop evaluates"),
    "train.checkpoint_every": ("loop", "how often the loop saves"),
    "train.keep_checkpoints": ("loop", "how many saves are kept"),
    "train.peak_flops_per_device": ("loop", "the MFU the loop logs"),
    "train.profile_steps": ("loop", "which steps the loop traces for a profile"),
    "train.profile_all_processes": ("loop", "which processes trace them"),
    "train.compilation_cache_dir": ("loop", "where compiled programs are kept"),
    "mesh.data": ("step", "the mesh: the step's shardings"),
    "mesh.fsdp": ("step", "the mesh: the step's shardings"),
    "mesh.tensor": ("step", "the mesh: the step's shardings"),
}

# Another value for a key where a step or a doubling of its own would not do (a valid mesh needs a free axis).
_OTHER = {"model.norm": "rmsnorm", "model.mlp": "swiglu", "model.position": "rope", "model.dtype": "bfloat16",
          "model.param_dtype": "bfloat16", "model.remat": "full", "model.attention": "reference",
          "model.num_heads": 2, "model.head_dim": 32, "scone.num_heads": 2, "scone.d_model": 32,
          "train.profile_steps": "1:2", "data.eval_sets": {"web": "/d/web/*.jsonl"},
          "scone.source_model": '{"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "use_bias": false}',
          "overencoding.n": 5, "overencoding.m": 4097,  # k(n-1) must divide d; m + 2s past a 128-row multiple
          "engram.layers": "0,1"}
_MESH_BASE = {"mesh.data": {"mesh.data": 2, "mesh.fsdp": -1}, "mesh.fsdp": {"mesh.fsdp": 2},
              "mesh.tensor": {"mesh.tensor": 2}}


def _other(name, value):
    if name in _OTHER:
        return _OTHER[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value > 0 else 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    return value + "-changed"


def _with(config, changes: dict):
    changed = copy.deepcopy(config)
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        changed[section][key] = value
    return changed


def _changed(config, name):
    section, key = name.split(".")
    return _with(config, {name: _other(name, config[section][key])})


def _scone_config():
    from tests.common import small_config

    config = small_config(num_layers=1)
    config.scone.update(dict(enabled=True, max_len=4, fgram_capacity=48, num_layers=1))
    return config


def test_every_key_has_a_stated_reason_and_its_class_is_the_one_the_reason_requires():
    """Caught: train.max_steps_per_run declared SETTING (the reason says loop: job slots retraced the step and
    split the study's seeds); a key added to config_keys.py without a row here (the message names it)."""
    declared = [key.name for key in config_keys.KEYS]
    missing = [name for name in declared if name not in WHY]
    assert not missing, (f"{missing} have no row in tests/test_config_roles.py's WHY: add one per key, stating whether "
                         "its change reshapes the train state, changes its meaning or the data stream (STATE), is read "
                         "by the traced step or where a run starts (SETTING), or is the loop's own (LOOP), and why.")
    assert sorted(WHY) == sorted(declared), f"rows for keys config_keys.py no longer declares: {set(WHY) - set(declared)}"
    names = {STATE: "STATE", SETTING: "SETTING", LOOP: "LOOP"}
    wrong = [f"{name} is {names[config_keys.BY_NAME[name].role]}, its reason ({kind}: {why}) requires "
             f"{names[KINDS[kind]]}" for name, (kind, why) in WHY.items() if config_keys.BY_NAME[name].role != KINDS[kind]]
    assert wrong == []


def _oe_config():
    from tests.common import small_config

    config = small_config(num_layers=1)
    config.overencoding.update(dict(enabled=True, n=3, k=2, m=1001))
    return config


def _engram_config():
    from tests.common import small_config

    config = small_config(num_layers=2)
    config.engram.update(dict(enabled=True, layers="1", n=3, heads=2, head_width=8, rows=101))
    return config


@pytest.mark.slow  # 10-13 s: the fast tier stays under 5 minutes
def test_a_shape_key_changes_the_train_states_arrays():
    """Each "shape" key changed alone gives the SCONE train state other arrays (built abstractly, as a resume
    would; Over-Encoding's and Engram's keys on a state that has them); a "meaning" key does not, which is why its
    reason is not the shape. Caught: scone.output_norm's row given as "meaning" (the probe saw the final norm's
    arrays go)."""
    config, oe, en = _scone_config(), _oe_config(), _engram_config()

    def arrays(c):
        abstract = nnx.eval_shape(lambda: state_lib._create(c))[1]
        return jax.tree.structure(abstract), [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]

    bases = {"overencoding": (oe, arrays(oe)), "engram": (en, arrays(en))}
    default = (config, arrays(config))

    def probe(name):
        start, base = bases.get(name.split(".")[0], default)
        return arrays(_changed(start, name)) != base

    assert [name for name, (kind, _) in WHY.items() if kind == "shape" and not probe(name)] == []
    assert [name for name, (kind, _) in WHY.items() if kind == "meaning" and probe(name)] == []


def _traced(config) -> str:
    """The train step's jaxpr for `config` over its own mesh, state and the shapes of a production batch made for
    its micro-batches."""
    from tests.scone_batches import production_batch

    host = production_batch(num_shards=8, capacity=48, micro_batches=config.train.grad_accum_steps)[0].for_device()
    mesh = sharding.make_mesh(config.mesh)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                                        sharding=sharding.batch_sharding(mesh)), host)
    spec = state_lib.state_spec(config, mesh)
    with jax.set_mesh(mesh):
        return str(jax.jit(steps.train_step_fn(spec.graphdef, mesh, config)).trace(
            state_lib.abstract_with_shardings(spec), batch).jaxpr)


@pytest.mark.slow  # traces the SCONE train step ~20 times: ~40 s on 2 busy cores
def test_the_traced_step_follows_the_step_keys_and_no_loop_or_start_key():
    """Every "step" key changed alone changes the traced SCONE train step; every "loop" key, changed all together,
    leaves it identical, and so do the "start" keys (kept in the exported step's key all the same: a needless
    retrace at most). Caught: model.attention's row given as "start" (the step's kernel changed), and
    train.eval_batches declared SETTING with a "step" row (the trace did not change)."""
    config = _scone_config()
    base = _traced(config)
    for kind in ("loop", "start"):
        together = {}
        for name, (k, _) in WHY.items():
            if k == kind:
                section, key = name.split(".")
                together[name] = _other(name, config[section][key])
        assert _traced(_with(config, together)) == base, kind
    unchanged = []
    for name, (kind, _) in WHY.items():
        if kind != "step":
            continue
        if name in _MESH_BASE:  # one axis alone cannot change a full mesh: compare two meshes that differ in it
            start = _with(config, _MESH_BASE[name])
            before = _traced(start)
            section, key = name.split(".")
            after = _traced(_with(start, {name: start[section][key] * 2}))
        else:
            before, after = base, _traced(_changed(config, name))
        if before == after:
            unchanged.append(name)
    assert unchanged == []
