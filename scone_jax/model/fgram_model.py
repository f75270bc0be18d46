"""The f-gram model: a block stack over one f-gram at a time.

Input: the token embeddings of a left-aligned f-gram (right padding up to K) times scone.input_multiplier (1 in
the method): the main model's T(tok_1..tok_n) (docs/method.md §4), through `in_proj` when the widths differ, or
with scone.own_token_embedding a table of its own (a pretrained source's embed_tokens). Positions: learned
absolute ones over K (the method), or, for a source checkpoint that uses RoPE (scone.source_model), RoPE over
positions 0..K-1 with the source's settings, as the source computed them.
Output: the final-norm hidden state at the f-gram's last token (without the final norm, the last block's residual
stream, if scone.output_norm is off: an experiment of docs/quality.md), projected by `out_proj` to the main
model's width when its own differs (or always, from zero, with scone.output_projection_init='zeros'). Attention
is causal, so right padding never reaches the last real token.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax.model.layers import dense, dtype_of, normal
from scone_jax.model.transformer import BlockStack, embedding_lookup

# Keys of a source's architecture (scone.source_model) the f-gram model's blocks do not take: its own token table
# is sized by vocab_size, positions stop at K, and the head and the input multiplier belong to the decoder.
_NOT_BLOCK_KEYS = ("vocab_size", "max_seq_len", "tie_embeddings", "embedding_multiplier")


def source_architecture(scone_cfg) -> dict | None:
    """scone.source_model parsed: the model.* keys of the checkpoint the f-gram model was grown from (None: none)."""
    text = scone_cfg.get("source_model", "")
    return json.loads(text) if text else None


def fgram_block_config(main_cfg, scone_cfg):
    """The f-gram model's block config: its own depth and (optional) width, heads and MLP width (scone.*), and
    the kind of block of the main model, or of its source checkpoint (scone.source_model).

    Without a source: the main model's norm and its epsilon, MLP, biases, q/k norm and key/value heads
    (model.num_kv_heads; 0 = as many as its own query heads), which config.validate requires to divide
    scone.num_heads when that is set; positions are learned absolute ones (K of them) whatever the main model
    uses, so RoPE and its scaling do not apply. With a source: every architecture key of the source (its
    key/value heads, head_dim, RoPE and its scaling included), so its weights compute what they computed there.
    Attention is always the XLA path (model/attention.py); the dtypes, remat, layout and init_std are the main
    model's."""
    cfg = main_cfg.copy_and_resolve_references()
    source = source_architecture(scone_cfg)
    with cfg.unlocked():
        if source:
            for key, value in source.items():
                if key not in _NOT_BLOCK_KEYS:
                    cfg[key] = value
        else:
            cfg.head_dim = 0 if scone_cfg.d_model else main_cfg.head_dim
            cfg.position = "learned"
            cfg.rope_scaling = "none"
        cfg.num_layers = scone_cfg.num_layers
        cfg.d_model = scone_cfg.d_model or main_cfg.d_model
        cfg.num_heads = scone_cfg.num_heads or main_cfg.num_heads
        cfg.d_ff = scone_cfg.d_ff or main_cfg.d_ff
        cfg.max_seq_len = scone_cfg.max_len
        # K <= 8 positions: a fused kernel's 128-wide blocks would be mostly padding; the plain
        # XLA flash path keeps only outputs and softmax statistics for the backward pass.
        cfg.attention = "xla"
    return cfg


class OutputRamp(nnx.Variable):
    """scone.output_ramp_steps' r: state the train step writes, never trained (model/scone.py matched_inputs)."""


