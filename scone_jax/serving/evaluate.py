"""Batch perplexity with offloaded f-gram rows: `python -m scone_jax.serving.evaluate --export=DIR [--config.data.*]`.

Named held-out sets (`--config.data.eval_files='web=...;books=...'`, data/eval_sets.py) are evaluated one by
one, with their unweighted average. Only the main decoder is on the devices; the f-gram rows come from the export's table,
in host RAM or read from disk (--table; scone_jax/serving/inference.py), batch i+1's while the device runs batch i. By default the data is the run's held-out split as its config names it;
override any data key, e.g. `--config.data.source=text --config.data.eval_files=held_out/*.txt`.
Every document is counted exactly once (the last partial batch included). Prints tokens,
perplexity, bits per byte, f-gram hit rate and tokens/s, and writes them to --result as JSON.

Bits per byte = total next-token loss (nats, end-of-document predictions included) / ln 2 / the
UTF-8 bytes of the documents' text, each document counted once.

Exit status: 0 done; 2 bad input; 130 / 143 stopped by SIGINT / SIGTERM (one line; nothing is written before
the end, so rerun the same command).
"""
from __future__ import annotations

import time
import types

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from scone_jax import config as config_lib
from scone_jax.data import eval_sets, pipeline
from scone_jax.data.tokenizer import Tokenizer, special_tokens_of
from scone_jax.model import scone
from scone_jax.runtime import logs, tool_main
from scone_jax.runtime.compile_cache import CompileCache
from scone_jax.serving import inference
from scone_jax.serving.prefetch import DispatchWindow, Prefetcher


def evaluate(served: inference.Served, data_cfg, *, use_table: bool = True, max_batches: int = 0,
             log_every_s: float = 30.0, step=None) -> dict:
    """Loss, perplexity, bits per byte, hit rate and throughput over `data_cfg`'s held-out data. `step`: an
    inference.make_eval_step of `served` to reuse (compiled once for several sets), else made here."""
    batches = pipeline.make_eval_batches(data_cfg, served.tokenizer, process_index=jax.process_index(),
                                         process_count=jax.process_count())
    count = min(len(batches), max_batches) if max_batches else len(batches)
    step = step or inference.make_eval_step(served)

    def prepare(batch):
        real = batch.segment_ids > 0
        if use_table:  # else the batch carries no f-gram arrays: the decoder reads T(token) everywhere
            batch = inference.host_rows(served, batch)
        hits = int((batch.fgram_ids[real] >= 0).sum()) if use_table else 0
        return (hits, int(real.sum())), inference.device_batch(served, batch)

    prefetch = Prefetcher((b for i, b in zip(range(count), batches)), prepare)
    window = DispatchWindow(served.mesh)
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
    num_bytes = eval_sets.held_out_bytes(data_cfg, served.tokenizer) if not max_batches else 0
    loss = loss_sum / max(tokens, 1.0)
    return {
        "tokens": int(tokens),
        "loss": loss,
        "perplexity": scone.perplexity(loss),
        "bytes": num_bytes,
        "bits_per_byte": eval_sets.bits_per_byte(loss, tokens, num_bytes),
        "hit_rate": hits / max(positions, 1) if use_table else None,
        "tokens_per_s": (tokens - first_tokens) / seconds if len(sums) > 1 else None,
        "batches": len(sums),
        "use_table": use_table,
    }


def evaluate_all(served: inference.Served, data_cfg, *, use_table: bool = True, max_batches: int = 0) -> dict:
    """evaluate() of every held-out set that data.eval_files names (data/eval_sets.py): an unnamed value's one
    set as evaluate() returns it; named sets as {"sets": {name: result}, "average": {loss, perplexity,
    bits_per_byte}} (the unweighted mean over the sets, the paper's "Average" column)."""
    configs = eval_sets.configs(data_cfg)
    if eval_sets.SINGLE in configs:
        return evaluate(served, data_cfg, use_table=use_table, max_batches=max_batches)
    step = inference.make_eval_step(served)
    results = {name: evaluate(served, cfg, use_table=use_table, max_batches=max_batches, step=step)
               for name, cfg in configs.items()}
    return {"sets": results, "average": eval_sets.average(results)}


