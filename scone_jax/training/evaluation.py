"""Held-out evaluation, one loop for training and serving (docs/method.md §7: the same eval step either way).

Training evaluates its own graph, the f-gram rows made by the f-gram model inside the step from the slots its
batcher adds (fgram/dedup.py); serving evaluates an export's decoder, the rows gathered from the table on the
host (serving/inference.py). Either way a `rows` function adds a batch's f-gram arrays on the host, batch
i+1's while the device runs batch i, and at most a DispatchWindow of steps is in flight (runtime/prefetch.py).
The loss sums are added in float64, in batch order."""
from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from scone_jax import sharding
from scone_jax.data import eval_sets, pipeline
from scone_jax.batch import Batch
from scone_jax.model import scone
from scone_jax.runtime.prefetch import DispatchWindow, Prefetcher


def evaluate(step: Callable, batches, mesh, *, rows: Callable[[Batch], Batch] | None = None, max_batches: int = 0,
             num_bytes: int = 0, log_every_s: float = 30.0) -> dict:
    """`step` (a device batch -> (sum of token losses, number of target tokens)) over `batches` (at most
    `max_batches`, 0 = all), each through `rows` first (None: no f-gram rows, the decoder reads T(token); with
    Over-Encoding `rows` adds the n-gram ids instead): {tokens, loss, perplexity, bytes, bits_per_byte (None
    without `num_bytes`, the held-out text's UTF-8 bytes), hit_rate (positions with an f-gram: 0 for a batch
    without f-gram ids; None without `rows`), tokens_per_s (after the first batch,
    which compiles; None with one batch), batches}."""
    count = min(len(batches), max_batches) if max_batches else len(batches)

    def prepare(batch):
        real = batch.segment_ids > 0
        if rows is not None:
            batch = rows(batch)
        hits = int((batch.fgram_ids[real] >= 0).sum()) if batch.fgram_ids is not None else 0
        return (hits, int(real.sum())), sharding.global_batch(batch.for_device(), mesh)

    prefetch = Prefetcher((b for _, b in zip(range(count), batches)), prepare)
    window = DispatchWindow(mesh)
    sums, hits, positions = [], 0, 0
    start = last_log = time.time()
    first_tokens = 0.0
    try:
        for i, ((hit, real), batch) in enumerate(prefetch):
            sums.append(window.add(step(batch)))
            hits, positions = hits + hit, positions + real
            if i == 0:  # the first step compiles: time the rest
                first_tokens = float(jax.device_get(sums[0][1]))
                start = time.time()
            if time.time() - last_log > log_every_s:
                last_log = time.time()
                logging.info("evaluate: batch %d/%d", i + 1, count)
    finally:
        prefetch.close()
    totals = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0) if sums else np.zeros(2)
    seconds = time.time() - start
    loss_sum, tokens = float(totals[0]), float(totals[1])
    loss = loss_sum / max(tokens, 1.0)
    return {
        "tokens": int(tokens),
        "loss": loss,
        "perplexity": scone.perplexity(loss),
        "bytes": num_bytes,
        "bits_per_byte": eval_sets.bits_per_byte(loss, tokens, num_bytes),
        "hit_rate": hits / max(positions, 1) if rows is not None else None,
        "tokens_per_s": (tokens - first_tokens) / seconds if len(sums) > 1 else None,
        "batches": len(sums),
    }


def countable_bytes(data_cfg, tokenizer, batches, max_batches: int) -> int:
    """The UTF-8 bytes of the held-out text, bits per byte's denominator; 0 (no bits per byte) where
    `max_batches` leaves some of `batches` out, since it needs every document once."""
    return 0 if max_batches and max_batches < len(batches) else eval_sets.held_out_bytes(data_cfg, tokenizer)


class HeldOut:
    """The held-out sets of data.eval_sets (data/eval_sets.py), read and checked when made (a training run makes
    them before step 1), and their evaluation: {set name: evaluate()'s result}, plus the unweighted average of
    named sets as `average` {loss, perplexity, bits_per_byte, tokens} (an unnamed value's one set is named '')."""

    def __init__(self, data_cfg, tokenizer, max_batches: int = 0):
        self.max_batches = max_batches
        configs = eval_sets.configs(data_cfg)
        self.sets = {name: eval_sets.open_set(name, cfg, lambda c: pipeline.make_eval_batches(
                         c, tokenizer, process_index=jax.process_index(), process_count=jax.process_count()))
                     for name, cfg in configs.items()}
        self.bytes = {name: countable_bytes(cfg, tokenizer, self.sets[name], max_batches)
                      for name, cfg in configs.items()}

    def evaluate(self, step: Callable, mesh, rows: Callable[[Batch], Batch] | None = None) -> dict[str, dict]:
        results = {name: evaluate(step, batches, mesh, rows=rows, max_batches=self.max_batches,
                                  num_bytes=self.bytes[name]) for name, batches in self.sets.items()}
        if eval_sets.SINGLE not in results:
            results[eval_sets.AVERAGE] = {**eval_sets.average(results),
                                          "tokens": sum(r["tokens"] for r in results.values())}
        return results
