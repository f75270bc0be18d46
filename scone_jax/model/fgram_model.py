"""The f-gram model: the main model's block architecture over one f-gram at a time.

Input: the main model's token embeddings T(tok_1..tok_n) of a left-aligned f-gram (right
padding up to K) times scone.input_multiplier (1 in the method), plus this model's own learned
position embedding with K positions.
Output: the final-norm hidden state at the f-gram's last token, width d of the main model (without the
final norm, the last block's residual stream, if scone.output_norm is off: an experiment of docs/quality.md).
Attention is causal, so right padding never reaches the last real token (docs/method.md §4).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax.model.layers import dense, dtype_of, normal
from scone_jax.model.transformer import BlockStack


def fgram_block_config(main_cfg, scone_cfg):
    """The main model's block config with the f-gram model's own depth and (optional) width.

    Its blocks are the main model's kind: norm and its epsilon, MLP, biases, q/k norm, and the main
    model's key/value heads (model.num_kv_heads; 0 = as many as its own query heads), which
    config.validate requires to divide scone.num_heads when that is set. Positions are learned
    absolute ones (K of them) whatever the main model uses, so RoPE and its scaling do not apply;
    attention is always the XLA path (model/attention.py)."""
    cfg = main_cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.num_layers = scone_cfg.num_layers
        cfg.d_model = scone_cfg.d_model or main_cfg.d_model
        cfg.num_heads = scone_cfg.num_heads or main_cfg.num_heads
        cfg.head_dim = 0 if scone_cfg.d_model else main_cfg.head_dim
        cfg.d_ff = scone_cfg.d_ff or main_cfg.d_ff
        cfg.position = "learned"
        cfg.rope_scaling = "none"
        cfg.max_seq_len = scone_cfg.max_len
        # K <= 8 positions: a fused kernel's 128-wide blocks would be mostly padding; the plain
        # XLA flash path keeps only outputs and softmax statistics for the backward pass.
        cfg.attention = "xla"
    return cfg


class FgramModel(nnx.Module):
    """Maps embedded f-grams [U, K, d] and their lengths [U] to f-gram embeddings [U, d]."""

    def __init__(self, main_cfg, scone_cfg, rngs: nnx.Rngs):
        cfg = fgram_block_config(main_cfg, scone_cfg)
        self.max_len = scone_cfg.max_len
        self.dtype = dtype_of(cfg.dtype)
        self.pos_embed = nnx.Embed(
            self.max_len, cfg.d_model, dtype=self.dtype, param_dtype=dtype_of(cfg.param_dtype),
            embedding_init=normal(cfg.init_std, (None, "embed")), rngs=rngs,
        )
        resize = cfg.d_model != main_cfg.d_model
        self.in_proj = dense(main_cfg.d_model, cfg.d_model, ("embed", "mlp"), cfg, rngs) if resize else None
        self.out_proj = dense(cfg.d_model, main_cfg.d_model, ("mlp", "embed"), cfg, rngs) if resize else None
        self.stack = BlockStack(cfg, cfg.num_layers, rngs, final_norm=scone_cfg.output_norm)
        # Off by default (docs/method.md §4). The final norm leaves rows of norm ~sqrt(d), over ten times the
        # token embeddings they replace; a learned scalar gain starting at output_gain_init tests that scale.
        gain = scone_cfg.output_gain_init
        self.output_gain = nnx.Param(jnp.asarray(gain, dtype_of(cfg.param_dtype))) if gain else None
        # 1 in the method; sqrt(d) gives the blocks the decoder's scaled input (model.embedding_multiplier).
        self.input_multiplier = float(scone_cfg.input_multiplier)
        # Off by default (the method). scone.gate: the scalar g of SconeModel.matched_inputs, from 0; one of this
        # model's parameters, so the f-gram model's delay and learning-rate multiplier apply to it too.
        self.gate = nnx.Param(jnp.zeros((), dtype_of(cfg.param_dtype))) if scone_cfg.gate else None

    def __call__(self, token_embeddings: jax.Array, lengths: jax.Array) -> jax.Array:
        """Embeddings of the f-grams themselves: the output at each row's last token, [U, d]."""
        h = self.all_positions(token_embeddings, lengths)
        last = jnp.maximum(lengths - 1, 0)
        return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]

    def all_positions(self, token_embeddings: jax.Array, lengths: jax.Array) -> jax.Array:
        """Outputs at every position [U, K, d]: position j of row (t_1..t_n) is the embedding of
        the prefix f-gram (t_1..t_{j+1}), since attention is causal and rows left-aligned."""
        u, k, _ = token_embeddings.shape
        x = token_embeddings.astype(self.dtype)
        if self.input_multiplier != 1.0:
            x = x * jnp.asarray(self.input_multiplier, x.dtype)
        if self.in_proj is not None:
            x = self.in_proj(x)
        positions = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (u, k))
        x = x + self.pos_embed(positions)
        # Segment 1 = the f-gram's tokens; padding is segment 0 and never mixes with them.
        segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
        h = self.stack(x, segment_ids, positions)
        h = self.out_proj(h) if self.out_proj is not None else h
        return h * self.output_gain[...].astype(h.dtype) if self.output_gain is not None else h
