"""Jitted train and eval steps: pure functions of (state, batch) with explicit shardings.

Every batch array is sharded on its first dimension over the (data, fsdp) axes, so a batch
row (and a data shard's f-gram rows) never leaves the device that holds it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from scone_jax import sharding
from scone_jax.optimizer import learning_rate_schedule


def token_losses(model, batch: dict) -> jax.Array:
    """Per-token cross-entropy [B, T] (fp32), zero where loss_mask is 0."""
    logits = model.batch_logits(batch)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return ce * batch["loss_mask"]


def _loss_sum(params, graph, rest, batch):
    model = nnx.merge(graph, params, rest)
    return token_losses(model, batch).sum(), batch["loss_mask"].sum()


def _micro_batches(batch: dict, accum: int) -> dict:
    """[B, ...] -> [accum, B/accum, ...]; micro-batch i takes rows i, i+accum, ... so every
    device contributes rows to every micro-batch and no data moves between devices."""
    def split(x):
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def _grads(params, graph, rest, batch: dict, accum: int):
    grad_fn = jax.value_and_grad(_loss_sum, has_aux=True)
    if accum == 1:
        (loss, count), grads = grad_fn(params, graph, rest, batch)
        return loss, count, grads

    def body(carry, mb):
        loss, count, grads = carry
        (l, n), g = grad_fn(params, graph, rest, mb)
        return (loss + l, count + n, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, count, grads), _ = jax.lax.scan(body, (0.0, 0.0, zeros), _micro_batches(batch, accum))
    return loss, count, grads


def make_train_step(graphdef, state_shardings, mesh, config):
    """Return step(state, batch) -> (state, metrics), jitted and donating the old state."""
    accum = config.train.grad_accum_steps
    schedule = learning_rate_schedule(config.train)

    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        loss_sum, count, grads = _grads(params, graph, rest, batch, accum)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        metrics = {
            "loss": loss_sum / count,
            "tokens": count,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(opt.step[...]),
        }
        opt.update(model, grads)
        # A finite loss can still leave exploded weights; their norm overflows and is caught too.
        metrics["param_norm"] = optax.tree.norm(nnx.state(model, nnx.Param))
        return nnx.state((model, opt)), metrics

    return _under_mesh(mesh, jax.jit(
        step,
        in_shardings=(state_shardings, _batch_shardings(mesh)),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    ))


def make_eval_step(graphdef, state_shardings, mesh):
    """Return eval(state, batch) -> (sum of token losses, number of target tokens)."""
    def step(state, batch):
        model, _ = nnx.merge(graphdef, state)
        return token_losses(model, batch).sum(), batch["loss_mask"].sum()

    return _under_mesh(mesh, jax.jit(step, in_shardings=(state_shardings, _batch_shardings(mesh))))


def _under_mesh(mesh, jitted):
    """Trace and run under the mesh so activation constraints (sharding.constrain) apply."""
    def call(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    call.lower = lambda *args: _lower_under_mesh(mesh, jitted, *args)
    return call


def _lower_under_mesh(mesh, jitted, *args):
    with jax.set_mesh(mesh):
        return jitted.lower(*args)


def _batch_shardings(mesh):
    """One sharding for every batch array: P(BATCH_AXES) shards dimension 0 whatever the rank."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES))