class FgramModel(nnx.Module):
    """Maps the token ids' embeddings of f-grams [U, K, *] and their lengths [U] to f-gram embeddings [U, d]."""

    def __init__(self, main_cfg, scone_cfg, rngs: nnx.Rngs):
        cfg = fgram_block_config(main_cfg, scone_cfg)
        source = source_architecture(scone_cfg)
        self.max_len = scone_cfg.max_len
        self.dtype = dtype_of(cfg.dtype)
        param_dtype = dtype_of(cfg.param_dtype)
        self.pos_embed = nnx.Embed(
            self.max_len, cfg.d_model, dtype=self.dtype, param_dtype=param_dtype,
            embedding_init=normal(cfg.init_std, (None, "embed")), rngs=rngs,
        ) if cfg.position == "learned" else None
        own = bool(scone_cfg.get("own_token_embedding", False))
        resize = cfg.d_model != main_cfg.d_model
        self.in_proj = dense(main_cfg.d_model, cfg.d_model, ("embed", "mlp"), cfg, rngs) if resize and not own else None
        # scone.output_projection_init='zeros': f = 0 at step 0 (scone.combine='add'), a projection at equal widths too
        zeros = scone_cfg.get("output_projection_init", "normal") == "zeros"
        self.out_proj = dense(cfg.d_model, main_cfg.d_model, ("mlp", "embed"), cfg, rngs,
                              std=0.0 if zeros else None) if resize or zeros else None
        self.stack = BlockStack(cfg, cfg.num_layers, rngs, final_norm=scone_cfg.output_norm)
        # Off by default (docs/method.md §4). The final norm leaves rows of norm ~sqrt(d), over ten times the
        # token embeddings they replace; a learned scalar gain starting at output_gain_init tests that scale.
        gain = scone_cfg.output_gain_init
        self.output_gain = nnx.Param(jnp.asarray(gain, param_dtype)) if gain else None
        # 1 in the method; sqrt(d) gives the blocks the decoder's scaled input (model.embedding_multiplier).
        self.input_multiplier = float(scone_cfg.input_multiplier)
        # Off by default (the method). scone.gate: the scalar g of SconeModel.matched_inputs, from 0; one of this
        # model's parameters, so the f-gram model's delay and learning-rate multiplier apply to it too.
        self.gate = nnx.Param(jnp.zeros((), param_dtype)) if scone_cfg.gate else None
        # scone.combine: 'replace' (the method) or 'add'; scone.row_scale: 'raw' (the method) or 'token_rms'
        # (SconeModel.matched_inputs); static, no parameter.
        self.combine = scone_cfg.get("combine", "replace")
        self.row_scale = scone_cfg.get("row_scale", "raw")
        # scone.output_ramp_steps W: r of SconeModel.matched_inputs, 0 until the train step sets min(1, step / W);
        # a variable of the model's state (saved, restored, exported), not a parameter (no gradient, no update).
        self.ramp_steps = int(scone_cfg.get("output_ramp_steps", 0))
        self.ramp = OutputRamp(jnp.zeros((), jnp.float32)) if self.ramp_steps else None
        # scone.own_token_embedding: a table of this model's own, the source's rows (its vocabulary) or the main
        # model's; made last, so a run without it draws the same random numbers as before it existed.
        rows = source.get("vocab_size", main_cfg.vocab_size) if source else main_cfg.vocab_size
        self.token_embed = nnx.Embed(
            rows, cfg.d_model, dtype=self.dtype, param_dtype=param_dtype,
            embedding_init=normal(cfg.init_std, ("vocab", "embed")), rngs=rngs,
        ) if own else None

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Its own table's rows for `tokens` (scone.own_token_embedding)."""
        return embedding_lookup(self.token_embed, tokens, self.dtype)

    def __call__(self, token_embeddings: jax.Array, lengths: jax.Array) -> jax.Array:
        """Embeddings of the f-grams themselves: the output at each row's last token, [U, d]."""
        h = self.all_positions(token_embeddings, lengths)
        last = jnp.maximum(lengths - 1, 0)
        return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]

    def all_positions(self, token_embeddings: jax.Array, lengths: jax.Array) -> jax.Array:
        """Outputs at every position [U, K, d]: position j of row (t_1..t_n) is the embedding of
        the prefix f-gram (t_1..t_{j+1}), since attention is causal and rows left-aligned."""
        h = self.hidden(token_embeddings, lengths)
        h = self.out_proj(h) if self.out_proj is not None else h
        return h * self.output_gain[...].astype(h.dtype) if self.output_gain is not None else h

    def hidden(self, token_embeddings: jax.Array, lengths: jax.Array) -> jax.Array:
        """The block stack's output [U, K, its width], before the projection: for a source checkpoint, its own
        final-norm hidden states of the f-gram's tokens at positions 0..K-1."""
        u, k, _ = token_embeddings.shape
        x = token_embeddings.astype(self.dtype)
        if self.input_multiplier != 1.0:
            x = x * jnp.asarray(self.input_multiplier, x.dtype)
        if self.in_proj is not None:
            x = self.in_proj(x)
        positions = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (u, k))
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        # Segment 1 = the f-gram's tokens; padding is segment 0 and never mixes with them.
        segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
        return self.stack(x, segment_ids, positions)
