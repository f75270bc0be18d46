"""The training loop: steps, metrics, periodic evaluation, checkpoints and exact resume.

Resume is automatic: if <workdir>/checkpoints holds a checkpoint, the state and the data
iterator position are restored and training continues from that step. On SIGTERM the loop
finishes the current step, saves a checkpoint there and raises preemption.Preempted.
"""
from __future__ import annotations

import math
import os
import time
import zlib

import jax
import numpy as np
from absl import logging

from scone_jax import checkpoint, config as config_lib, distributed, preemption, sharding, state as state_lib, steps
from scone_jax.data import pipeline, tokenizer as tokenizer_lib
from scone_jax.fgram import stats as fgram_stats, workdir_vocab
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.matcher import Matcher
from scone_jax.metrics_writer import MetricsWriter, format_line
from scone_jax.model import accounting
from scone_jax.throughput import Throughput, peak_flops_per_device


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept as the latest."""


class InputPipelineError(ValueError):
    """Building a batch failed (bad data, a worker process that died); the run saved a
    checkpoint at the step it had reached, so a rerun after the fix loses nothing."""


def resolve_vocab_size(config, tokenizer) -> None:
    """model.vocab_size 0 -> the tokenizer's size rounded up to 128 (TPU-friendly)."""
    have = config.model.vocab_size
    if have == 0:
        with config.unlocked():
            config.model.vocab_size = int(math.ceil(tokenizer.vocab_size / 128) * 128)
    elif have < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={have} is smaller than the tokenizer's {tokenizer.vocab_size} pieces; "
            "set model.vocab_size=0 to size it from the tokenizer."
        )


def batch_fingerprint(batch: dict) -> int:
    """CRC32 of every array a host batch sends to the device (inputs, masks and, with SCONE,
    the f-gram rows and slots), in key order: cheap, and what resume must replay exactly."""
    crc = 0
    for key in sorted(device_batch(batch)):
        crc = zlib.crc32(key.encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(batch[key]).tobytes(), crc)
    return crc


def evaluate(eval_step, state, config, tokenizer, mesh, batch_transform=None, batches=None) -> dict:
    """Held-out loss and perplexity over data.eval (train.eval_batches caps the batch count).
    `batches` (pipeline.EvalBatches) is made here if not given; pass it to tokenize only once."""
    loss_sum, count = 0.0, 0.0
    if batches is None:
        batches = pipeline.make_eval_batches(
            config.data, tokenizer, process_index=jax.process_index(), process_count=jax.process_count())
    for i, batch in enumerate(batches):
        if config.train.eval_batches and i >= config.train.eval_batches:
            break
        if batch_transform is not None:
            batch = batch_transform(batch)
        l, n = eval_step(state, sharding.global_batch(device_batch(batch), mesh))
        loss_sum, count = loss_sum + float(l), count + float(n)
    loss = loss_sum / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


HOST_ONLY_KEYS = ("fgram_ids", "fgram_unique")


def device_batch(batch: dict) -> dict:
    """The arrays the step uses (host-only extras such as global f-gram ids stay behind)."""
    return {k: v for k, v in batch.items() if k not in HOST_ONLY_KEYS}


def fgram_batcher(config, tokenizer, workdir: str, mesh):
    """The grain batch transform that adds per-shard f-grams, or (None, None) without SCONE."""
    if not config.scone.enabled:
        return None, None
    vocab = distributed.chief_first("fgram_vocab", lambda: workdir_vocab.ensure_vocab(
        config.scone, config.data, tokenizer, workdir, jax.process_index() == 0))
    local_shards = sharding.num_batch_shards(mesh) // jax.process_count()
    batcher = FgramBatcher(Matcher(vocab), vocab, num_shards=local_shards, capacity=config.scone.fgram_capacity,
                           micro_batches=config.train.grad_accum_steps)
    return vocab, batcher


