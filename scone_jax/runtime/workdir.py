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
A config.json, metrics.jsonl or DONE that a run did not write is never replaced, rewritten or deleted: the run is
refused first (check_free).
"""
from __future__ import annotations

import json

from absl import logging

from scone_jax.runtime import outputs, storage

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


def check_free(workdir: str, inputs: dict[str, str]) -> None:
    """The rule every output follows (runtime/outputs.py), for a run's workdir, before anything is written there:
    it is not one of the run's input directories (`inputs`: key -> path, e.g. model.init_from_hf), nor inside one,
    and the files a run replaces, rewrites or deletes there (config.json, metrics.jsonl, DONE) are a run's (a
    Hugging Face checkpoint's config.json, or any other, would be lost)."""
    outputs.refuse_inputs(workdir, "--workdir", inputs)
    for name, is_ours, prefix in ((CONFIG, is_run_config, None), (METRICS, _is_metrics, 1 << 16),
                                  (DONE, _is_done, None)):
        outputs.refuse_foreign(workdir, name, is_ours=is_ours, kind="a scone_jax run", flag="--workdir",
                               prefix=prefix)


def is_run_config(raw: bytes) -> bool:
    """Whether `raw` is a config.json a run wrote (config.write_config): a JSON object of the config's sections."""
    config = _json(raw)
    return isinstance(config, dict) and all(isinstance(config.get(k), dict) for k in ("model", "data", "train"))


def _is_metrics(head: bytes) -> bool:
    """Whether `head`, the start of a metrics.jsonl, is a run's: empty, or a first line that is a step's record."""
    first = head.split(b"\n", 1)[0]
    record = _json(first) if first.strip() else {"step": 0}
    return isinstance(record, dict) and "step" in record


def _is_done(raw: bytes) -> bool:
    done = _json(raw)
    return isinstance(done, dict) and "step" in done


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


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
