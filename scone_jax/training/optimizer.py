"""AdamW with linear warmup, cosine decay and global-norm clipping."""
from __future__ import annotations

import jax
import optax

from scone_jax.model.accounting import EMBEDDING_PARAMS


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train_cfg.learning_rate,
        warmup_steps=train_cfg.warmup_steps,
        decay_steps=max(train_cfg.num_steps, train_cfg.warmup_steps + 1),
        end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio,
    )


def _decay_mask(params):
    """Weight decay on matrices only: norms, biases and embedding tables are left alone."""
    def decays(path, leaf):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return leaf.ndim >= 2 and not names & set(EMBEDDING_PARAMS)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    parts = []
    if train_cfg.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(train_cfg.grad_clip_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(train_cfg),
            b1=train_cfg.b1,
            b2=train_cfg.b2,
            eps=train_cfg.eps,
            weight_decay=train_cfg.weight_decay,
            mask=_decay_mask,
        )
    )
    return optax.chain(*parts)
