"""Train state = model + optimizer, created abstractly first and then directly into its shardings.

The state is handled as (graphdef, nnx.State): the step functions are pure functions of the
State, so they can be jitted with explicit shardings and donated buffers.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from scone_jax import sharding
from scone_jax.model.scone import SconeModel
from scone_jax.model.transformer import Decoder
from scone_jax.optimizer import make_optimizer


def build_model(config) -> nnx.Module:
    """The plain decoder, or the SCONE model (decoder + f-gram model) if scone.enabled."""
    rngs = nnx.Rngs(config.train.seed)
    if config.scone.enabled:
        return SconeModel(config.model, config.scone, rngs)
    return Decoder(config.model, rngs)


def _create(config):
    model = build_model(config)
    optimizer = nnx.Optimizer(model, make_optimizer(config.train), wrt=nnx.Param)
    return nnx.split((model, optimizer))


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """What is known about the train state before any parameter exists."""

    graphdef: nnx.GraphDef
    abstract: nnx.State  # ShapeDtypeStructs
    shardings: nnx.State  # NamedShardings, same structure


def state_spec(config, mesh) -> StateSpec:
    graphdef, abstract = nnx.eval_shape(lambda: _create(config))
    return StateSpec(graphdef, abstract, sharding.state_shardings(abstract, mesh))


def init_state(config, spec: StateSpec) -> nnx.State:
    """Materialize parameters and optimizer state, each array created in its own sharding."""
    create = jax.jit(lambda: _create(config)[1], out_shardings=spec.shardings)
    return create()


def abstract_with_shardings(spec: StateSpec) -> nnx.State:
    """ShapeDtypeStructs carrying shardings: the restore target for checkpoints."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), spec.abstract, spec.shardings
    )


def model_of(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.Module:
    model, _ = nnx.merge(graphdef, state)
    return model
