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

import types

import jax
from absl import flags
from ml_collections import config_flags

from scone_jax import config as config_lib
from scone_jax.data import eval_sets, pipeline
from scone_jax.data.tokenizer import Tokenizer, special_tokens_of
from scone_jax.runtime import logs, tool_main
from scone_jax.runtime.compile_cache import CompileCache
from scone_jax.serving import inference
from scone_jax.training import evaluation


def evaluate(served: inference.Served, data_cfg, *, use_table: bool = True, max_batches: int = 0) -> dict:
    """Loss, perplexity, bits per byte, hit rate and throughput over `data_cfg`'s held-out data as one set
    (training/evaluation.py's result, with `use_table`)."""
    batches = pipeline.make_eval_batches(data_cfg, served.tokenizer, process_index=jax.process_index(),
                                         process_count=jax.process_count())
    num_bytes = evaluation.countable_bytes(data_cfg, served.tokenizer, batches, max_batches)
    result = evaluation.evaluate(inference.make_eval_step(served), batches, served.mesh, rows=_rows(served, use_table),
                                 max_batches=max_batches, num_bytes=num_bytes)
    return {**result, "use_table": use_table}


def evaluate_all(served: inference.Served, data_cfg, *, use_table: bool = True, max_batches: int = 0) -> dict:
    """Every held-out set that data.eval_files names (data/eval_sets.py), as training evaluates them: an unnamed
    value's one set as evaluate() returns it; named sets as {"sets": {name: result}, "average": {loss,
    perplexity, bits_per_byte, tokens}} (the unweighted mean over the sets, the paper's "Average" column)."""
    held_out = evaluation.HeldOut(data_cfg, served.tokenizer, max_batches)
    results = {name: {**result, "use_table": use_table} if name != eval_sets.AVERAGE else result
               for name, result in held_out.evaluate(inference.make_eval_step(served), served.mesh,
                                                     rows=_rows(served, use_table)).items()}
    if eval_sets.SINGLE in results:
        return results[eval_sets.SINGLE]
    average = results.pop(eval_sets.AVERAGE)
    return {"sets": results, "average": average}


def _rows(served: inference.Served, use_table: bool):
    """The table's rows for a batch; without the table (None), no f-gram arrays: the decoder reads T(token)
    everywhere, an Over-Encoding decoder its n-gram ids, which are never left out (they are its input)."""
    if use_table:
        return lambda batch: inference.host_rows(served, batch)
    return served.hasher


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
        for key, group in (("eval_files", "eval_sets"), ("train_files", "mixture")):
            if f"data.{key}" in overrides:  # the command line's data replaces the run's groups
                config.data[group] = {}
        config.update_from_flattened_dict(overrides)
    config_lib.resolve(config)
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
    max_batches = flags.DEFINE_integer("max_batches", 0, "Stop after this many batches (0 = all; bits per byte only "
                                       "when every batch is read).")
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
