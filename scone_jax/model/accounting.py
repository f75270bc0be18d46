"""Parameter counts and the FLOP formula behind MFU.

Training FLOPs per token (forward + backward = 3x forward; a matmul of an [n] vector with an
[n, m] matrix costs 2nm):
    6 * (non-embedding matmul parameters + d_model * vocab_size for the output head)
  + 12 * num_layers * seq_len * (num_heads * head_dim)      # attention scores and mixing
Embedding lookups, norms and softmax are ignored (< 1% at our sizes). Attention is counted as
if every query saw the whole sequence, as the PaLM paper does; causal masking halves the real
work, so the MFU here is comparable with theirs.
"""
from __future__ import annotations

import math

import jax
from flax import nnx

EMBEDDING_PARAMS = ("token_embed", "pos_embed")


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
        if any(getattr(k, "key", None) in EMBEDDING_PARAMS for k in path):
            counts["embedding"] += n
    counts["non_embedding"] = counts["total"] - counts["embedding"]
    return counts


def decoder_flops_per_token(model_cfg, seq_len: int, non_embedding_params: int) -> float:
    """Training FLOPs per token of the decoder (formula in the module docstring)."""
    head_dim = model_cfg.head_dim or model_cfg.d_model // model_cfg.num_heads
    matmul_params = non_embedding_params + model_cfg.d_model * model_cfg.vocab_size
    attention = 12 * model_cfg.num_layers * seq_len * model_cfg.num_heads * head_dim
    return 6.0 * matmul_params + attention
