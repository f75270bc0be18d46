"""SconeModel: the main decoder whose input embedding is replaced at f-gram matches.

Per data shard the batch carries the f-grams to run (`fgram_tokens` [U, K], `fgram_lengths`
[U]: the shard's maximal unique f-grams, see fgram/dedup.py) and, per position, the slot
row*K + j whose f-gram-model output is that position's embedding (`fgram_index`, -1 = no
match). The f-gram model runs once per row and the results are gathered back inside the
shard: the arrays of shard s sit on the devices holding batch rows of shard s, so nothing
crosses devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax.model.fgram_model import FgramModel
from scone_jax.model.transformer import Decoder


class SconeModel(nnx.Module):
    def __init__(self, main_cfg, scone_cfg, rngs: nnx.Rngs):
        self.decoder = Decoder(main_cfg, rngs)
        self.fgram_model = FgramModel(main_cfg, scone_cfg, rngs)
        self.capacity = scone_cfg.fgram_capacity

    def fgram_embeddings(self, fgram_tokens: jax.Array, fgram_lengths: jax.Array) -> jax.Array:
        """F-gram model over f-gram rows [N, K] -> [N, d]; shares T with the decoder."""
        return self.fgram_model(self.decoder.embed(fgram_tokens), fgram_lengths)

    def input_embeddings(self, batch: dict) -> jax.Array:
        """T(token) everywhere, replaced by the f-gram embedding where a match ends."""
        x = self.decoder.embed(batch["inputs"])
        tokens = batch["fgram_tokens"]
        slots = self.fgram_model.all_positions(self.decoder.embed(tokens), batch["fgram_lengths"])
        index = batch["fgram_index"]
        num_shards = tokens.shape[0] // self.capacity
        b, t = index.shape
        per_shard = slots.reshape(num_shards, self.capacity * tokens.shape[1], -1)
        index_per_shard = index.reshape(num_shards, (b // num_shards) * t)
        gathered = jax.vmap(lambda r, i: jnp.take(r, jnp.maximum(i, 0), axis=0))(per_shard, index_per_shard)
        gathered = gathered.reshape(b, t, -1).astype(x.dtype)
        return jnp.where((index >= 0)[..., None], gathered, x)

    def batch_logits(self, batch: dict) -> jax.Array:
        x = self.input_embeddings(batch)
        h = self.decoder.decode(x, batch["segment_ids"], batch["positions"])
        return self.decoder.logits(h)
