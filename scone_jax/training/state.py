"""Train state = model + optimizer, created abstractly first and then directly into its shardings.

The state is handled as (graphdef, nnx.State): the step functions are pure functions of the
State, so they can be jitted with explicit shardings and donated buffers.
"""
from __future__ import annotations

import dataclasses

import jax
from absl import logging
from flax import nnx

from scone_jax import sharding
from scone_jax.hf import derive as hf_derive, fgram_source, load as hf_load
from scone_jax.model import layout
from scone_jax.model.scone import SconeModel
from scone_jax.model.transformer import Decoder
from scone_jax.training import checkpoint
from scone_jax.training.optimizer import make_optimizer


def build_model(config) -> nnx.Module:
    """The plain decoder (with Over-Encoding's tables if overencoding.enabled, Engram's if engram.enabled), or the
    SCONE model (decoder + f-gram model) if scone.enabled."""
    rngs = nnx.Rngs(config.train.seed)
    if config.scone.enabled:
        return SconeModel(config.model, config.scone, rngs)
    return Decoder(config.model, rngs, config.get("overencoding"), config.get("engram"))


def _create(config, loaded: dict | None = None):
    """(graphdef, state) of the model and its optimizer; with `loaded` ({'decoder': ..., 'fgram_model': ...}, either
    optional), those parameters are the ones loaded from Hugging Face checkpoints (the optimizer's state is made from
    them; the random ones they replace are never computed under jit: nothing uses them)."""
    model = build_model(config)
    for part, params in (loaded or {}).items():
        nnx.update(getattr(model, part) if config.scone.enabled else model, params)
    optimizer = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
    return nnx.split((model, optimizer))


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """What is known about the train state before any parameter exists."""

    graphdef: nnx.GraphDef  # of (model, optimizer)
    abstract: nnx.State  # ShapeDtypeStructs
    shardings: nnx.State  # NamedShardings, same structure
    model_graphdef: nnx.GraphDef  # of the model alone: its state is state[0] (the eval step's argument)

    @property
    def model_shardings(self) -> nnx.State:
        return self.shardings[0]


def state_spec(config, mesh) -> StateSpec:
    graphdef, abstract = nnx.eval_shape(lambda: _create(config))
    model_graphdef = nnx.eval_shape(lambda: nnx.split(build_model(config)))[0]
    return StateSpec(graphdef, abstract, sharding.state_shardings(abstract, mesh), model_graphdef)


def init_state(config, spec: StateSpec) -> nnx.State:
    """Materialize parameters and optimizer state, each array created in its own sharding. With
    model.init_from_hf the decoder's parameters are read from that Hugging Face checkpoint instead, and with
    scone.init_from_hf the f-gram model's token table, blocks and final norm from that one (hf/fgram_source.py),
    each straight into its sharding (hf/load.py), and the state is built from them; the rest (a SCONE run's
    projections and gate, or its whole f-gram model without a source) is randomly initialised."""
    sources = {"decoder": config.model.get("init_from_hf", "")}
    if config.scone.enabled:
        sources["fgram_model"] = config.scone.get("init_from_hf", "")
    if not any(sources.values()):
        return jax.jit(lambda: _create(config)[1], out_shardings=spec.shardings)()
    model_abstract = abstract_with_shardings(spec)[0]
    loaded = {}
    for part, directory in sources.items():
        if not directory:
            continue
        checkpoint = hf_derive.open_checkpoint(directory)
        if part == "fgram_model":
            params, report = fgram_source.load(checkpoint, model_abstract["fgram_model"], config.scone.max_len)
        else:
            params, report = hf_load.load_decoder(checkpoint, model_abstract["decoder"] if config.scone.enabled
                                                  else model_abstract)
        logging.info("Loaded %d parameters of the %s from %s: %.1f MB read by this process in %.1f s", report.tensors,
                     "f-gram model" if part == "fgram_model" else "decoder", checkpoint.directory,
                     report.bytes_read / 1e6, report.seconds)
        loaded[part] = params
    create = jax.jit(lambda loaded: _create(config, loaded)[1], out_shardings=spec.shardings, donate_argnums=0)
    return create(loaded)


def abstract_with_shardings(spec: StateSpec) -> nnx.State:
    """ShapeDtypeStructs carrying shardings: the restore target for checkpoints."""
    return sharding.sharded_abstract(spec.abstract, spec.shardings)


def restore(ckpt: checkpoint.Checkpointer, step: int, config, spec: StateSpec, mesh, expect: dict | None = None,
            meta: dict | None = None):
    """Restore checkpoint `step` into `spec`'s shardings, whichever block layout it was saved in
    (model.scan_layers, layout.py): a checkpoint of the other layout is restored as saved and
    converted. `meta`: the checkpoint's metadata if the caller has read it (read here otherwise; once
    either way). Returns (state, meta)."""
    meta = ckpt.read_checkpoint_meta(step) if meta is None else meta
    saved_scanned = layout.is_scanned(meta.get("config", {}))
    if saved_scanned == config.model.scan_layers:
        return ckpt.restore(step, abstract_with_shardings(spec), expect, meta=meta)
    saved = config.copy_and_resolve_references()
    with saved.unlocked():
        saved.model.scan_layers = saved_scanned
    saved_spec = state_spec(saved, mesh)
    state, meta = ckpt.restore(step, abstract_with_shardings(saved_spec), expect, meta=meta)
    converted = layout.convert(state, spec.abstract)
    return jax.device_put(converted, spec.shardings), meta


def model_of(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.Module:
    model, _ = nnx.merge(graphdef, state)
    return model
