"""GPT-2 (model_type 'gpt2', GPT2LMHeadModel): learned positions, LayerNorm with bias, GELU in its tanh form
(gelu_new; jax.nn.gelu's default), biases everywhere, head tied unless tie_word_embeddings says otherwise.

Its blocks are Conv1D layers whose weights are already [in, out], as our kernels are: copied, not transposed.
h.{i}.attn.c_attn fuses the query, key and value projections side by side along its last axis ([d, 3d] and [3d]),
split into our three. Names: transformer.{wte, wpe}.weight, transformer.h.{i}.{ln_1, ln_2}.{weight, bias},
transformer.h.{i}.attn.{c_attn, c_proj}.{weight, bias}, transformer.h.{i}.mlp.{c_fc, c_proj}.{weight, bias},
transformer.ln_f.{weight, bias}, lm_head.weight (untied). Older files (openai-community/gpt2) drop the
'transformer.' prefix and carry the causal-mask buffers h.{i}.attn.bias / masked_bias: read past.
Refused: scale_attn_by_inverse_layer_idx, unscaled attention, cross-attention, other activations."""
from __future__ import annotations

import re

from scone_jax.hf.families import base
from scone_jax.hf.families.base import Part, Tensor, table, vector

_MASK_BUFFER = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the same tanh formula


class Gpt2(base.Family):
    model_type, architecture, prefix = "gpt2", "GPT2LMHeadModel", "transformer."
    fits = dict(position="learned", norm="layernorm", mlp="gelu", use_bias=True, num_kv_heads=0, head_dim=0,
                qk_norm=False, embedding_multiplier=1.0)

    def model_keys(self, hf: dict, where: str) -> dict:
        base.require(hf, where, "activation_function", ACTIVATIONS, "gelu_new")
        base.require(hf, where, "scale_attn_weights", (True,), True)
        base.require(hf, where, "scale_attn_by_inverse_layer_idx", (False,), False)
        base.require(hf, where, "add_cross_attention", (False,), False)
        d, heads = base.number(hf, where, "n_embd"), base.number(hf, where, "n_head")
        if d % heads:
            raise base.HfConfigError(f"{where}: n_embd={d} is not divisible by n_head={heads}. Fix: correct "
                                     "config.json.")
        return dict(vocab_size=base.number(hf, where, "vocab_size"), d_model=d,
                    num_layers=base.number(hf, where, "n_layer"), num_heads=heads, num_kv_heads=0, head_dim=0,
                    d_ff=base.number(hf, where, "n_inner", 4 * d),
                    max_seq_len=base.number(hf, where, "n_positions"), norm="layernorm",
                    norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), mlp="gelu", position="learned",
                    rope_scaling="none", use_bias=True,
                    tie_embeddings=bool(hf.get("tie_word_embeddings", True)), qk_norm=False, embedding_multiplier=1.0)

    def hf_config(self, model) -> dict:
        d = model["d_model"]
        return dict(vocab_size=model["vocab_size"], n_embd=d, n_layer=model["num_layers"], n_head=model["num_heads"],
                    n_inner=None if model["d_ff"] == 4 * d else model["d_ff"], n_positions=model["max_seq_len"],
                    activation_function="gelu_new", layer_norm_epsilon=float(model["norm_eps"]),
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
                    tie_word_embeddings=bool(model["tie_embeddings"]))

    def tensors(self, model) -> list[Tensor]:
        d, f, v = model["d_model"], model["d_ff"], model["vocab_size"]
        at = "transformer.h.{i}."
        qkv = lambda kind: tuple(Part(("attn", name, kind), k * d, (k + 1) * d)  # noqa: E731
                                 for k, name in enumerate(("query", "key", "value")))
        tensors = [table("transformer.wte.weight", v, d, ("token_embed", "embedding")),
                   table("transformer.wpe.weight", model["max_seq_len"], d, ("pos_embed", "embedding"))]
        for hf_norm, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            tensors += [vector(f"{at}{hf_norm}.weight", d, (ours, "scale")),
                        vector(f"{at}{hf_norm}.bias", d, (ours, "bias"))]
        tensors += [Tensor(at + "attn.c_attn.weight", (d, 3 * d), qkv("kernel")),
                    Tensor(at + "attn.c_attn.bias", (3 * d,), qkv("bias"))]
        for hf_name, ours, d_in, d_out in (("attn.c_proj", ("attn", "out"), d, d), ("mlp.c_fc", ("mlp", "up"), d, f),
                                           ("mlp.c_proj", ("mlp", "down"), f, d)):
            tensors += [Tensor(f"{at}{hf_name}.weight", (d_in, d_out), (Part((*ours, "kernel"), 0, d_out),)),
                        vector(f"{at}{hf_name}.bias", d_out, (*ours, "bias"))]
        tensors += [vector("transformer.ln_f.weight", d, ("stack", "final_norm", "scale")),
                    vector("transformer.ln_f.bias", d, ("stack", "final_norm", "bias"))]
        if not model["tie_embeddings"]:
            tensors.append(base.linear("lm_head.weight", d, v, ("head", "kernel")))
        return tensors

    def ignored(self, name: str, model) -> bool:
        return super().ignored(name, model) or bool(_MASK_BUFFER.fullmatch(name))
