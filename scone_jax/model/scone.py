"""The SCONE input seam: one code path from a Batch to input embeddings, hidden states, logits and token
losses (and the perplexity of their mean), for every caller (train and eval steps, serving's evaluation,
harness scoring, generation).

The decoder's input is T(token) everywhere, replaced where an f-gram ends by that f-gram's embedding
(docs/method.md §3; with scone.gate or scone.combine='add', by its mix with T(token), SconeModel.matched_inputs). The
embeddings come from one of two providers, chosen by the batch's arrays (scone_jax/batch.py):
  trained  the f-gram model of a SconeModel, run once per row of each group's maximal unique f-grams
           (fgram_tokens [G, C, K], fgram_lengths [G, C]) and read back per position through its slot
           (fgram_slot, row*K + j, -1 = no match), inside the group: the arrays of group g sit on the
           device holding its batch rows, so nothing crosses devices (training, docs/method.md §5);
  table    rows of the exported table gathered on the host (fgram_rows [B, T, d], fgram_matched [B, T]):
           the device holds only the decoder (serving, docs/method.md §7).
A batch without f-gram arrays is a plain decoder's. `model` is a SconeModel or a Decoder.

Beside them, the baseline SCONE is compared with: Over-Encoding (model/overencoding.py, docs/method.md §8), whose
hashed n-gram tables sit in the Decoder itself; its input is the mean of T(token) and their projected rows, read
through the batch's ngram_ids (host-computed, data/ngram_hash.py) in training and serving alike. And Engram
(model/engram.py, docs/method.md §9): its tables sit in the Decoder too, but it reads the same batch field (ids of
data/engram_hash.py) inside the block stack, so its input is T(token) and `hidden_states` hands the ids to decode.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from scone_jax import sharding
from scone_jax.model.fgram_model import FgramModel
from scone_jax.model.layers import KVCache
from scone_jax.model.transformer import Decoder


class SconeModel(nnx.Module):
    """The main decoder and the f-gram model, trained jointly (they share T, unless scone.own_token_embedding)."""

    def __init__(self, main_cfg, scone_cfg, rngs: nnx.Rngs):
        self.decoder = Decoder(main_cfg, rngs)
        self.fgram_model = FgramModel(main_cfg, scone_cfg, rngs)

    def fgram_embeddings(self, fgram_tokens: jax.Array, fgram_lengths: jax.Array) -> jax.Array:
        """F-gram rows [N, K] -> [N, d]: what the decoder receives at a position where that f-gram is matched,
        so the export's table holds it and serving replaces T(token) by it as the method does. That is the
        f-gram model's output (sharing T with the decoder), combined (matched_inputs: the gate, scone.combine,
        row_scale, the output ramp) with the decoder's input for the f-gram's last token, the token at that
        position."""
        rows = self.fgram_model(self.fgram_inputs(fgram_tokens), fgram_lengths)
        f = self.fgram_model
        if f.gate is None and f.combine == "replace" and f.row_scale == "raw" and f.ramp is None:  # the method: f
            return rows
        last = jnp.take_along_axis(fgram_tokens, jnp.maximum(fgram_lengths - 1, 0)[:, None], axis=1)[:, 0]
        return self.matched_inputs(rows, self.decoder.input_tokens(last))

    def fgram_inputs(self, fgram_tokens: jax.Array) -> jax.Array:
        """The f-gram model's token inputs [..., K, *]: the decoder's T (the method, shared with the decoder), or
        with scone.own_token_embedding its own table's rows (a pretrained source's embed_tokens)."""
        if self.fgram_model.token_embed is not None:
            return self.fgram_model.embed(fgram_tokens)
        return self.decoder.embed(fgram_tokens)

    def matched_inputs(self, rows: jax.Array, token_inputs: jax.Array) -> jax.Array:
        """The decoder's input at matched positions from the f-gram model's rows: the rows themselves (the
        method), or with scone.gate (1 - g) T(token) + g rows, `token_inputs` being the decoder's own input
        there (model.embedding_multiplier included). g is one learned scalar starting at 0, so a gated run
        starts as the baseline does and reaches the method's replacement at g = 1 (docs/training.md). With
        scone.combine='add' the token's input stays: T(token) + rows (+ g rows with the gate). With
        scone.row_scale='token_rms' each row is first rescaled to the RMS of its token's input (in fp32). With
        scone.output_ramp_steps the result x enters as (1 - r) T(token) + r x, r the train step's ramp."""
        gate = self.fgram_model.gate
        g = None if gate is None else gate[...].astype(rows.dtype)
        token_inputs = token_inputs.astype(rows.dtype)
        if self.fgram_model.row_scale == "token_rms":
            rows = at_token_rms(rows, token_inputs)
        if self.fgram_model.combine == "add":
            x = token_inputs + (rows if g is None else g * rows)
        else:
            x = rows if g is None else (1 - g) * token_inputs + g * rows
        if self.fgram_model.ramp is None:
            return x
        r = self.fgram_model.ramp[...].astype(rows.dtype)
        return (1 - r) * token_inputs + r * x


ROW_SCALE_EPS = 1e-6


def at_token_rms(rows: jax.Array, token_inputs: jax.Array) -> jax.Array:
    """rows [..., d] rescaled to the RMS of token_inputs [..., d] (scone.row_scale='token_rms'), computed in fp32:
    rows * rms(token) / sqrt(mean(rows^2) + eps)."""
    r = rows.astype(jnp.float32)
    t = token_inputs.astype(jnp.float32)
    scale = jnp.sqrt(jnp.mean(t * t, axis=-1, keepdims=True)) * jax.lax.rsqrt(
        jnp.mean(r * r, axis=-1, keepdims=True) + ROW_SCALE_EPS)
    return (r * scale).astype(rows.dtype)


