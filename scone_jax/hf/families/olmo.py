"""OLMo 1 (model_type 'olmo', OlmoForCausalLM, e.g. allenai/OLMo-1B-hf): Llama's layout and names without any norm
weight: its LayerNorms have no scale and no bias (our norm='nonparametric_layernorm') and their epsilon is fixed at
1e-5 in transformers' OlmoLayerNorm. clip_qkv (clamping q, k, v) and attention biases are refused. OLMo 2
(model_type 'olmo2': RMSNorm after the sublayers) is another architecture, not this one."""
from __future__ import annotations

from scone_jax.hf.families import base, llama

OLMO_EPS = 1e-5  # transformers' OlmoLayerNorm hard-codes it


class Olmo(base.Family):
    model_type, architecture, prefix = "olmo", "OlmoForCausalLM", "model."
    fits = dict(llama.LLAMA_LAYOUT_FITS, norm="nonparametric_layernorm", norm_eps=OLMO_EPS, qk_norm=False)

    def model_keys(self, hf: dict, where: str) -> dict:
        base.require(hf, where, "attention_bias", (False,), False)
        base.require(hf, where, "clip_qkv", (None,), None)
        return dict(llama.common_keys(hf, where), norm="nonparametric_layernorm", norm_eps=OLMO_EPS, qk_norm=False,
                    tie_embeddings=bool(hf.get("tie_word_embeddings", False)))

    def hf_config(self, model) -> dict:
        config = dict(llama.common_config(model), clip_qkv=None)
        if config["head_dim"] * model["num_heads"] == model["d_model"]:
            del config["head_dim"]  # OlmoConfig has no such field; its attention reads one when it is there
        return config

    def tensors(self, model) -> list[base.Tensor]:
        return llama.layout(model, norm_weights=False)
