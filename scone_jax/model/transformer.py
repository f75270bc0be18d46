"""Decoder-only transformer: token embedding T, a block stack, and the output head.

The three stages are separate methods (`embed`, `decode`, `logits`) because SCONE swaps the
input embedding at matched positions before the block stack and leaves the head untouched.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax.model import remat
from scone_jax.model.layers import Block, dtype_of, make_norm, normal
from scone_jax.sharding import constrain


ACTIVATION_AXES = ("batch", None, None)
LAYERS_AXIS = "layers"  # logical name of the stacked-layer dimension (sharding.LOGICAL_RULES)


class BlockStack(nnx.Module):
    """`num_layers` blocks followed by a final norm (shared by the decoder and the f-gram model).

    With cfg.scan_layers (the default) the blocks' parameters are stacked along a leading
    'layers' axis and the stack runs as one jax.lax.scan, so XLA compiles one block however deep
    the model is (compile time independent of depth). Without it, a Python loop over separate
    blocks: easier to step through, identical math; `layout.py` converts states between the two.
    Each block runs under the remat policy cfg.remat (remat.py).
    """

    def __init__(self, cfg, num_layers: int, rngs: nnx.Rngs):
        self.scanned = cfg.scan_layers
        self.remat = cfg.remat
        remat.check(cfg.remat)
        if self.scanned:
            @nnx.split_rngs(splits=num_layers)
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
            def stacked(layer_rngs):
                return Block(cfg, layer_rngs)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(num_layers)])
        self.final_norm = make_norm(cfg, rngs)

    def __call__(self, x, segment_ids, positions):
        def layer(x, block_state):
            block = nnx.merge(graphdef, block_state)
            return block(constrain(x, ACTIVATION_AXES), segment_ids, positions)

        if self.scanned:
            graphdef, stacked = nnx.split(self.blocks)
            layer = remat.apply(layer, self.remat, in_scan=True)
            x, _ = jax.lax.scan(lambda carry, block_state: (layer(carry, block_state), None), x, stacked)
        else:
            layer = remat.apply(layer, self.remat, in_scan=False)
            for block in self.blocks:
                graphdef, block_state = nnx.split(block)
                x = layer(x, block_state)
        return self.final_norm(constrain(x, ACTIVATION_AXES))

    def layers(self) -> list[Block]:
        """The blocks one by one (views of the stacked parameters when scanned): for code that
        walks the layers itself, such as cached decoding."""
        if not self.scanned:
            return list(self.blocks)
        graphdef, stacked = nnx.split(self.blocks)
        depth = jax.tree.leaves(stacked)[0].shape[0]
        return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked)) for i in range(depth)]


class Decoder(nnx.Module):
    """GPT-2 style (learned positions, LayerNorm, GELU) or OLMo style (RoPE, RMSNorm, SwiGLU)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (> 0) before building the model.")
        self.cfg = cfg
        self.dtype = dtype_of(cfg.dtype)
        self.token_embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=self.dtype,
            param_dtype=dtype_of(cfg.param_dtype),
            embedding_init=normal(cfg.init_std, ("vocab", "embed")),
            rngs=rngs,
        )
        if cfg.position == "learned":
            self.pos_embed = nnx.Embed(
                cfg.max_seq_len,
                cfg.d_model,
                dtype=self.dtype,
                param_dtype=dtype_of(cfg.param_dtype),
                embedding_init=normal(cfg.init_std, (None, "embed")),
                rngs=rngs,
            )
        elif cfg.position == "rope":
            self.pos_embed = None
        else:
            raise ValueError(f"Unknown model.position={cfg.position!r}; use 'learned' or 'rope'.")
        self.stack = BlockStack(cfg, cfg.num_layers, rngs)
        if cfg.tie_embeddings:
            self.head = None
        else:
            self.head = nnx.Linear(
                cfg.d_model,
                cfg.vocab_size,
                use_bias=False,
                dtype=self.dtype,
                param_dtype=dtype_of(cfg.param_dtype),
                kernel_init=normal(cfg.init_std, ("embed", "vocab")),
                rngs=rngs,
            )

    def embed(self, tokens: jax.Array) -> jax.Array:
        """T(tokens): [..., n] int -> [..., n, d], rows staying on the devices holding `tokens`.

        The table is gathered over FSDP first (as for any weight) so the lookup is local; left
        to itself XLA may shard the output like the table and reshuffle rows across devices."""
        table = constrain(self.token_embed.embedding[...], ("vocab", None))
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        return constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    def decode(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """Input embeddings [B, T, d] -> final hidden states [B, T, d]."""
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        return self.stack(x.astype(self.dtype), segment_ids, positions)

    def logits(self, h: jax.Array) -> jax.Array:
        """Hidden states -> fp32 logits over the vocabulary (tied or separate head)."""
        if self.head is None:
            out = self.token_embed.attend(h)
        else:
            out = self.head(h)
        return out.astype(jnp.float32)

    def batch_logits(self, batch: dict) -> jax.Array:
        """Logits for a training/eval batch dict (keys inputs, segment_ids, positions)."""
        return self(batch["inputs"], batch["segment_ids"], batch["positions"])

    def __call__(self, tokens, segment_ids, positions):
        return self.logits(self.decode(self.embed(tokens), segment_ids, positions))
