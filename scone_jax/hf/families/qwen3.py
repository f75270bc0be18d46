"""Qwen3 (model_type 'qwen3', Qwen3ForCausalLM): Llama's layout and names plus an RMSNorm over each head's query
and key after their projections and before RoPE (model.layers.{i}.self_attn.{q,k}_norm.weight, [head_dim]; our
model.qk_norm), head_dim independent of hidden_size, epsilon 1e-6 in its releases, tied head in the small ones.
Sliding-window attention (use_sliding_window, layer_types other than full_attention) and attention biases are
refused."""
from __future__ import annotations

from scone_jax.hf.families import base, llama


class Qwen3(base.Family):
    model_type, architecture, prefix = "qwen3", "Qwen3ForCausalLM", "model."
    fits = dict(llama.LLAMA_LAYOUT_FITS, norm="rmsnorm", qk_norm=True)

    def model_keys(self, hf: dict, where: str) -> dict:
        base.require(hf, where, "attention_bias", (False,), False)
        base.require(hf, where, "use_sliding_window", (False,), False)
        kinds = sorted(set(hf.get("layer_types") or ["full_attention"]))
        if kinds != ["full_attention"]:
            raise base.refuse(where, "layer_types", kinds, "full attention in every layer")
        return dict(llama.common_keys(hf, where), norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                    qk_norm=True, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))

    def hf_config(self, model) -> dict:
        return dict(llama.common_config(model), rms_norm_eps=float(model["norm_eps"]), use_sliding_window=False,
                    sliding_window=None, max_window_layers=model["num_layers"],
                    layer_types=["full_attention"] * model["num_layers"])

    def tensors(self, model) -> list[base.Tensor]:
        return llama.layout(model, qk_norm=True)
