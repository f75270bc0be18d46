"""Next-token loss and perplexity: one definition for the train and eval steps and for serving's evaluation,
so the numbers they report are the same quantity."""
from __future__ import annotations

import math

import jax
import optax

# A diverged run's loss is reported as a finite perplexity (e^50) rather than as an overflow.
_MAX_LOG_PERPLEXITY = 50.0


def token_cross_entropy(logits: jax.Array, batch: dict) -> jax.Array:
    """Per-token cross-entropy [B, T] (fp32) of batch["targets"], zero where batch["loss_mask"] is 0."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]) * batch["loss_mask"]


def perplexity(mean_loss: float) -> float:
    """exp of a mean token loss (nats), capped at e^50."""
    return math.exp(min(mean_loss, _MAX_LOG_PERPLEXITY))
