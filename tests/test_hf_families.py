"""scone_jax/hf/families: config.json <-> our model keys for each family, read as transformers writes it (both
spellings of RoPE's settings), written so transformers reads the same architecture back, refusals in one line,
and the family a run's model section belongs to.

Deliberate bugs these tests were run against once (each made the named test fail):
  - common_keys reading head_dim as hidden_size // num_attention_heads always
    (test_transformers_configs_map_to_our_keys_and_back[qwen3]);
  - rope_parameters ignoring transformers 4's top-level rope_scaling (test_transformers_4_spelling_reads_the_same);
  - Llama.fits leaving out qk_norm (test_the_family_of_a_model_section: a Qwen3 model section would be Llama);
  - Qwen3's epsilon (every norm's, the q/k norms' included) fixed at its releases' 1e-6 when read or when written
    (test_transformers_configs_map_to_our_keys_and_back[qwen3-rms_norm_eps 1e-5]; issue 64).
"""
import json

import pytest

from scone_jax.hf import families
from scone_jax.hf.families.base import HfConfigError
from tests import hf_models

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def written(family, **overrides) -> dict:
    """config.json as transformers writes it for the tiny config."""
    return json.loads(hf_models.tiny_config(family, **overrides).to_json_string())


@pytest.mark.parametrize("family,overrides,expect", [
    ("llama", dict(rope_parameters=LLAMA31_ROPE),
     dict(num_kv_heads=2, head_dim=16, norm="rmsnorm", norm_eps=1e-5, rope_scaling="llama3", rope_theta=500000.0,
          rope_scaling_factor=8.0, rope_original_max_len=32, qk_norm=False, tie_embeddings=False)),
    ("qwen3", dict(tie_word_embeddings=True),
     dict(num_kv_heads=2, head_dim=16, norm_eps=1e-6, qk_norm=True, rope_theta=1e6, rope_scaling="none",
          tie_embeddings=True, max_seq_len=64)),
    ("qwen3", dict(rms_norm_eps=1e-5), dict(norm_eps=1e-5, qk_norm=True)),  # not its releases' 1e-6
    ("gpt2", {}, dict(num_kv_heads=0, head_dim=0, norm="layernorm", mlp="gelu", position="learned", use_bias=True,
                      d_ff=80, max_seq_len=64, tie_embeddings=False)),
    ("olmo", {}, dict(num_kv_heads=2, head_dim=0, norm="nonparametric_layernorm", norm_eps=1e-5, mlp="swiglu",
                      position="rope", use_bias=False)),
])
def test_transformers_configs_map_to_our_keys_and_back(family, overrides, expect):
    """config.json -> our keys (the values a run of that checkpoint needs), and our keys -> a config.json that
    transformers' own config class reads as the same architecture, and that maps back to the same keys."""
    from transformers import AutoConfig

    hf = written(family, **overrides)
    fam = families.of_config(hf, "config.json")
    keys = fam.model_keys(hf, "config.json")
    assert {k: keys[k] for k in expect} == expect
    assert keys["vocab_size"] == hf_models.VOCAB and keys["d_model"] == 48 and keys["num_layers"] == 2
    assert fam.misfit(keys) == [] and families.of_model(keys) is fam
    back = {**fam.hf_config(keys), "model_type": family, "architectures": [fam.architecture]}
    assert fam.model_keys(back, "ours") == keys
    theirs = AutoConfig.for_model(**back)
    original = hf_models.tiny_config(family, **overrides)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "n_inner",
                  "layer_norm_epsilon", "max_position_embeddings"):
        if getattr(original, field, None) is not None:  # OLMo's config has no head_dim (its attention reads one)
            assert getattr(theirs, field) == getattr(original, field), field
    if family != "gpt2":
        assert theirs.rope_parameters == original.rope_parameters


def test_transformers_4_spelling_reads_the_same():
    """transformers 4 kept rope_theta and rope_scaling ({'type': ...} in older files) at the top level."""
    v5 = written("llama", rope_parameters=LLAMA31_ROPE)
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    fam = families.of_config(v5, "x")
    assert fam.model_keys(v4, "x") == fam.model_keys(v5, "x")


