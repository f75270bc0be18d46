"""Every config key declared once (scone_jax/config_keys.py) and the lists derived from the declarations:
base_config's defaults, the resume check, the exported train step's key and the checkpointer's optimizer fix,
each with real keys and values."""
import copy

import jax
import numpy as np
import pytest
from flax import nnx

from scone_jax import config as config_lib, config_keys, sharding
from scone_jax.config_keys import KEYS
from scone_jax.training import exported_step, state as state_lib
from tests.common import small_config

# Another value of a key where one step or a doubling would not build a model (the rest: _other).
_OTHER = {"model.num_heads": 2, "model.head_dim": 32, "model.norm": "rmsnorm", "model.mlp": "swiglu",
          "model.position": "rope", "model.dtype": "bfloat16", "model.param_dtype": "bfloat16", "model.remat": "full",
          "model.attention": "xla", "scone.num_heads": 2, "scone.d_model": 32, "scone.max_len": 3}


# A group's other value: one entry (config_keys.Group).
_GROUPS = {"data.mixture": {"web": {"files": "/d/web/*.jsonl", "weight": 1.0, "order": 0}},
           "data.eval_sets": {"web": "/d/web/*.jsonl"}}


def _other(name, value):
    if name in _OTHER:
        return _OTHER[name]
    if name in _GROUPS:
        return _GROUPS[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value > 0 else 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    return value + "-changed"


def _changed(config, name):
    """A copy of `config` with `name` at another value; (copy, old, new)."""
    changed = copy.deepcopy(config)
    section, key = name.split(".")
    old = config[section][key]
    changed[section][key] = _other(name, old)
    new = changed[section][key]
    return (changed, *(v.to_dict() if hasattr(v, "to_dict") else v for v in (old, new)))


def _scone_config():
    config = small_config(num_layers=1)
    config.scone.update(dict(enabled=True, max_len=4, fgram_capacity=48, num_layers=1))
    return config


def _oe_config():
    """Over-Encoding's keys are probed on a run that has it (a SCONE run ignores them, as a plain one ignores scone.*)."""
    config = small_config(num_layers=1)
    config.overencoding.update(dict(enabled=True, n=3, k=2, m=1001))
    return config


def _engram_config():
    """Engram's keys likewise, on a run that has it."""
    config = small_config(num_layers=2)
    config.engram.update(dict(enabled=True, layers="1", n=3, heads=2, head_width=8, rows=101))
    return config


def test_base_config_holds_each_declared_key_once_at_its_default():
    """base_config() is the declarations: the same keys, each once, at its default and of its type; and every
    declared range is one validate() knows. Caught: a key declared twice (train.b2 again with 0.999, which
    base_config took silently)."""
    names = [key.name for key in KEYS]
    assert len(names) == len(set(names))
    config = config_lib.base_config()
    assert sorted(f"{section}.{key}" for section in config for key in config[section]) == sorted(names)
    for key in KEYS:
        section, name = key.name.split(".")
        if isinstance(key.default, config_keys.Group):  # a fresh, empty group of its own
            assert config[section][name].to_dict() == {} and key.name in config_keys.GROUPS, key.name
            assert config[section][name] is not config_lib.base_config()[section][name]
            continue
        assert config[section][name] == key.default and type(config[section][name]) is type(key.default), key.name
    assert (config.model.d_model, config.train.b2, config.data.worker_count, config.mesh.data) == (256, 0.95, -1, -1)
    assert set(config_lib.NUMERIC_RULES.values()) <= set(config_lib._RULE_TESTS)
    assert config_lib.NUMERIC_RULES["train.keep_checkpoints"] == ">= 1"
    assert config_keys.RULE_HINTS["train.keep_checkpoints"].startswith(" (the number of checkpoints kept")


def test_a_resume_that_changes_a_state_key_is_refused_naming_it_and_only_those():
    """Every declared key changed alone against a saved config: config.resume_changes names it (the resume is
    refused) exactly when its role is STATE, with the saved and the new value, e.g. 'model.d_model: 64 -> 128';
    a SETTING or LOOP key (the learning rate, the log cadence) resumes. Caught: RESUME_KEYS derived from the
    role's `program` instead of `resume` (a changed learning rate refused, a changed shuffle seed let through)."""
    config = _scone_config()
    saved = config.to_dict()
    assert config_lib.resume_changes(saved, config) == []
    refused = []
    for key in KEYS:
        base = (_oe_config() if key.name.startswith("overencoding.") else _engram_config()
                if key.name.startswith("engram.") else config)
        changed, old, new = _changed(base, key.name)
        changes = config_lib.resume_changes(base.to_dict(), changed)
        assert changes == ([f"{key.name}: {old!r} -> {new!r}"] if not key.role.resume else []), key.name
        refused += [key.name] if changes else []
    assert tuple(refused) == config_lib.RESUME_KEYS
    assert config_lib.resume_changes(saved, _changed(config, "model.d_model")[0]) == ["model.d_model: 64 -> 128"]
    assert {"data.shuffle_seed", "scone.learning_rate_multiplier", "model.param_dtype"} <= set(refused)
    assert not {"train.learning_rate", "train.log_every", "model.dtype", "mesh.fsdp"} & set(refused)


@pytest.mark.slow  # 10-13 s: the fast tier stays under 5 minutes
def test_a_key_that_reshapes_the_train_state_is_declared_so():
    """A key whose change gives the train state other arrays (structure, shapes or dtypes) must be a STATE key, or
    declare which switch of it reshapes the optimizer state (its checkpoint then fails the shape check with
    config_keys.optimizer_state_fix's advice naming it); model.scan_layers alone is converted on restore. Built
    for real (abstractly), key by key, with the SCONE model: every key a resume may change, and a few STATE keys
    to show the probe sees a change. Caught: model.param_dtype declared SETTING (a resume to bfloat16 master
    weights passed the config check, and the shape check compares shapes only); optimizer_state left off
    train.fgram_model_delay_steps_per_layer (the mismatch's advice named the other key alone)."""
    config = _scone_config()

    def arrays(c):  # the state's arrays as state_lib.state_spec builds them, without the shardings
        abstract = nnx.eval_shape(lambda: state_lib._create(c))[1]
        return jax.tree.structure(abstract), [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]

    base = arrays(config)
    probed = [key.name for key in KEYS if key.role.resume and key.name.split(".")[0] in ("model", "scone", "train")]
    probed += ["model.d_model", "scone.num_layers"]
    reshaping = {name for name in probed if arrays(_changed(config, name)[0]) != base}
    assert {"model.d_model", "scone.num_layers", "train.fgram_model_delay_steps", "model.scan_layers"} <= reshaping
    undeclared = [name for name in sorted(reshaping) if config_keys.BY_NAME[name].role.resume
                  and not config_keys.BY_NAME[name].optimizer_state and name != "model.scan_layers"]
    assert undeclared == []
    assert config_keys.optimizer_state_fix() == (
        "the optimizer settings the checkpoint was saved with (train.fgram_model_delay_steps or "
        "train.fgram_model_delay_steps_per_layer or train.fgram_model_delay_fraction switched between 0 and > 0 "
        "changes the optimizer's state)")


def test_the_exported_step_key_leaves_out_exactly_the_loop_keys():
    """Every declared key changed alone: the exported train step's entry name changes unless the key's role is LOOP
    (its declaration says the step never reads it), so a resume with another model width traces afresh and one
    with another log cadence loads the program. Caught: LOOP_ONLY_KEYS derived from `not role.resume` (the STATE
    keys left out of the key: a run with another model.d_model loaded the stale traced program)."""
    config = _scone_config()
    mesh = sharding.make_mesh(config.mesh)
    state = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharding.batch_sharding(mesh))}
    batch = {"inputs": jax.ShapeDtypeStruct((8, 16), np.int32, sharding=sharding.batch_sharding(mesh))}

    def name(c):
        return exported_step.entry_name(exported_step.key_material(c, mesh, state, batch))

    base = name(config)
    kept = [key.name for key in KEYS if name(_changed(config, key.name)[0]) == base]
    assert kept == [key.name for key in KEYS if not key.role.program] == list(exported_step.LOOP_ONLY_KEYS)
    assert {"data.eval_files", "train.log_every", "train.compilation_cache_dir"} <= set(kept)
    assert not {"model.d_model", "train.weight_decay", "train.num_steps", "data.seq_len"} & set(kept)


def test_a_config_saved_before_the_architecture_keys_reads_as_it_ran():
    """Checkpoints and bundles saved before model.num_kv_heads, qk_norm, norm_eps, the RoPE scaling keys and
    data.add_bos existed read today's defaults, which are what such runs did: as many key/value heads as query
    heads, no q/k norm, epsilon 1e-5 (layers.make_norm's old fixed value), unscaled RoPE, [bos] + ids. (The
    model's losses, gradients and cached decoding at these defaults were also compared, by hand, bit for bit
    with the code before the keys.) Caught: data.add_bos defaulting to False."""
    from scone_jax.saved_config import stored_config

    old = config_lib.base_config().to_dict()
    for name in ("num_kv_heads", "qk_norm", "norm_eps", "rope_scaling", "rope_scaling_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len", "rope_beta_fast",
                 "rope_beta_slow"):
        del old["model"][name]
    del old["data"]["add_bos"]
    config = stored_config(old)
    m = config.model
    assert (m.num_kv_heads, m.qk_norm, m.norm_eps, m.rope_scaling, config.data.add_bos) == (0, False, 1e-5, "none", True)
