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
from scone_jax.batch import Batch
from scone_jax.model.scone import token_losses
from scone_jax.training.optimizer import learning_rate_schedule


def _loss_sum(params, graph, rest, batch):
    model = nnx.merge(graph, params, rest)
    return token_losses(model, batch).sum(), batch.loss_mask.sum()


def split_micro_batches(batch: Batch, accum: int, num_shards: int) -> Batch:
    """[B, ...] -> [accum, B/accum, ...]: micro-batch a takes the a-th contiguous block of rows
    of every data shard, so no data moves between devices. The f-gram arrays ([G, C, K] with
    G = num_shards * accum groups, fgram/dedup.py) split the same way, so micro-batch a gets
    group a of every shard: exactly the f-gram rows its positions' slots point at."""
    def split(x):
        n, rest = x.shape[0], x.shape[1:]
        x = x.reshape(num_shards, accum, n // (num_shards * accum), *rest)
        return jnp.swapaxes(x, 0, 1).reshape(accum, n // accum, *rest)

    return jax.tree.map(split, batch)


def loss_and_grads(model, batch: Batch, accum: int = 1, num_shards: int = 1):
    """(sum of token losses, target tokens, gradients of the sum w.r.t. nnx.Param), accumulated
    over `accum` micro-batches (split_micro_batches) in a scan: the train step's core."""
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.value_and_grad(_loss_sum, has_aux=True)
    if accum == 1:
        (loss, count), grads = grad_fn(params, graph, rest, batch)
        return loss, count, grads

    def body(carry, mb):
        loss, count, grads = carry
        mb = jax.tree.map(lambda v: sharding.constrain(v, ("batch",) + (None,) * (v.ndim - 1)), mb)
        (l, n), g = grad_fn(params, graph, rest, mb)
        return (loss + l, count + n, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    micro = split_micro_batches(batch, accum, num_shards)
    (loss, count, grads), _ = jax.lax.scan(body, (0.0, 0.0, zeros), micro)
    return loss, count, grads


def make_train_step(graphdef, state_shardings, mesh, config):
    """Return step(state, batch) -> (state, metrics), jitted and donating the old state."""
    return sharding.under_mesh(mesh, jax.jit(
        train_step_fn(graphdef, mesh, config),
        in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    ))


def set_output_ramp(model, step) -> None:
    """scone.output_ramp_steps W: the update made from `step` (0-based) sees r = min(1, (step + 1) / W), so the
    first sees 1/W and update W onwards the f-gram model's rows in full; the value stays in the model's state."""
    fgram_model = getattr(model, "fgram_model", None)
    if fgram_model is not None and fgram_model.ramp is not None:
        fgram_model.ramp[...] = jnp.minimum(1.0, (step + 1).astype(jnp.float32) / fgram_model.ramp_steps)


def train_step_fn(graphdef, mesh, config):
    """The train step, step(state, batch) -> (state, metrics), not yet jitted: make_train_step jits it and
    exported_step.py exports it."""
    accum = config.train.grad_accum_steps
    num_shards = sharding.num_batch_shards(mesh)
    schedule = learning_rate_schedule(config.train)

    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)
        set_output_ramp(model, opt.step[...])
        loss_sum, count, grads = loss_and_grads(model, batch, accum, num_shards)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        metrics = {
            "loss": loss_sum / count,
            "tokens": count,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(opt.step[...]),
        }
        if "fgram_model" in grads:  # SCONE: how much of the gradient reaches the f-gram model (docs/quality.md)
            metrics["fgram/model_grad_norm"] = optax.tree.norm(grads["fgram_model"])
        opt.update(model, grads)
        # A finite loss can still leave exploded weights; their norm overflows and is caught too.
        metrics["param_norm"] = optax.tree.norm(nnx.state(model, nnx.Param))
        return nnx.state((model, opt)), metrics

    return step


def make_eval_step(model_graphdef, model_shardings, mesh):
    """Return eval(model_state, batch) -> (sum of token losses, number of target tokens), jitted with the batch
    sharded by rows: the training loop's held-out evaluation (a SconeModel's or a Decoder's state, the f-gram
    model run on the fly) and serving's (an export's decoder, table rows in the batch) are this one step."""
    def step(model_state, batch):
        return token_losses(nnx.merge(model_graphdef, model_state), batch).sum(), batch.loss_mask.sum()

    return sharding.under_mesh(mesh, jax.jit(step, in_shardings=(model_shardings, sharding.batch_sharding(mesh))))