def test_yarn_reads_its_betas_and_refuses_knobs_we_do_not_have():
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 16.0}
    keys = families.FAMILIES["qwen3"].model_keys(written("qwen3", rope_parameters=rope), "c")
    assert (keys["rope_scaling"], keys["rope_scaling_factor"], keys["rope_beta_fast"], keys["rope_beta_slow"]) == \
        ("yarn", 4.0, 16.0, 1.0)
    with pytest.raises(HfConfigError, match=r"rope_parameters.mscale=0.7"):
        families.FAMILIES["qwen3"].model_keys(written("qwen3", rope_parameters={**rope, "mscale": 0.7}), "c")


@pytest.mark.parametrize("family,change,named", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type='linear'"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("olmo", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
    ("gpt2", {"model_type": "mistral"}, "model_type='mistral' is not supported; supported: llama, qwen3, gpt2, olmo"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]},
     "architectures=['LlamaForSequenceClassification'] is not supported"),
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide"),
])
def test_settings_outside_a_family_are_refused_in_one_line(family, change, named):
    hf = {**written(family), **change}
    with pytest.raises(HfConfigError) as e:
        families.of_config(hf, "/d/config.json").model_keys(hf, "/d/config.json")
    text = str(e.value)
    assert named in text and text.startswith("/d/config.json: ") and "\n" not in text and "Fix:" in text, text


def test_the_family_of_a_model_section():
    """A run trained from scratch exports as the family its model section matches exactly, else it is refused
    naming, per family, what does not fit."""
    gpt2 = dict(d_model=64, num_heads=4, num_kv_heads=0, head_dim=0, norm="layernorm", mlp="gelu",
                position="learned", use_bias=True, qk_norm=False, embedding_multiplier=1.0, norm_eps=1e-5)
    llama = dict(gpt2, norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False)
    assert families.of_model(gpt2).model_type == "gpt2"
    assert families.of_model(llama).model_type == "llama"
    assert families.of_model(dict(llama, qk_norm=True, num_kv_heads=2)).model_type == "qwen3"
    assert families.of_model(dict(llama, norm="nonparametric_layernorm")).model_type == "olmo"
    with pytest.raises(HfConfigError) as e:
        families.of_model(dict(gpt2, position="rope"))
    assert "gpt2 needs position='learned' (has 'rope')" in str(e.value)
    assert "llama needs mlp='swiglu' (has 'gelu')" in str(e.value)
    assert "norm='rmsnorm' (has 'layernorm')" in str(e.value)
    with pytest.raises(HfConfigError, match="embedding_multiplier=1.0 \\(has 2.0\\)"):
        families.of_model(dict(llama, embedding_multiplier=2.0))
    with pytest.raises(HfConfigError, match="num_kv_heads=0 \\(has 2\\)"):  # GPT-2 has no grouped-query attention
        families.of_model(dict(gpt2, num_kv_heads=2))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "olmo"])
def test_fields_a_config_json_leaves_out_take_transformers_defaults(family):
    """A config.json written without its optional fields (the norm's epsilon, tied embeddings) gives the values
    transformers' own config class fills in for it. Caught: Qwen3's missing rms_norm_eps read as 1e-7; GPT-2's
    missing tie_word_embeddings read as untied."""
    from transformers import AutoConfig

    hf = written(family)
    for field in ("rms_norm_eps", "layer_norm_epsilon", "tie_word_embeddings"):
        hf.pop(field, None)
    keys = families.of_config(hf, "config.json").model_keys(hf, "config.json")
    theirs = AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "transformers_version"})
    eps = getattr(theirs, "rms_norm_eps", None) or getattr(theirs, "layer_norm_epsilon", None)
    if family != "olmo":  # OLMo's LayerNorm has a fixed epsilon of its own, not a config field
        assert keys["norm_eps"] == eps
    assert keys["tie_embeddings"] == theirs.tie_word_embeddings
