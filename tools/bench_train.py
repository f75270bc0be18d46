"""Training throughput of the tiny config: baseline vs SCONE step time, FLOPs and f-gram dedup; with
--oe_m, Over-Encoding arms beside them.

  python tools/bench_train.py [--quick] [--config=configs/tiny.py] [--config.model.num_layers=8]
  python tools/bench_train.py --config=configs/quality.py:scone --oe_m=20011,100003 \
      --config.data.train_files=/data/gcide/train.jsonl     # the quality study's scone, oe and oe_5x
Real batches from the config's data pipeline (f-grams matched and deduplicated on the host, Over-Encoding's
n-gram ids hashed there) are prepared first, so the timings are the device step alone. The arms' steps run
in alternating rounds and each keeps its fastest round, so load from other jobs on a shared
machine does not land on one of them only. MFU and the FLOP ratio use the
formula in scone_jax/model/accounting.py. The dedup reduction is measured on the embedded
corpus at the config's shard (16 x 128 tokens for configs/tiny.py) and at a paper-sized one (64 x 1024
tokens: the paper's 512 x 1024 batch over 8 data shards).
"""
import tempfile
import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from scone_jax import config as config_lib, sharding
from scone_jax.batch import Batch
from scone_jax.data import pipeline
from scone_jax.fgram import stats
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.model import accounting
from scone_jax.runtime import tool_main
from scone_jax.training import run as run_lib
from scone_jax.training.throughput import peak_flops_per_device

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "SCONE config (its baseline = scone off).")
_QUICK = flags.DEFINE_bool("quick", False, "Few steps (under a minute here).")
_OE_M = flags.DEFINE_list("oe_m", [], "Over-Encoding arms to time too (docs/method.md §8), one per table modulus m, "
                          "on the baseline decoder with --oe_n and --oe_k; e.g. 20011,100003 for the quality study's "
                          "oe and oe_5x. Empty: none.")
_OE_N = flags.DEFINE_integer("oe_n", 3, "Over-Encoding's largest n-gram order n (>= 2).")
_OE_K = flags.DEFINE_integer("oe_k", 4, "Over-Encoding's tables per order k (>= 1).")


def step_runner(run, batches, warmup: int = 2):
    """A function timing one pass of `run`'s train steps over `batches` (seconds per step), from its fresh
    state, compiled and warmed up by `warmup` steps first."""
    state = [run.state]
    device_batches = [sharding.global_batch(b.for_device(), run.mesh) for b in batches]

    def go(batches_to_run):
        metrics = None
        for b in batches_to_run:
            state[0], metrics = run.train_step(state[0], b)
        jax.block_until_ready(metrics)

    go(device_batches[:warmup])

    def timed() -> float:
        start = time.perf_counter()
        go(device_batches)
        return (time.perf_counter() - start) / len(device_batches)

    return timed


def time_alternating(runners: dict, rounds: int) -> dict:
    """Fastest seconds per step of each runner over `rounds` rounds that alternate between them,
    so that other load on a shared machine slows every runner alike."""
    best = {name: float("inf") for name in runners}
    for _ in range(rounds):
        for name, timed in runners.items():
            best[name] = min(best[name], timed())
    return best


def step_flops(run) -> float:
    return accounting.train_step_flops(run.config, run.spec.abstract[0], sharding.num_batch_shards(run.mesh))["total"]


def dedup_reduction(config, tokenizer, batcher, rows: int, seq_len: int, num_batches: int) -> float:
    """F-gram-model tokens per step: naive (K per matched position) over deduplicated (K per row)."""
    data = config.data.copy_and_resolve_references()
    data.update(dict(global_batch_size=rows, seq_len=seq_len))
    big = FgramBatcher(batcher.matcher, batcher.vocab, num_shards=1, capacity=rows * seq_len)
    batches = pipeline.first_batches(pipeline.make_train_dataset(data, tokenizer, batch_transform=big), num_batches)
    figures = [stats.batch_stats(b) for b in batches]
    return float(1.0 / np.mean([f["fgram/row_ratio"] for f in figures]))


