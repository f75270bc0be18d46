"""Decoder-only transformer: token embedding T, a block stack, and the output head.

The three stages are separate methods (`embed`, `decode`, `logits`) because SCONE swaps the
input embedding at matched positions before the block stack and leaves the head untouched.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax.model import engram as engram_lib, remat
from scone_jax.model.layers import Block, KVCache, dtype_of, head_dim_of, kv_heads_of, make_norm, normal
from scone_jax.model.overencoding import OverEncoding
from scone_jax.sharding import constrain

ACTIVATION_AXES = ("batch", None, None)
LAYERS_AXIS = "layers"  # logical name of the stacked-layer dimension (sharding.LOGICAL_RULES)


class BlockStack(nnx.Module):
    """`num_layers` blocks followed by a final norm (shared by the decoder and the f-gram model; the f-gram
    model may leave the norm out, scone.output_norm).

    With cfg.scan_layers (the default) the blocks' parameters are stacked along a leading
    'layers' axis and the stack runs as one jax.lax.scan, so XLA compiles one block however deep
    the model is (compile time independent of depth). Without it, a Python loop over separate
    blocks: easier to step through, identical math; `layout.py` converts states between the two.
    Each block runs under the remat policy cfg.remat (remat.py).

    Decoding passes a KVCache in the same layout (init_cache): scanned, its [layers, ...] keys and
    values are scanned together with the stacked parameters, each layer reading and rewriting its own
    slice; unscanned, the loop hands layer i its entry i. Without a cache nothing of this is traced.
    """

    def __init__(self, cfg, num_layers: int, rngs: nnx.Rngs, final_norm: bool = True):
        self.scanned = cfg.scan_layers
        self.num_layers = num_layers
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
        self.final_norm = make_norm(cfg, rngs) if final_norm else None

    def __call__(self, x, segment_ids, positions, cache: KVCache | None = None):
        """[B, T, d] -> final-norm hidden states (the last block's residual stream without the final norm); with
        `cache`, (those, the updated cache)."""
        if cache is None:
            return self.norm(self.blocks_between(x, segment_ids, positions))
        x, cache = self.blocks_between(x, segment_ids, positions, cache)
        return self.norm(x), cache._replace(index=cache.index + x.shape[1])

    def norm(self, x):
        """The final norm (none: x itself), after the last block."""
        x = constrain(x, ACTIVATION_AXES)
        return self.final_norm(x) if self.final_norm is not None else x

    def blocks_between(self, x, segment_ids, positions, cache: KVCache | None = None, start: int = 0,
                       end: int | None = None):
        """Blocks start .. end-1 (all by default) on the residual stream [B, T, d] (a decoder with Engram runs its
        stack in pieces, model/engram.py); with `cache`, (the stream, the cache with those layers' keys and values
        rewritten, its index unchanged: __call__ or the decoder advances it once all layers ran)."""
        end = self.num_layers if end is None else end
        if start == end:
            return x if cache is None else (x, cache)

        def layer(x, block_state, layer_cache=None):
            block = nnx.merge(graphdef, block_state)
            return block(constrain(x, ACTIVATION_AXES), segment_ids, positions, layer_cache)

        def cached_layer(x, layer_inputs):  # one scan step: (block params, this layer's keys, values)
            block_state, key, value = layer_inputs
            x, new = layer(x, block_state, KVCache(key, value, cache.index))
            return x, (new.key, new.value)

        if self.scanned:
            graphdef, stacked = nnx.split(self.blocks)
            if (start, end) != (0, self.num_layers):
                stacked = jax.tree.map(lambda a: a[start:end], stacked)
            layer = remat.apply(layer, self.remat, in_scan=True)
            if cache is None:
                x, _ = jax.lax.scan(lambda carry, block_state: (layer(carry, block_state), None), x, stacked)
            else:
                x, (keys, values) = jax.lax.scan(cached_layer, x, (stacked, cache.key[start:end],
                                                                    cache.value[start:end]))
                if (start, end) != (0, self.num_layers):
                    keys, values = cache.key.at[start:end].set(keys), cache.value.at[start:end].set(values)
        else:
            layer = remat.apply(layer, self.remat, in_scan=False)
            keys, values = list(cache.key) if cache is not None else [], list(cache.value) if cache is not None else []
            for i in range(start, end):
                graphdef, block_state = nnx.split(self.blocks[i])
                if cache is None:
                    x = layer(x, block_state)
                else:
                    x, (keys[i], values[i]) = cached_layer(x, (block_state, cache.key[i], cache.value[i]))
            keys, values = tuple(keys), tuple(values)
        return x if cache is None else (x, cache._replace(key=keys, value=values))


def init_cache(cfg, batch: int, length: int, engram=None) -> KVCache:
    """An empty KVCache for decoding `batch` rows of up to `length` tokens with Decoder(cfg): zeros in the
    compute dtype, in the block stack's layout (stacked [layers, B, length, K, H] if cfg.scan_layers,
    else one array per layer; K = the key/value heads), written from slot 0; with an enabled `engram` config,
    one float32 [B, length, d] buffer per Engram layer too (model/engram.py)."""
    shape = (batch, length, kv_heads_of(cfg), head_dim_of(cfg))
    dtype = dtype_of(cfg.dtype)
    def zeros():
        if cfg.scan_layers:
            return jnp.zeros((cfg.num_layers, *shape), dtype)
        return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))

    buffers = ()
    if engram is not None and engram.enabled:
        buffers = tuple(jnp.zeros((batch, length, cfg.d_model), jnp.float32) for _ in engram_lib.layers(engram))
    return KVCache(zeros(), zeros(), jnp.zeros((), jnp.int32), buffers)


def cache_bytes(cfg, batch: int, length: int) -> int:
    """Bytes of init_cache(cfg, batch, length)'s keys and values: 2 x layers x batch x length x key/value
    heads x head width x the compute dtype's size (what grouped-query attention divides by
    num_heads / num_kv_heads)."""
    item = jnp.dtype(dtype_of(cfg.dtype)).itemsize
    return 2 * cfg.num_layers * batch * length * kv_heads_of(cfg) * head_dim_of(cfg) * item


def embedding_lookup(embed: nnx.Embed, tokens: jax.Array, dtype) -> jax.Array:
    """embed's rows for `tokens` ([..., n] int -> [..., n, d] in `dtype`), staying on the devices holding `tokens`.

    The table is gathered over FSDP first (as for any weight) so the lookup is local; left
    to itself XLA may shard the output like the table and reshuffle rows across devices."""
    table = constrain(embed.embedding[...], ("vocab", None))
    x = jnp.take(table, tokens, axis=0).astype(dtype)
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


class Decoder(nnx.Module):
    """GPT-2 style (learned positions, LayerNorm, GELU) or OLMo style (RoPE, RMSNorm, SwiGLU). With an enabled
    `overencoding` config section it also holds Over-Encoding's n-gram tables (model/overencoding.py), with an
    enabled `engram` section Engram's (model/engram.py, one module per layer of engram.layers, run before that
    block); either is then part of its parameters wherever they go (checkpoints, exports, the accelerator at
    serving)."""

    def __init__(self, cfg, rngs: nnx.Rngs, overencoding=None, engram=None):
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
        self.overencoding = OverEncoding(cfg, overencoding, rngs) if overencoding and overencoding.enabled else None
        with_engram = engram is not None and engram.enabled
        self.engram_layers = engram_lib.layers(engram) if with_engram else ()
        self.engram = nnx.List([engram_lib.Engram(cfg, engram, layer_heads, rngs)
                                for layer_heads in engram_lib.heads(engram)]) if with_engram else None
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
        """T(tokens): [..., n] int -> [..., n, d], rows staying on the devices holding `tokens`."""
        return embedding_lookup(self.token_embed, tokens, self.dtype)

    def input_tokens(self, tokens: jax.Array) -> jax.Array:
        """The decoder's input at token positions: T(tokens) times model.embedding_multiplier (1 in the
        method; the f-gram model reads T itself, through `embed`)."""
        return self._scaled(self.embed(tokens))

    def input_ngrams(self, tokens: jax.Array, ngram_ids: jax.Array) -> jax.Array:
        """The decoder's input with Over-Encoding: the mean of T(tokens) and the n-gram tables' projected rows
        (model/overencoding.py), times model.embedding_multiplier (the whole mean, so the multiplier keeps the
        paper's ratio of its terms; docs/method.md §8)."""
        return self._scaled(self.overencoding(self.embed(tokens), ngram_ids))

    def _scaled(self, x: jax.Array) -> jax.Array:
        multiplier = self.cfg.embedding_multiplier
        return x if multiplier == 1.0 else x * jnp.asarray(multiplier, x.dtype)

    def decode(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array,
               cache: KVCache | None = None, ngram_ids: jax.Array | None = None):
        """Input embeddings [B, T, d] -> final hidden states [B, T, d]. With `cache` (init_cache), the
        T tokens continue the cached ones of their row (one document each; segment_ids unused, pass None)
        and the result is (hidden states, updated cache): cached decoding runs these same modules. A decoder
        with Engram reads the batch's `ngram_ids` [B, T, layers x heads] between its blocks."""
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        x = x.astype(self.dtype)
        if self.engram is None:
            return self.stack(x, segment_ids, positions) if cache is None else self.stack(x, segment_ids, positions,
                                                                                         cache)
        return self._decode_with_engram(x, segment_ids, positions, cache, ngram_ids)

    def _decode_with_engram(self, x, segment_ids, positions, cache, ngram_ids):
        """The block stack in pieces, each Engram layer adding its Y to the stream before its block."""
        if ngram_ids is None:
            raise ValueError("The decoder has Engram tables but the batch carries no ngram_ids: the host computes "
                             "them (data/engram_hash.py EngramHasher) for every batch of such a model.")
        start, column, buffers = 0, 0, []
        for i, (block, module) in enumerate(zip(self.engram_layers, self.engram)):
            ids = ngram_ids[..., column: column + module.num_heads]
            column += module.num_heads
            if cache is None:
                x = module(self.stack.blocks_between(x, segment_ids, positions, None, start, block), ids, segment_ids)
            else:
                x, cache = self.stack.blocks_between(x, segment_ids, positions, cache, start, block)
                x, buffer = module(x, ids, None, cache.engram[i], cache.index)
                buffers.append(buffer)
            start = block
        if column != ngram_ids.shape[-1]:
            raise ValueError(f"The batch carries {ngram_ids.shape[-1]} Engram ids per position but the decoder's "
                             f"layers read {column}: the ids were made for another engram config.")
        if cache is None:
            return self.stack.norm(self.stack.blocks_between(x, segment_ids, positions, None, start))
        x, cache = self.stack.blocks_between(x, segment_ids, positions, cache, start)
        return self.stack.norm(x), cache._replace(index=cache.index + x.shape[1], engram=tuple(buffers))

    def logits(self, h: jax.Array) -> jax.Array:
        """Hidden states -> fp32 logits over the vocabulary (tied or separate head)."""
        if self.head is None:
            out = self.token_embed.attend(h)
        else:
            out = self.head(h)
        return out.astype(jnp.float32)

    def __call__(self, tokens, segment_ids, positions):
        if self.overencoding is not None or self.engram is not None:
            raise ValueError("An Over-Encoding or Engram decoder reads n-gram ids beside the tokens: run it through "
                             "model/scone.py's token_losses or hidden_states with a Batch carrying ngram_ids.")
        return self.logits(self.decode(self.input_tokens(tokens), segment_ids, positions))
