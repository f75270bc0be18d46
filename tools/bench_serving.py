"""Serving throughput: export, offloaded evaluation, cached decoding and host gathers, each against
the path it should cost no more than.

  python tools/bench_serving.py [--quick]

Builds a SCONE run (BPE tokenizer, f-grams from the embedded corpus, an initialised checkpoint: the
weights' values do not change the timings), exports it, and prints one RESULT line per ratio:
  export_vs_forward_ratio       export rows/s / f-gram-model forward rows/s alone (writes overlap compute)
  eval_table_vs_baseline_ratio  evaluate tokens/s with table rows / the same decoder on T(token) only
  eval_table_vs_onthefly_ratio  evaluate tokens/s with table rows / the training graph (f-gram model live)
  decode_latency_ratio          per-token decode latency with the table lookup / without
  gather_vs_numpy_ratio         HostTable.gather rows/s / np.take on the same in-RAM array
  table_crc_s_per_gb            seconds HostTable spends checking its files' row CRCs per GB of table it loads (a
                                256 MiB bf16 table, 65,536-row files; best of 3)
  table_crc_load_overhead_ratio that check's time / the read's time, loading the export's table into RAM (from
                                the page cache, so the worst case: a cold disk or GCS reads far slower)
Timings exclude compilation. On a shared 2-core CPU the figures move by +-20% between runs.
"""
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from scone_jax import sharding
from scone_jax.data import pipeline
from scone_jax.data.prompt import prompt_ids
from scone_jax.serving import bundle, evaluate, export, generate, inference, table as table_lib
from scone_jax.serving.bench_bundles import make_run, write_table_bundle
from scone_jax.training import run as run_lib

_QUICK = flags.DEFINE_bool("quick", False, "A tiny model and few batches (under a minute).")


def forward_rows_per_s(workdir: str, vocab, batch_rows: int) -> float:
    """The f-gram model over every f-gram in export-sized batches, results fetched, nothing written."""
    run = export.open_run(workdir)
    mesh = run.mesh
    embed = export.embed_fn(run.model(), mesh, "bfloat16")
    run.close()
    np.asarray(embed(*export.batch_inputs(vocab, 0, batch_rows, mesh)))
    start = time.perf_counter()
    pending = None
    for s in range(0, vocab.num_fgrams, batch_rows):
        result = embed(*export.batch_inputs(vocab, s, batch_rows, mesh))
        if pending is not None:
            np.asarray(pending)
        pending = result
    np.asarray(pending)
    return vocab.num_fgrams / (time.perf_counter() - start)


def onthefly_tokens_per_s(config, workdir, max_batches: int) -> float:
    """The training graph's eval step (f-gram model run per batch) on the run's checkpoint, batches prepared
    beforehand."""
    run = run_lib.build(config, workdir, sharding.make_mesh(config.mesh), start=run_lib.Latest.open(workdir))
    run.close()
    step, state = run.eval_step, run.state
    batches = [sharding.global_batch(run.batcher(b).for_device(), run.mesh)
               for _, b in zip(range(max_batches), pipeline.make_eval_batches(config.data, run.tokenizer))]
    jax.block_until_ready(step(state[0], batches[0]))
    start = time.perf_counter()
    sums = [step(state[0], b) for b in batches[1:]]
    tokens = float(np.sum([float(n) for _, n in jax.device_get(sums)]))
    return tokens / (time.perf_counter() - start)


def gather_ratio(table, batch_ids: int, rounds: int) -> float:
    ids = np.random.default_rng(0).integers(0, table.num_rows, (rounds, batch_ids))
    rows = table._rows
    out = np.empty((batch_ids, table.width), rows.dtype)
    timings = {}
    for name, fn in (("numpy", lambda i: np.take(rows, i, axis=0, out=out)), ("table", table.gather)):
        fn(ids[0])
        start = time.perf_counter()
        for i in ids:
            fn(i)
        timings[name] = time.perf_counter() - start
    return timings["numpy"] / timings["table"]