class _PendingMetrics:
    """Device metrics of recent steps, fetched together so the host never waits per step."""

    def __init__(self):
        self.items = []

    def add(self, step, metrics, host_figures: dict):
        self.items.append((step, metrics, host_figures))

    def flush(self) -> list[dict]:
        fetched = jax.device_get([m for _, m, _ in self.items])
        records = [
            {"step": s, **host, **{k: float(v) for k, v in m.items()}}
            for (s, _, host), m in zip(self.items, fetched)
        ]
        self.items = []
        for r in records:
            bad = {k: r[k] for k in ("loss", "grad_norm", "param_norm") if not math.isfinite(r[k])}
            if bad:
                raise NonFiniteLossError(
                    f"Non-finite {bad} at step {r['step']}; training stopped and the bad state "
                    "was not saved. Lower train.learning_rate, enable train.grad_clip_norm, or check "
                    "the data; the next run resumes from the last good checkpoint."
                )
        return records


def run(config, workdir: str) -> dict:
    """Train per `config` in `workdir`, resuming if a checkpoint exists. Returns final metrics."""
    config_lib.validate(config)
    mesh = sharding.make_mesh(config.mesh)
    config_lib.validate_batch_split(config, sharding.num_batch_shards(mesh))
    is_chief = jax.process_index() == 0
    tokenizer = distributed.chief_first("tokenizer", lambda: tokenizer_lib.ensure_tokenizer(config.data, workdir))
    resolve_vocab_size(config, tokenizer)
    if is_chief:
        config_lib.write_config(config, workdir)
    logging.info("Mesh %s over %d devices (%d processes)", dict(mesh.shape), jax.device_count(), jax.process_count())
    vocab, batcher = fgram_batcher(config, tokenizer, workdir, mesh)

    spec = state_lib.state_spec(config, mesh)
    logging.info("Parameters: %s", {k: f"{v:,}" for k, v in accounting.param_counts(spec.abstract[0]).items()})
    flops = accounting.train_step_flops(config, spec.abstract[0], sharding.num_batch_shards(mesh))
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.train.keep_checkpoints)
    expect = {
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "fgram_vocab_fingerprint": vocab.fingerprint if vocab else None,
    }
    meta = {**expect, "config": config.to_dict()}

    step = ckpt.latest_step() or 0
    if step:
        state, saved = state_lib.restore(ckpt, step, config, spec, mesh, expect=expect)
        logging.info("Resumed from step %d", step)
        if saved.get("process_count", jax.process_count()) != jax.process_count():
            logging.warning("Checkpoint step %d was written by %d processes and this run has %d: the documents "
                            "are shared out anew, so each process now reads another part of the data.",
                            step, saved["process_count"], jax.process_count())
    else:
        state = state_lib.init_state(config, spec)
    # One batch per step: the batch numbers continue where the checkpoint stopped (packing.py).
    inputs = _Inputs(pipeline.make_train_dataset(
        config.data, tokenizer, process_index=jax.process_index(), process_count=jax.process_count(),
        batch_transform=batcher, start_batch=step,
    ), mesh, batcher, pipeline.worker_count(config.data))

    train_step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    eval_step = steps.make_eval_step(spec.graphdef, spec.shardings, mesh)
    writer = MetricsWriter(workdir, enabled=is_chief)
    t = config.train
    peak = peak_flops_per_device(t.peak_flops_per_device) * jax.device_count()
    meter = Throughput(t.num_steps, step, flops["total"], peak)
    pending, window, summary, eval_batches = _PendingMetrics(), [], {}, None
    stop_at = min(t.num_steps, step + t.max_steps_per_run) if t.max_steps_per_run else t.num_steps
    watch = preemption.Watch()
    start_step = step
    try:
        batch = _next_batch(inputs, step, None) if step < stop_at else None
        while step < stop_at:
            host, device_arrays = batch
            state, metrics = train_step(state, device_arrays)  # dispatched; the device works on it
            step += 1
            pending.add(step, metrics, host)
            if step < stop_at:  # the next batch is built and sent meanwhile
                batch = _next_batch(inputs, step, None if step == start_step else (
                    lambda: _save_after_input_failure(ckpt, step, state, meta, pending, writer)))
            last = step == stop_at
            preempted = watch.reached(step)
            if step % t.log_every == 0 or step % t.checkpoint_every == 0 or last or preempted:
                records = pending.flush()
                writer.write_steps(records)
                window += records
            if window and (step % t.log_every == 0 or last):
                summary = _summarize(window, meter.update(step, sum(r["tokens"] for r in window)))
                summary["input_wait_fraction"] = inputs.wait_fraction()
                window = []
                writer.write(step, summary)
                logging.info(format_line(step, t.num_steps, summary))
            if t.eval_every and (step % t.eval_every == 0 or last):
                if eval_batches is None:  # tokenized once, at the first evaluation
                    eval_batches = pipeline.make_eval_batches(
                        config.data, tokenizer, process_index=jax.process_index(), process_count=jax.process_count())
                ev = evaluate(eval_step, state, config, tokenizer, mesh, batcher, eval_batches)
                writer.write(step, ev, prefix="eval")
                logging.info("eval step %d: loss %.4f ppl %.2f over %d tokens", step, ev["loss"], ev["perplexity"], ev["tokens"])
                summary.update({f"eval_{k}": v for k, v in ev.items()})
            if step % t.checkpoint_every == 0 or last or preempted:
                ckpt.save(step, state, None, {**meta, "step": step})
            if preempted and not last:
                raise preemption.Preempted(step)
    finally:
        inputs.close()
        watch.close()
        ckpt.wait()
        ckpt.close()
        writer.close()
    return {"step": step, **summary}