def main():
    scone = _CONFIG.value
    config_lib.validate(scone)  # a key the config file misspelled, a value out of range: one line, exit 2
    baseline = scone.copy_and_resolve_references()
    baseline.scone.enabled = False
    oe = oe_configs(baseline, _OE_M.value, _OE_N.value, _OE_K.value)
    configs = {"scone": scone, "baseline": baseline, **oe}
    steps_per_round, rounds = (3, 3) if _QUICK.value else (5, 6)
    with tempfile.TemporaryDirectory() as workdir:  # the tokenizer and f-grams, made once (by the SCONE run)
        mesh = sharding.make_mesh(scone.mesh)
        runs = {name: run_lib.build(config, workdir, mesh, start=run_lib.FRESH) for name, config in configs.items()}
    run = runs["scone"]
    tokenizer, vocab, batcher = run.tokenizer, run.vocab, run.batcher
    batches = pipeline.first_batches(run.train_data, steps_per_round)
    plain = [Batch(inputs=b.inputs, targets=b.targets, segment_ids=b.segment_ids, positions=b.positions,
                   loss_mask=b.loss_mask) for b in batches]  # the same tokens, without f-gram arrays
    runners = {"baseline": step_runner(runs["baseline"], plain), "scone": step_runner(run, batches)}
    for name in oe:  # the same tokens again, with the n-gram ids its loader hashed for them
        runners[name] = step_runner(runs[name], pipeline.first_batches(runs[name].train_data, steps_per_round))
    best = time_alternating(runners, rounds)
    base_s, scone_s = best["baseline"], best["scone"]
    tokens = scone.data.global_batch_size * scone.data.seq_len
    flops = {name: step_flops(runs[name]) for name in runners}
    base_flops, scone_flops = flops["baseline"], flops["scone"]
    peak = peak_flops_per_device(scone.train.peak_flops_per_device) * jax.device_count()
    figures = [stats.batch_stats(b) for b in batches]
    print(f"devices {jax.device_count()} ({jax.devices()[0].device_kind}); {vocab.num_fgrams:,} f-grams, K={vocab.max_len}")
    for name, sec in best.items():
        print(f"{name:9s} step {sec * 1e3:7.1f} ms  {tokens / sec:9,.0f} tokens/s  "
              f"{flops[name] / 1e9:7.1f} GFLOP/step  MFU {100 * flops[name] / sec / peak:5.1f}% of "
              f"{peak / 1e9:.0f} GFLOP/s")
    print("tiny batch f-gram figures: " + ", ".join(
        f"{k.split('/')[1]} {np.mean([f[k] for f in figures]):.3f}" for k in figures[0]))
    tiny = 1.0 / np.mean([f["fgram/row_ratio"] for f in figures])
    paper = dedup_reduction(scone, tokenizer, batcher, 64, 1024, 1 if _QUICK.value else 4)
    shard_rows = scone.data.global_batch_size // batcher.num_shards
    print(f"dedup: naive / deduplicated f-gram-model tokens = {tiny:.2f} at {shard_rows} x {scone.data.seq_len} "
          f"tokens per shard, "
          f"{paper:.2f} at 64 x 1024 (static capacity U={scone.scone.fgram_capacity} rows: "
          f"{np.mean([(b.fgram_slot >= 0).sum() for b in batches]) / scone.scone.fgram_capacity:.2f} at that shard)")
    print(f"RESULT train_tokens_per_s {tokens / base_s:.1f}")
    print(f"RESULT scone_train_tokens_per_s {tokens / scone_s:.1f}")
    print(f"RESULT scone_step_time_ratio {scone_s / base_s:.3f}")
    print(f"RESULT scone_flop_ratio {scone_flops / base_flops:.3f}")
    print(f"RESULT dedup_fgram_token_reduction {paper:.2f}")
    print(f"RESULT dedup_fgram_token_reduction_tiny_shard {tiny:.2f}")
    for name in oe:
        print(f"RESULT {name}_train_tokens_per_s {tokens / best[name]:.1f}")
        print(f"RESULT {name}_step_time_ratio {best[name] / base_s:.3f}")


def oe_configs(baseline, moduli: list[str], n: int, k: int) -> dict:
    """'oe_m<m>' -> the baseline's config with Over-Encoding (n, k, m) on, validated (a bad n, k or m: one line)."""
    out = {}
    for text in moduli:
        if not text.strip().isdigit():
            raise ValueError(f"--oe_m={','.join(moduli)}: {text!r} is not a table modulus (a positive integer). Fix: "
                             "e.g. --oe_m=20011,100003.")
        config = baseline.copy_and_resolve_references()
        config.overencoding.update(dict(enabled=True, n=n, k=k, m=int(text)))
        config_lib.validate(config)
        out[f"oe_m{int(text)}"] = config
    return out


if __name__ == "__main__":
    tool_main.run(main, program="bench_train", flag_error=config_lib.config_flag_error)
