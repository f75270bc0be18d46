"""AdamW with linear warmup, cosine decay and global-norm clipping; optionally the f-gram model's
updates held back for the first steps (train.fgram_model_delay_steps, docs/training.md)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from scone_jax.model import roles


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train_cfg.learning_rate,
        warmup_steps=train_cfg.warmup_steps,
        decay_steps=max(train_cfg.num_steps, train_cfg.warmup_steps + 1),
        end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio,
    )


def decay_mask(params, weight_decay: float = 0.0):
    """True for the parameters weight decay applies to: the weight matrices, by role (model/roles.py), in
    either block layout. With weight_decay > 0, a tree in which no parameter is a matrix is an error, not a
    silent no-decay run."""
    mask = jax.tree_util.tree_map_with_path(lambda path, _: roles.is_decayed(path), params)
    if weight_decay > 0 and not any(jax.tree_util.tree_leaves(mask)):
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)][:5]
        raise ValueError(
            f"train.weight_decay > 0 but no parameter is a weight matrix (a '{roles.MATRIX_LEAVES[0]}' of a Linear "
            f"layer; model/roles.py), so nothing would be decayed. Parameters seen: {names}. Fix: name the model's "
            "matrices by model/roles.py's rules, or set --config.train.weight_decay=0.")
    return mask


def fgram_model_update_scale(train_cfg) -> optax.Schedule:
    """The factor on the f-gram model's updates at each step: 0 for the first D =
    train.fgram_model_delay_steps steps, then rising linearly to 1 over the next D. Why: with the
    method's joint training from step 1, the f-gram model's rows all turn to one direction early on
    and stop improving for a while (docs/quality.md, 'collapse'); letting the decoder and the token
    embeddings settle first avoids that."""
    delay = train_cfg.fgram_model_delay_steps
    return lambda step: jnp.clip((step - delay) / max(delay, 1), 0.0, 1.0)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """The optimizer of the whole model. With train.fgram_model_delay_steps > 0 its state holds one
    more counter, so a run cannot switch between 0 and > 0 on resume (the checkpoint's shape check
    says so); other delay values may change."""
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
            # Always masked, so the optimizer state has one structure whatever weight_decay a resumed run sets.
            mask=lambda params: decay_mask(params, train_cfg.weight_decay),
        )
    )
    if train_cfg.fgram_model_delay_steps > 0:
        parts.append(optax.masked(
            optax.scale_by_schedule(fgram_model_update_scale(train_cfg)),
            lambda params: jax.tree_util.tree_map_with_path(lambda path, _: roles.in_fgram_model(path), params)))
    return optax.chain(*parts)
