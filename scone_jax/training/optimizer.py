"""AdamW with linear warmup, cosine decay to a floor and global-norm clipping; optionally the f-gram model's
updates held back for the first steps (train.fgram_model_delay_steps, _per_layer or _fraction), its learning rate
a multiple of the rest's (scone.learning_rate_multiplier) and scone.gate's a further multiple of that
(scone.gate_learning_rate_multiplier), docs/training.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from scone_jax import config as config_lib
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


def fgram_model_delay(config) -> int:
    """D, the f-gram model's delay in steps: train.fgram_model_delay_steps, or
    train.fgram_model_delay_steps_per_layer times the f-gram model's depth, or
    config.delay_steps_for_fraction(train.fgram_model_delay_fraction, train.num_steps) (config.validate refuses two)."""
    t = config.train
    return (t.fgram_model_delay_steps or t.fgram_model_delay_steps_per_layer * config.scone.num_layers
            or config_lib.delay_steps_for_fraction(t.fgram_model_delay_fraction, t.num_steps))


def fgram_model_update_scale(delay: int, multiplier: float = 1.0) -> optax.Schedule:
    """The factor on the f-gram model's updates, a function of optax's count c = step - 1 (it counts from 0):
    `multiplier` times a ramp that is 0 for steps 1..D (D = `delay`), k/D at step D + k, and 1 from step 2D on.
    Why: with the method's joint training from step 1, the f-gram model's rows all turn to one direction early
    on and stop improving for a while (docs/quality.md, 'collapse'); letting the decoder and the token
    embeddings settle first avoids that."""
    return lambda count: multiplier * jnp.clip((count + 1 - delay) / max(delay, 1), 0.0, 1.0)


def make_optimizer(config) -> optax.GradientTransformation:
    """The optimizer of the whole model (the full config: the f-gram model's settings are under scone and
    train). Its updates of the f-gram model's parameters (model/roles.py) are scaled last, after AdamW's
    learning rate and decoupled weight decay: by scone.learning_rate_multiplier (the f-gram model's rate is
    that multiple of the rate) and the delay's ramp. With a delay > 0 the state holds one more counter, so a
    run cannot switch between no delay and a delay on resume (the checkpoint's shape check says so); other
    delay values may change. scone.gate_learning_rate_multiplier scales the gate's update once more. The clipping
    before them sees the whole model's gradient, unscaled."""
    t = config.train
    parts = []
    if t.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(t.grad_clip_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(t),
            b1=t.b1,
            b2=t.b2,
            eps=t.eps,
            weight_decay=t.weight_decay,
            # Always masked, so the optimizer state has one structure whatever weight_decay a resumed run sets.
            mask=lambda params: decay_mask(params, t.weight_decay),
        )
    )
    delay, multiplier = fgram_model_delay(config), float(config.scone.learning_rate_multiplier)
    fgram_scale = (optax.scale_by_schedule(fgram_model_update_scale(delay, multiplier)) if delay > 0
                   else optax.scale(multiplier) if multiplier != 1.0 else None)
    if fgram_scale is not None:
        parts.append(optax.masked(fgram_scale, lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: roles.in_fgram_model(path), params)))
    gate = float(config.scone.get("gate_learning_rate_multiplier", 1.0))
    if gate != 1.0:  # the gate's own factor, on top of the f-gram model's (its multiplier and delay)
        parts.append(optax.masked(optax.scale(gate), lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: roles.is_gate(path), params)))
    return optax.chain(*parts)
