"""Parameter counts and the FLOP formula behind MFU.

Training FLOPs per token (forward + backward = 3x forward; a matmul of an [n] vector with an
[n, m] matrix costs 2nm):
    6 * (non-embedding matmul parameters, an untied output head's among them,
         + d_model * vocab_size for a tied head, which reuses the embedding table)
  + 12 * num_layers * seq_len * (num_heads * head_dim)      # attention scores and mixing
Embedding lookups, norms and softmax are ignored (< 1% at our sizes). Attention is counted as
if every query saw the whole sequence, as the PaLM paper does; causal masking halves the real
work, so the MFU here is comparable with theirs.

SCONE adds the f-gram model, which runs on every row of the static f-gram buffer (U rows per
data shard, K tokens each, padding included, because that is what the device computes):
    rows * K * (6 * its non-embedding matmul parameters + 12 * its layers * K * its attention width)
Its token-embedding input is a lookup, and the table-gather back into the batch is free.

Over-Encoding (model/overencoding.py) adds its projection, a [d, d] matrix: a non-embedding matmul parameter
like any Linear kernel, so the formula above counts it (2 d^2 FLOPs per token at inference, 6 d^2 in training);
its n-gram tables are embeddings (lookups, not counted), held on the accelerator (param_bytes counts them).

Engram (model/engram.py) adds, per layer, W_K and W_V ([d_mem, d] each: 4 d_mem d FLOPs per token at inference)
and its depthwise convolution (w x d weights, each one multiply-add per token: 2 w d), both counted by the formula
as parameters, and its gate, which has no parameters of its own: the dot product of the two normalised [d] vectors
and alpha_t v_t, 3d FLOPs per token (`engram_flops_per_token`; 9d in training). Its tables are embeddings, on the
accelerator like Over-Encoding's; its norms, sigmoid and SiLU are ignored like the blocks'.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax.model import engram, roles
from scone_jax.model.fgram_model import fgram_block_config
from scone_jax.model.layers import head_dim_of


def param_counts(abstract_model_state) -> dict:
    """{'total', 'embedding', 'non_embedding'} parameter counts of an nnx model state."""
    counts = {"total": 0, "embedding": 0}
    leaves = jax.tree_util.tree_leaves_with_path(
        nnx.state(abstract_model_state, nnx.Param) if isinstance(abstract_model_state, nnx.Module)
        else abstract_model_state
    )
    for path, leaf in leaves:
        n = math.prod(leaf.shape)
        counts["total"] += n
        if roles.is_embedding(path):
            counts["embedding"] += n
    counts["non_embedding"] = counts["total"] - counts["embedding"]
    return counts


def param_bytes(abstract_model_state) -> int:
    """Bytes of an nnx model state's parameters in their dtype: what the accelerator holds of that model."""
    leaves = jax.tree_util.tree_leaves(
        nnx.state(abstract_model_state, nnx.Param) if isinstance(abstract_model_state, nnx.Module)
        else abstract_model_state)
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)


def fgram_flops_per_step(fgram_block_cfg, rows: int, non_embedding_params: int) -> float:
    """Training FLOPs of the f-gram model on `rows` f-grams of K tokens (module docstring)."""
    k = fgram_block_cfg.max_seq_len
    head_dim = head_dim_of(fgram_block_cfg)
    attention = 12 * fgram_block_cfg.num_layers * k * fgram_block_cfg.num_heads * head_dim
    return rows * k * (6.0 * non_embedding_params + attention)


def engram_flops_per_token(model_cfg, engram_cfg) -> float:
    """Forward FLOPs per token of Engram's gates, which no parameter count holds (module docstring); 0 without
    Engram."""
    if engram_cfg is None or not engram_cfg.enabled:
        return 0.0
    return 3.0 * model_cfg.d_model * len(engram.layers(engram_cfg))


def decoder_flops_per_token(model_cfg, seq_len: int, non_embedding_params: int, engram_cfg=None) -> float:
    """Training FLOPs per token of the decoder (formula in the module docstring). An untied head's kernel
    is already among the non-embedding parameters; a tied head is the embedding table, so it is added; with
    Engram, 3x its gates' forward FLOPs."""
    head_dim = head_dim_of(model_cfg)
    tied_head = model_cfg.d_model * model_cfg.vocab_size if model_cfg.tie_embeddings else 0
    matmul_params = non_embedding_params + tied_head
    attention = 12 * model_cfg.num_layers * seq_len * model_cfg.num_heads * head_dim
    return 6.0 * matmul_params + attention + 3.0 * engram_flops_per_token(model_cfg, engram_cfg)


def train_step_flops(config, abstract_model_state, num_batch_shards: int) -> dict:
    """{'decoder', 'fgram', 'total'} training FLOPs of one step of the configured model."""
    tokens = config.data.global_batch_size * config.data.seq_len
    scone = config.scone.enabled
    decoder_state = abstract_model_state["decoder"] if scone else abstract_model_state
    decoder = tokens * decoder_flops_per_token(
        config.model, config.data.seq_len, param_counts(decoder_state)["non_embedding"], config.get("engram")
    )
    fgram = 0.0
    if scone:
        fgram = fgram_flops_per_step(
            fgram_block_config(config.model, config.scone),
            num_batch_shards * config.scone.fgram_capacity,
            param_counts(abstract_model_state["fgram_model"])["non_embedding"],
        )
    return {"decoder": decoder, "fgram": fgram, "total": decoder + fgram}
