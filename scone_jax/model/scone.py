"""SconeModel: the main decoder whose input embedding is replaced at f-gram matches.

The batch's rows fall into G groups of contiguous rows (one per data shard, or per data shard
and micro-batch; see fgram/dedup.py). Per group it carries the f-grams to run
(`fgram_tokens` [G, C, K], `fgram_lengths` [G, C]: the group's maximal unique f-grams) and,
per position, the slot row*K + j whose f-gram-model output is that position's embedding
(`fgram_index`, -1 = no match). The f-gram model runs once per row and the results are
gathered back inside the group: the arrays of group g sit on the device holding its batch
rows, so nothing crosses devices. The model reads G from the arrays' shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax import sharding
from scone_jax.model.fgram_model import FgramModel
from scone_jax.model.transformer import Decoder


def _gather_in_groups(slots: jax.Array, index: jax.Array) -> jax.Array:
    """slots [g, C*K, d], index [g, n] -> [g, n, d]: each group reads its own slots (-1 reads
    slot 0, which the caller replaces by T(token))."""
    return jax.vmap(lambda r, i: jnp.take(r, jnp.maximum(i, 0), axis=0))(slots, index)


class SconeModel(nnx.Module):
    def __init__(self, main_cfg, scone_cfg, rngs: nnx.Rngs):
        self.decoder = Decoder(main_cfg, rngs)
        self.fgram_model = FgramModel(main_cfg, scone_cfg, rngs)

    def fgram_embeddings(self, fgram_tokens: jax.Array, fgram_lengths: jax.Array) -> jax.Array:
        """F-gram model over f-gram rows [N, K] -> [N, d]; shares T with the decoder."""
        return self.fgram_model(self.decoder.embed(fgram_tokens), fgram_lengths)

    def input_embeddings(self, batch: dict) -> jax.Array:
        """T(token) everywhere, replaced by the f-gram embedding where a match ends."""
        x = self.decoder.embed(batch["inputs"])
        groups, capacity, k = batch["fgram_tokens"].shape
        tokens = batch["fgram_tokens"].reshape(groups * capacity, k)
        slots = self.fgram_model.all_positions(self.decoder.embed(tokens), batch["fgram_lengths"].reshape(-1))
        index = batch["fgram_index"]
        b, t = index.shape
        per_group = slots.reshape(groups, capacity * k, -1)
        index_per_group = index.reshape(groups, (b // groups) * t)
        gathered = sharding.map_batch_shards(_gather_in_groups, per_group, index_per_group)
        gathered = gathered.reshape(b, t, -1).astype(x.dtype)
        return jnp.where((index >= 0)[..., None], gathered, x)

    def batch_logits(self, batch: dict) -> jax.Array:
        x = self.input_embeddings(batch)
        h = self.decoder.decode(x, batch["segment_ids"], batch["positions"])
        return self.decoder.logits(h)