def _next_batch(inputs, step: int, save):
    """inputs.next(), with a failure turned into InputPipelineError after `save()` (if given)."""
    try:
        return inputs.next()
    except Exception as e:  # a worker's exception comes back as itself; a dead worker as RuntimeError
        saved = ""
        if save is not None:
            save()
            saved = f" A checkpoint was saved at step {step}: rerun the same command after the fix to resume there."
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputPipelineError(
            f"The input pipeline failed while preparing step {step + 1}: {type(e).__name__}: {first}.{saved} "
            "If a worker process died without a message, it may have run out of memory: lower "
            "data.worker_count.") from e


def _save_after_input_failure(ckpt, step, state, meta, pending, writer):
    writer.write_steps(pending.flush())
    ckpt.save(step, state, None, {**meta, "step": step})
    ckpt.wait()


class _Inputs:
    """Host batches -> (host figures, device arrays), timing how long the loop waits for them.

    wait_fraction() is the share of wall time since its last call that the loop spent here
    (building or waiting for the batch, and starting its transfer); above WAIT_WARNING it
    logs what to change, the first time and then every WARN_EVERY calls."""

    WAIT_WARNING, WARN_EVERY = 0.10, 50

    def __init__(self, dataset, mesh, batcher, workers: int):
        self._iter, self._mesh, self._batcher, self._workers = iter(dataset), mesh, batcher, workers
        self._waited, self._since = 0.0, time.perf_counter()
        self._calls, self._warned_at = 0, None

    def next(self):
        start = time.perf_counter()
        host_batch = next(self._iter)
        host = {"batch_crc": batch_fingerprint(host_batch)}
        if self._batcher is not None:
            host.update(fgram_stats.batch_stats(host_batch))
            host["fgram/model_tokens"] = host_batch["fgram_tokens"].size * jax.process_count()
        arrays = sharding.global_batch(device_batch(host_batch), self._mesh)
        self._waited += time.perf_counter() - start
        return host, arrays

    def wait_fraction(self) -> float:
        now = time.perf_counter()
        fraction = self._waited / max(now - self._since, 1e-9)
        self._waited, self._since = 0.0, now
        self._calls += 1
        # The first interval holds worker start-up and compilation: not a steady-state figure.
        if fraction > self.WAIT_WARNING and self._calls > 1 and (
                self._warned_at is None or self._calls - self._warned_at >= self.WARN_EVERY):
            self._warned_at = self._calls
            logging.warning(
                "The training loop waited for input %.0f%% of the time: the host does not build batches as "
                "fast as the devices use them. Fix: raise data.worker_count (%d worker processes now; -1 = half "
                "the cores), or pre-tokenize text corpora (tools/pretokenize.py, then data.source=arrayrecord).",
                100 * fraction, self._workers)
        return fraction

    def close(self):
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()


def _summarize(records: list[dict], rates: dict) -> dict:
    """Window means of loss and f-gram figures, last values of the rest, plus rates."""
    loss = float(np.mean([r["loss"] for r in records]))
    fgram = {k: float(np.mean([r[k] for r in records])) for k in records[-1] if k.startswith("fgram/")}
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "grad_norm": records[-1]["grad_norm"],
        "learning_rate": records[-1]["learning_rate"],
        **fgram,
        **rates,
    }
