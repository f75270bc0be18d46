"""What a run's workdir holds, named once (local path or gs:// URL; the launcher adds logs/).

  OWNER            the lease of the run that owns the workdir (runtime/ownership.py)
  config.json      the resolved config of the latest start
  tokenizer.model  the tokenizer trained on first use (when data.tokenizer_path is '')
  fgrams/          the f-gram vocabulary extracted on first use (when scone.vocab_path is '')
  checkpoints/     orbax checkpoints, one directory per step
  metrics.jsonl    one JSON record per step and per evaluation
  tensorboard/     TensorBoard event files
  compilation_cache/  JAX's persistent compilation cache (train.compilation_cache_dir's default)
  profile/         jax.profiler traces of train.profile_steps (training/profile.py)
  DONE             written by the run (process 0) once it has trained all train.num_steps steps,
                   {"step": N, "finished": time}: what launch/tpu.py babysit and tools/bench_quality.py
                   wait for (a run stopped early never writes it; a start that trains past N, its
                   train.num_steps raised, removes it before its first step)
  logs/            each worker's log, copied by launch/worker.sh
"""
from __future__ import annotations

import json

from absl import logging

from scone_jax.runtime import storage

OWNER = "OWNER"
CONFIG = "config.json"
TOKENIZER = "tokenizer.model"
FGRAMS = "fgrams"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
PROFILE = "profile"
DONE = "DONE"


def path(workdir: str, name: str) -> str:
    """workdir/name, for local paths and gs:// URLs alike."""
    return storage.join(workdir, name)


def remove_stale_done(workdir: str, num_steps: int) -> None:
    """Remove DONE if a start that trains to `num_steps` goes past the step it names (train.num_steps raised), or
    it names none: until the run reaches its new end, launch/tpu.py babysit and tools/bench_quality.py must not
    take it for finished. Called by the run (process 0, the workdir held) before its first step."""
    raw = storage.read_bytes(workdir, DONE)
    if raw is None:
        return
    try:
        done = int(json.loads(raw)["step"])
    except (ValueError, TypeError, KeyError):
        done = None
    if done is None or done < num_steps:
        storage.delete(workdir, DONE)
        logging.info("Removed %s (step %s): this run trains on to step %d.", path(workdir, DONE), done, num_steps)