def decoder_of(model) -> Decoder:
    return model.decoder if isinstance(model, SconeModel) else model


def _gather_in_groups(slots: jax.Array, index: jax.Array) -> jax.Array:
    """slots [g, C*K, d], index [g, n] -> [g, n, d]: each group reads its own slots (-1 reads
    slot 0, which the caller replaces by T(token))."""
    return jax.vmap(lambda r, i: jnp.take(r, jnp.maximum(i, 0), axis=0))(slots, index)


def trained_fgram_rows(model: SconeModel, batch) -> tuple[jax.Array, jax.Array]:
    """The trained provider: (f-gram embedding per position [B, T, d], matched [B, T])."""
    groups, capacity, k = batch.fgram_tokens.shape
    tokens = batch.fgram_tokens.reshape(groups * capacity, k)
    slots = model.fgram_model.all_positions(model.fgram_inputs(tokens), batch.fgram_lengths.reshape(-1))
    b, t = batch.fgram_slot.shape
    per_group = slots.reshape(groups, capacity * k, -1)
    index_per_group = batch.fgram_slot.reshape(groups, (b // groups) * t)
    gathered = sharding.map_batch_shards(_gather_in_groups, per_group, index_per_group)
    return gathered.reshape(b, t, -1), batch.fgram_slot >= 0


def table_rows(batch) -> tuple[jax.Array, jax.Array]:
    """The table provider: the rows the host gathered, and where they apply."""
    return batch.fgram_rows, batch.fgram_matched


def input_embeddings(model, batch) -> jax.Array:
    """T(token) everywhere, replaced by the f-gram embedding where a match ends (docs/method.md §3); with
    Over-Encoding, the mean of T(token) and the hashed n-gram rows (docs/method.md §8)."""
    decoder = decoder_of(model)
    if decoder.engram is not None:
        if batch.fgram_slot is not None or batch.fgram_rows is not None:
            raise ValueError("The batch carries f-gram arrays but the decoder has Engram tables; a model reads one "
                             "kind of n-gram input.")
        return decoder.input_tokens(batch.inputs)
    if decoder.overencoding is not None or batch.ngram_ids is not None:
        return overencoded_inputs(decoder, batch)
    x = decoder.input_tokens(batch.inputs)
    if batch.fgram_slot is not None:
        if not isinstance(model, SconeModel):
            raise ValueError("The batch carries trained f-gram slots but the model has no f-gram model.")
        rows, matched = trained_fgram_rows(model, batch)
        rows = model.matched_inputs(rows, x)
    elif batch.fgram_rows is not None:  # the export's rows: already what the decoder receives (fgram_embeddings)
        rows, matched = table_rows(batch)
    else:
        return x
    return jnp.where(matched[..., None], rows.astype(x.dtype), x)


def overencoded_inputs(decoder: Decoder, batch) -> jax.Array:
    """The Over-Encoding provider: the decoder's input from the batch's tokens and host-computed n-gram ids. A
    decoder without the tables given ids, or one with them given none, is refused: either would silently run
    another model than the one trained."""
    if decoder.overencoding is None:
        raise ValueError("The batch carries Over-Encoding n-gram ids but the decoder has no n-gram tables "
                         "(overencoding.enabled was False when it was built).")
    if batch.ngram_ids is None:
        raise ValueError("The decoder has Over-Encoding n-gram tables but the batch carries no ngram_ids: the host "
                         "computes them (data/ngram_hash.py NgramHasher) for every batch of such a model.")
    if batch.fgram_slot is not None or batch.fgram_rows is not None:
        raise ValueError("The batch carries both f-gram arrays and Over-Encoding n-gram ids; a model reads one kind.")
    return decoder.input_ngrams(batch.inputs, batch.ngram_ids)


def hidden_states(model, batch, cache: KVCache | None = None):
    """Final-norm hidden states [B, T, d] of the batch; with `cache` (decoding, transformer.init_cache) the
    batch's tokens continue the cached ones and the result is (hidden states, updated cache)."""
    decoder = decoder_of(model)
    ids = batch.ngram_ids if decoder.engram is not None else None
    return decoder.decode(input_embeddings(model, batch), batch.segment_ids, batch.positions, cache, ids)


def batch_logits(model, batch) -> jax.Array:
    """fp32 logits [B, T, vocab]."""
    return decoder_of(model).logits(hidden_states(model, batch))


def cross_entropy(logits: jax.Array, batch) -> jax.Array:
    """Per-token cross-entropy [B, T] (fp32, nats) of batch.targets under `logits`, zero where loss_mask is 0."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets) * batch.loss_mask


def token_losses(model, batch) -> jax.Array:
    """Per-token next-token loss [B, T]: the one definition behind training's loss, held-out evaluation,
    serving's perplexity and harness scores."""
    return cross_entropy(batch_logits(model, batch), batch)


# A diverged run's loss is reported as a finite perplexity (e^50) rather than as an overflow.
_MAX_LOG_PERPLEXITY = 50.0


def perplexity(mean_loss: float) -> float:
    """exp of a mean token loss (nats), capped at e^50."""
    return math.exp(min(mean_loss, _MAX_LOG_PERPLEXITY))
