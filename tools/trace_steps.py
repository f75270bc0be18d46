"""Replay the first steps of a training run and trace what the f-gram model does, step by step.

  python tools/trace_steps.py --run=/data/quality/scone/lr0.002 --steps=200 --output=trace.jsonl
  python tools/trace_steps.py --run=... --config.scone.output_norm=false --config.train.seed=1

A run's first steps are deterministic on one CPU (the same config, init seed and batch order), so this
trains them again from scratch with the run's config.json, tokenizer and f-gram vocabulary (built as training
builds a run, scone_jax.training.run, with a fresh state), through the production train step, and before
each step reads, on the same batch and state: the loss at matched and at unmatched positions, and how much
the f-gram rows of the batch share one direction (scone_jax/study/geometry.py's alignment: near 1 when they
have collapsed onto one vector, docs/quality.md). Each step's record (also the step's loss, gradient norms
and learning rate) goes to --output as JSONL; every --print_every steps a line is printed.
--config.KEY=VALUE replays the same batches under another setting (another seed, learning rate or
scone.output_norm); --positions_from=VOCAB splits the losses by that f-gram vocabulary's matches instead of
the run's own, so that two runs (a baseline and a SCONE arm, or two values of S) compare their losses at the
same positions.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_flags
from flax import nnx

from scone_jax import sharding
from scone_jax.config import base_config, define_override_flag, override_flag_error, set_overrides, validate
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import load_vocab
from scone_jax.model.scone import SconeModel, token_losses
from scone_jax.runtime import tool_main, workdir as workdir_layout
from scone_jax.saved_config import stored_config
from scone_jax.study.geometry import alignment, mean_norm
from scone_jax.training import run as run_lib

_RUN = flags.DEFINE_string("run", None, "A training run's workdir (it holds config.json).")
_STEPS = flags.DEFINE_integer("steps", 200, "Steps to replay from the start.")
_CONFIG = define_override_flag("trace_steps", base_config(), "--config.KEY=VALUE: a config setting to replay "
                               "under, on top of the run's config.json (repeat it for several).")
_OUTPUT = flags.DEFINE_string("output", "", "JSONL file for every step's record ('' = print only).")
_PRINT_EVERY = flags.DEFINE_integer("print_every", 10, "Print a line every this many steps.")
_POSITIONS_FROM = flags.DEFINE_string("positions_from", "", "An f-gram vocabulary whose matches decide which "
                                      "positions count as matched ('' = the run's own f-gram slots).")


def run_config(run: str, overrides: dict):
    """The run's resolved config (config.json) with the --config.KEY=VALUE settings (dotted key -> value)."""
    path = workdir_layout.path(run, workdir_layout.CONFIG)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: --run must be a training run's workdir (scone_jax.main "
                                "writes config.json there when it starts).")
    with open(path) as f:
        config = stored_config(json.load(f))
    with config.unlocked():
        set_overrides(config, overrides)
    validate(config)
    return config


def make_probe(spec, mesh):
    """probe(model state, batch, matched [B, T]) -> summed losses and counts at matched / unmatched positions, and
    the f-gram rows of the batch's unique f-grams (a SCONE model) in float32."""
    def probe(model_state, batch, matched):
        model = nnx.merge(spec.model_graphdef, model_state)
        losses, counted = token_losses(model, batch), batch.loss_mask > 0
        out = {"matched_sum": jnp.sum(losses * (counted & matched)), "matched": jnp.sum(counted & matched),
               "unmatched_sum": jnp.sum(losses * (counted & ~matched)), "unmatched": jnp.sum(counted & ~matched)}
        if isinstance(model, SconeModel):
            k = batch.fgram_tokens.shape[-1]
            out["rows"] = model.fgram_embeddings(batch.fgram_tokens.reshape(-1, k),
                                                 batch.fgram_lengths.reshape(-1)).astype(jnp.float32)
            out["row_used"] = batch.fgram_lengths.reshape(-1) > 0
        return out

    return sharding.under_mesh(mesh, jax.jit(probe))


def record(step: int, metrics: dict, probed: dict) -> dict:
    out = {"step": step, **{k: float(v) for k, v in metrics.items()}}
    for kind in ("matched", "unmatched"):
        count = float(probed[kind])
        out[f"{kind}_positions"] = count
        out[f"loss_{kind}"] = float(probed[f"{kind}_sum"]) / count if count else float("nan")
    if "rows" in probed:
        rows = np.asarray(probed["rows"])[np.asarray(probed["row_used"])]
        out["fgram_row_alignment"] = alignment(rows)
        out["fgram_row_norm"] = mean_norm(rows)
    return out


def main():
    if not _RUN.value:
        raise ValueError("Name a training run's workdir: --run=DIR.")
    if _STEPS.value < 1:
        raise ValueError(f"--steps={_STEPS.value}: replay at least one step.")
    config = run_config(_RUN.value, config_flags.get_override_values(flags.FLAGS["config"]))
    run = run_lib.build(config, _RUN.value, sharding.make_mesh(config.mesh), start=run_lib.FRESH)
    other = (Matcher(load_vocab(_POSITIONS_FROM.value, expected_tokenizer_fingerprint=run.tokenizer.fingerprint))
             if _POSITIONS_FROM.value else None)
    state, mesh = run.state, run.mesh
    probe = make_probe(run.spec, mesh)
    out = open(_OUTPUT.value, "w") if _OUTPUT.value else None
    batches = iter(run.train_data)  # from batch 0, as the run read them
    try:
        for step in range(1, _STEPS.value + 1):
            host = next(batches)
            if other is not None:
                matched = other.match(host.inputs, host.segment_ids) >= 0
            else:
                matched = host.fgram_slot >= 0 if host.fgram_slot is not None else np.zeros(host.inputs.shape, bool)
            batch, matched = sharding.global_batch((host.for_device(), matched), mesh)
            probed = jax.device_get(probe(state[0], batch, matched))  # before the step: the state its loss saw
            state, metrics = run.train_step(state, batch)
            rec = record(step, jax.device_get(metrics), probed)
            if out is not None:
                out.write(json.dumps(rec) + "\n")
            if step % _PRINT_EVERY.value == 0 or step == _STEPS.value:
                line = (f"step {step} loss {rec['loss']:.3f} (matched {rec['loss_matched']:.3f}, unmatched "
                        f"{rec['loss_unmatched']:.3f}) grad_norm {rec['grad_norm']:.3f} lr {rec['learning_rate']:.2e}")
                if "fgram_row_alignment" in rec:
                    line += (f" | f-gram model grad {rec['fgram/model_grad_norm']:.3f} rows: alignment "
                             f"{rec['fgram_row_alignment']:.3f} norm {rec['fgram_row_norm']:.2f}")
                print(line, flush=True)
    finally:
        getattr(batches, "close", lambda: None)()  # the pipeline's worker processes
        if out is not None:
            out.close()


if __name__ == "__main__":
    tool_main.run(main, "trace_steps", flag_error=lambda argv: override_flag_error(argv, base_config()))