def _summary(result: dict) -> str:
    return (f"tokens {result['tokens']:,}  perplexity {result['perplexity']:.4f}  bits/byte "
            f"{result['bits_per_byte'] or float('nan'):.4f}  hit rate {result['hit_rate']:.3f}  "
            f"tokens/s {result['tokens_per_s'] or float('nan'):,.0f}")


def data_config(served: inference.Served, overrides: dict):
    """The run's data config with the command line's --config.data.* / --config.mesh.* applied."""
    config = served.config.copy_and_resolve_references()
    bad = sorted(k for k in overrides if not k.startswith(("data.", "mesh.")))
    if bad:
        raise ValueError(f"{bad} cannot change at evaluation: the model comes from the export. Only "
                         "--config.data.* and --config.mesh.* apply.")
    with config.unlocked():
        config.update_from_flattened_dict(overrides)
    if "data.tokenizer_path" in overrides and config.data.tokenizer_path:
        other = Tokenizer.load(config.data.tokenizer_path, special_tokens_of(config.data))
        if other.fingerprint != served.tokenizer.fingerprint:
            raise ValueError(
                f"data.tokenizer_path={config.data.tokenizer_path!r} (fingerprint {other.fingerprint}) is not the "
                f"tokenizer the export was trained with ({served.tokenizer.fingerprint}): its token ids would "
                "mean other text. Fix: drop the override; the export carries its own tokenizer.")
    return config


def _define_flags():
    """Command-line flags, defined only when this module runs as a program (modules share absl's registry)."""
    export = inference.define_export_flag()
    config = config_flags.DEFINE_config_dict("config", config_lib.base_config(), "Data overrides: --config.data.*.")
    result = flags.DEFINE_string("result", "eval_result.json", "Where to write the JSON result ('' = nowhere).")
    table, max_table_bytes = inference.define_table_flags()
    max_batches = flags.DEFINE_integer("max_batches", 0, "Stop after this many batches (0 = all; then no bpb).")
    cache = flags.DEFINE_string("compilation_cache_dir", "", "JAX's persistent compilation cache (a local path or "
                                "gs:// URL), so the next evaluation of the same model loads its compiled step; '' = off.")
    return types.SimpleNamespace(export=export, config=config, result=result, table=table,
                                 max_table_bytes=max_table_bytes, max_batches=max_batches, cache=cache)


def run(args):
    logs.quiet_libraries()
    path = args.export.value
    tool_main.require(export=path)
    if args.result.value:
        tool_main.check_result_path(args.result.value, "--result")
    served = inference.load(path, table=args.table.value, max_table_bytes=args.max_table_bytes.value)
    config = data_config(served, config_flags.get_override_values(flags.FLAGS["config"]))
    with CompileCache(args.cache.value, flag="--compilation_cache_dir"):
        result = evaluate_all(served, config.data, max_batches=args.max_batches.value)
    if "sets" in result:
        for name, figures in result["sets"].items():
            print(f"{name}: {_summary(figures)}")
        average = result["average"]
        print(f"average of {len(result['sets'])} sets: perplexity {average['perplexity']:.4f}  bits/byte "
              f"{average['bits_per_byte'] if average['bits_per_byte'] is not None else float('nan'):.4f}")
    else:
        print(_summary(result))
    result |= {"table": path, "data": config.data.to_dict()}
    if args.result.value:
        tool_main.write_result(args.result.value, result)


def stopped_note(result: str) -> str:
    """What a SIGINT or SIGTERM leaves (tool_main prints it): nothing, since the result is written at the end."""
    written = f"--result={result} was not written" if result else "no result was written"
    return f"{written} (evaluation writes nothing before it ends). Rerun the same command to evaluate."


if __name__ == "__main__":
    _args = _define_flags()
    tool_main.run(lambda: run(_args), program="scone_jax.serving.evaluate",
                  stopped=lambda: stopped_note(_args.result.value))
