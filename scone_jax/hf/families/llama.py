"""Llama (model_type 'llama', LlamaForCausalLM): Llama 2, Llama 3 and 3.1 (RoPE scaling 'llama3'), and checkpoints
laid out like them. RMSNorm, SwiGLU (silu), RoPE in the rotate-half convention that model/layers.py uses too (so q
and k need only a transpose, no permutation of their rows), grouped-query attention, no biases, head tied or not.

Names: model.embed_tokens.weight, model.layers.{i}.{input_layernorm, post_attention_layernorm}.weight,
model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight,
model.norm.weight, lm_head.weight (untied). Every weight is an nn.Linear [out, in]: transposed into our kernels.
`layout` serves Qwen3 (with the per-head q/k norms) and OLMo (without norm weights) too.
"""
from __future__ import annotations

from scone_jax.hf.families import base
from scone_jax.hf.families.base import linear, table, vector


def layout(model, *, norm_weights: bool = True, qk_norm: bool = False) -> list[base.Tensor]:
    """The tensors of a Llama-laid-out checkpoint of `model` (our model section)."""
    d, f, v = model["d_model"], model["d_ff"], model["vocab_size"]
    h = base.head_dim_of(model)
    q, kv = model["num_heads"] * h, base.kv_heads_of(model) * h
    at = "model.layers.{i}."
    tensors = [table("model.embed_tokens.weight", v, d, ("token_embed", "embedding"))]
    if norm_weights:
        tensors += [vector(at + "input_layernorm.weight", d, ("attn_norm", "scale")),
                    vector(at + "post_attention_layernorm.weight", d, ("mlp_norm", "scale"))]
    tensors += [linear(at + "self_attn.q_proj.weight", d, q, ("attn", "query", "kernel")),
                linear(at + "self_attn.k_proj.weight", d, kv, ("attn", "key", "kernel")),
                linear(at + "self_attn.v_proj.weight", d, kv, ("attn", "value", "kernel")),
                linear(at + "self_attn.o_proj.weight", q, d, ("attn", "out", "kernel"))]
    if qk_norm:
        tensors += [vector(at + "self_attn.q_norm.weight", h, ("attn", "query_norm", "scale")),
                    vector(at + "self_attn.k_norm.weight", h, ("attn", "key_norm", "scale"))]
    tensors += [linear(at + "mlp.gate_proj.weight", d, f, ("mlp", "gate", "kernel")),
                linear(at + "mlp.up_proj.weight", d, f, ("mlp", "up", "kernel")),
                linear(at + "mlp.down_proj.weight", f, d, ("mlp", "down", "kernel"))]
    if norm_weights:
        tensors.append(vector("model.norm.weight", d, ("stack", "final_norm", "scale")))
    if not model["tie_embeddings"]:
        tensors.append(linear("lm_head.weight", d, v, ("head", "kernel")))
    return tensors


def common_keys(hf: dict, where: str, *, default_theta: float = 10000.0) -> dict:
    """The keys every Llama-laid-out family reads the same way (norm and its epsilon, qk_norm and the head tying
    are the family's own)."""
    base.require(hf, where, "hidden_act", ("silu",), "silu")
    d = base.number(hf, where, "hidden_size")
    heads = base.number(hf, where, "num_attention_heads")
    kv = base.number(hf, where, "num_key_value_heads", heads)
    if heads % kv:
        raise base.HfConfigError(f"{where}: num_key_value_heads={kv} does not divide num_attention_heads={heads}. "
                                 "Fix: correct config.json.")
    head_dim = base.number(hf, where, "head_dim", d // heads)
    return dict(vocab_size=base.number(hf, where, "vocab_size"), d_model=d,
                num_layers=base.number(hf, where, "num_hidden_layers"), num_heads=heads,
                num_kv_heads=0 if kv == heads else kv, head_dim=0 if head_dim * heads == d else head_dim,
                d_ff=base.number(hf, where, "intermediate_size"),
                max_seq_len=base.number(hf, where, "max_position_embeddings", 2048), mlp="swiglu", position="rope",
                use_bias=False, embedding_multiplier=1.0, **base.rope_keys(hf, where, default_theta))


def common_config(model) -> dict:
    """The config.json fields every Llama-laid-out family writes the same way."""
    return dict(vocab_size=model["vocab_size"], hidden_size=model["d_model"], intermediate_size=model["d_ff"],
                num_hidden_layers=model["num_layers"], num_attention_heads=model["num_heads"],
                num_key_value_heads=base.kv_heads_of(model), head_dim=base.head_dim_of(model), hidden_act="silu",
                max_position_embeddings=model["max_seq_len"], attention_bias=False, attention_dropout=0.0,
                tie_word_embeddings=bool(model["tie_embeddings"]), **base.rope_config(model))


LLAMA_LAYOUT_FITS = dict(position="rope", mlp="swiglu", use_bias=False, embedding_multiplier=1.0)


class Llama(base.Family):
    model_type, architecture, prefix = "llama", "LlamaForCausalLM", "model."
    fits = dict(LLAMA_LAYOUT_FITS, norm="rmsnorm", qk_norm=False)

    def model_keys(self, hf: dict, where: str) -> dict:
        for field in ("attention_bias", "mlp_bias"):
            base.require(hf, where, field, (False,), False)
        return dict(common_keys(hf, where), norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                    qk_norm=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))

    def hf_config(self, model) -> dict:
        return dict(common_config(model), rms_norm_eps=float(model["norm_eps"]), mlp_bias=False, pretraining_tp=1)

    def tensors(self, model) -> list[base.Tensor]:
        return layout(model)
