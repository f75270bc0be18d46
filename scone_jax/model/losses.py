"""Perplexity from a mean token loss (the loss itself: model/scone.py token_losses, one definition for
training, evaluation and serving)."""
from __future__ import annotations

import math

# A diverged run's loss is reported as a finite perplexity (e^50) rather than as an overflow.
_MAX_LOG_PERPLEXITY = 50.0


def perplexity(mean_loss: float) -> float:
    """exp of a mean token loss (nats), capped at e^50."""
    return math.exp(min(mean_loss, _MAX_LOG_PERPLEXITY))
