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
  DONE             written by the run (process 0) once it has trained all train.num_steps steps:
                   what launch/tpu.py babysit waits for (a run stopped early never writes it)
  logs/            each worker's log, copied by launch/worker.sh
"""
from __future__ import annotations

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
