"""One process of the two-process tests in test_multihost.py (also imported there for the
one-process reference, so both sides run the same code).

    python -m tests.multihost_worker TASK PORT PROCESS_ID NUM_PROCESSES TOKENIZER DIR

TASK `train`: three train steps on fixed global batches (each process feeds the rows that a
one-process run places on its devices), a full held-out evaluation, then a checkpoint in
DIR/ckpt; process 0 writes DIR/train.json. TASK `restore`: restore DIR/ckpt, gather the
parameters and write them to DIR/restored.npz (process 0). TASK `scone`: three SCONE train
steps with gradient accumulation through the real data pipeline (each process reads its own
documents and deduplicates f-grams for its own data shards) with the f-gram vocabulary in
DIR/fgrams; process 0 writes DIR/scone.json. TASK `exit`: join and leave at once, the failure
watcher polling without pause.
"""
from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from scone_jax import config as config_lib, sharding
from scone_jax.data import pipeline, tokenizer as tokenizer_lib
from scone_jax.runtime import distributed
from scone_jax.training import assets, checkpoint, state as state_lib, steps
from tests.common import random_batch, small_config, training_graph_eval

NUM_STEPS = 3
TIMEOUT_S = 60


def make_config(tokenizer_path: str):
    config = small_config()
    config.data.tokenizer_path = tokenizer_path
    config.train.eval_batches = 0  # the whole held-out set: each example once, whatever the process count
    return config


def local_rows(global_batch):
    """This process's rows of a global batch: the mesh's devices are ordered by process, so
    process p holds the p-th contiguous block of rows."""
    n = len(global_batch.inputs) // jax.process_count()
    start = jax.process_index() * n
    return jax.tree.map(lambda v: v[start:start + n], global_batch)


def train_steps(config, workdir: str):
    """Train NUM_STEPS steps, evaluate and checkpoint; returns (state, losses, eval metrics)."""
    mesh = sharding.make_mesh(config.mesh)
    tokenizer = tokenizer_lib.Tokenizer.load(config.data.tokenizer_path)
    spec = state_lib.state_spec(config, mesh)
    state = state_lib.init_state(config, spec)
    train_step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    losses = []
    for s in range(NUM_STEPS):
        batch = local_rows(random_batch(seed=s, vocab=config.model.vocab_size))
        state, metrics = train_step(state, sharding.global_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    ev = training_graph_eval(config, tokenizer, state, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "ckpt"))
    ckpt.save(NUM_STEPS, state, {"tokenizer_fingerprint": tokenizer.fingerprint})
    ckpt.wait()
    ckpt.close()
    return state, losses, ev


def scone_config(tokenizer_path: str, workdir: str):
    """SCONE with 2 micro-batches per step; the f-gram vocabulary is extracted into workdir/fgrams
    by the test before the processes start."""
    config = make_config(tokenizer_path)
    config.scone.update(dict(enabled=True, max_len=4, num_fgrams=2000, min_count=3, fgram_capacity=64,
                             num_layers=1, vocab_path=os.path.join(workdir, "fgrams")))
    config.train.grad_accum_steps = 2
    return config


def scone_train_steps(config, batches) -> list[float]:
    """NUM_STEPS SCONE train steps on the given iterator of this process's host batches."""
    mesh = sharding.make_mesh(config.mesh)
    config_lib.validate_batch_split(config, sharding.num_batch_shards(mesh))
    spec = state_lib.state_spec(config, mesh)
    state = state_lib.init_state(config, spec)
    train_step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    losses = []
    for _ in range(NUM_STEPS):
        state, metrics = train_step(state, sharding.global_batch(next(batches).for_device(), mesh))
        losses.append(float(metrics["loss"]))
    return losses


def scone_pipeline(config, tokenizer, batcher, process_index: int, process_count: int):
    """The training pipeline of one process, f-gram batcher included (as train.run builds it)."""
    return iter(pipeline.make_train_dataset(config.data, tokenizer, process_index=process_index,
                                            process_count=process_count, batch_transform=batcher))


def restore(config, workdir: str):
    """Restore the checkpoint in workdir/ckpt onto this run's mesh."""
    mesh = sharding.make_mesh(config.mesh)
    tokenizer = tokenizer_lib.Tokenizer.load(config.data.tokenizer_path)
    spec = state_lib.state_spec(config, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "ckpt"))
    state, meta = ckpt.restore(ckpt.latest_step(), state_lib.abstract_with_shardings(spec),
                               {"tokenizer_fingerprint": tokenizer.fingerprint})
    ckpt.close()
    return state, meta


def gathered_params(state) -> list[np.ndarray]:
    """Every parameter as a full numpy array on this host, wherever its shards live."""
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(state[0])]


def main(task, port, process_id, num_processes, tokenizer_path, workdir):
    if task == "exit":  # the failure watcher polls without pause, so it is inside jaxlib when Python exits
        distributed.WATCH_EVERY_S = 0
    distributed.initialize(distributed.JoinSpec(f"127.0.0.1:{port}", int(num_processes), int(process_id), TIMEOUT_S))
    config = make_config(tokenizer_path)
    if task == "train":
        _, losses, ev = train_steps(config, workdir)
        result = {"losses": losses, "eval": ev, "devices": jax.device_count(), "processes": jax.process_count()}
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "train.json"), "w") as f:
                json.dump(result, f)
    elif task == "scone":
        config = scone_config(tokenizer_path, workdir)
        tokenizer = tokenizer_lib.Tokenizer.load(tokenizer_path)
        _, batcher = assets.fgram_batcher(config, tokenizer, workdir, sharding.make_mesh(config.mesh))
        it = scone_pipeline(config, tokenizer, batcher, jax.process_index(), jax.process_count())
        losses = scone_train_steps(config, it)
        it.close()
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "scone.json"), "w") as f:
                json.dump({"losses": losses, "local_shards": batcher.num_shards}, f)
    elif task == "restore":
        state, _ = restore(config, workdir)
        params = gathered_params(state)
        if jax.process_index() == 0:
            np.savez(os.path.join(workdir, "restored.npz"), *params)
    elif task != "exit":
        raise ValueError(f"unknown task {task!r}")
    distributed.barrier("done", TIMEOUT_S)


if __name__ == "__main__":
    main(*sys.argv[1:])