def crc_seconds_per_gb(root: str, rows: int = 1 << 20, width: int = 128) -> float:
    """HostTable's CRC check at load on a table large enough to time (the quick export's is 1 MB): a 256 MiB
    bundle of random bf16 rows in 65,536-row files, loaded into RAM; best of 3."""
    path = os.path.join(root, "crc_table")
    write_table_bundle(path, lambda lo, hi: np.random.default_rng(lo).standard_normal(
        (hi - lo, width), np.float32).astype(jnp.bfloat16), rows, width, "bfloat16", 65536)
    tables = [table_lib.open_table(bundle.Bundle.open(path), table="ram") for _ in range(3)]
    seconds = min(t.verify_seconds for t in tables)
    return seconds / (tables[0].nbytes / 1e9)


def main(argv):
    del argv
    quick = _QUICK.value
    root = tempfile.mkdtemp(prefix="bench_serving_")
    config, workdir, tokenizer, vocab = make_run(root, quick)
    batch_rows = 1024 if quick else 8192
    output = os.path.join(root, "export")
    figures = export.export(workdir, output, chunk_rows=256 if quick else 1024, batch_rows=batch_rows)
    forward = forward_rows_per_s(workdir, vocab, batch_rows)
    print(f"export {figures['rows_per_s']:,.0f} rows/s, forward alone {forward:,.0f} rows/s ({vocab.num_fgrams:,} f-grams)")
    print(f"RESULT export_vs_forward_ratio {figures['rows_per_s'] / forward:.3f}")

    served = inference.load(output)
    batches = 12 if quick else 60
    with_table = evaluate.evaluate(served, config.data, max_batches=batches)
    baseline = evaluate.evaluate(served, config.data, use_table=False, max_batches=batches)
    onthefly = onthefly_tokens_per_s(config, workdir, batches)
    print(f"evaluate tokens/s: table {with_table['tokens_per_s']:,.0f} (hit rate {with_table['hit_rate']:.2f}), "
          f"T only {baseline['tokens_per_s']:,.0f}, f-gram model on the fly {onthefly:,.0f}")
    print(f"RESULT eval_table_vs_baseline_ratio {with_table['tokens_per_s'] / baseline['tokens_per_s']:.3f}")
    print(f"RESULT eval_table_vs_onthefly_ratio {with_table['tokens_per_s'] / onthefly:.3f}")

    prompt = prompt_ids(tokenizer, "And God said, Let there be light", served.config.data.add_bos)[None]
    new_tokens = 32 if quick else 96
    gens = {use_table: generate.Generator(served, use_table=use_table) for use_table in (True, False)}
    for gen in gens.values():
        gen.generate(prompt, new_tokens)  # compile
    latency = {True: float("inf"), False: float("inf")}
    for _ in range(5 if quick else 10):  # alternating rounds: load changes on a shared machine hit both alike
        for use_table, gen in gens.items():
            latency[use_table] = min(latency[use_table], gen.generate(prompt, new_tokens)["seconds_per_token"])
    print(f"decode: {1000 * latency[True]:.2f} ms/token with table rows, {1000 * latency[False]:.2f} without")
    print(f"RESULT decode_latency_ratio {latency[True] / latency[False]:.3f}")

    ratio = gather_ratio(served.table, 16 * 1024 if quick else 64 * 1024, 20 if quick else 100)
    print(f"RESULT gather_vs_numpy_ratio {ratio:.3f}")

    table = served.table
    per_gb = crc_seconds_per_gb(root)
    print(f"table CRC check: {per_gb:.3f} s/GB ({1 / per_gb:.1f} GB/s); the export's {table.nbytes / 1e6:.1f} MB table "
          f"read in {1000 * table.read_seconds:.1f} ms, checked in {1000 * table.verify_seconds:.1f} ms")
    print(f"RESULT table_crc_s_per_gb {per_gb:.3f}")
    print(f"RESULT table_crc_load_overhead_ratio {table.verify_seconds / table.read_seconds:.3f}")


if __name__ == "__main__":
    app.run(main)
