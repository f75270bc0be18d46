"""Training throughput of a config (default: the tiny one): tokens/s, step time and MFU.

  python tools/bench_train.py [--quick] [--config=configs/tiny.py] [--config.model.num_layers=8]
Real batches from the config's data pipeline are prepared first, so the figure is the device
step alone; MFU uses the FLOP formula in scone_jax/model/accounting.py.
"""
import tempfile
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from scone_jax import sharding, state as state_lib, steps, train
from scone_jax.data import pipeline, tokenizer as tokenizer_lib
from scone_jax.model import accounting
from scone_jax.throughput import peak_flops_per_device

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config to benchmark.")
_QUICK = flags.DEFINE_bool("quick", False, "Few steps (under a minute here).")


def time_steps(config, batches, warmup: int = 2) -> float:
    """Seconds per train step, after `warmup` steps (compilation included there)."""
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    state = state_lib.init_state(config, spec)
    step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    device_batches = [sharding.global_batch(b, mesh) for b in batches]
    for b in device_batches[:warmup]:
        state, metrics = step(state, b)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for b in device_batches[warmup:]:
        state, metrics = step(state, b)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / (len(device_batches) - warmup)


def main(_):
    config = _CONFIG.value
    num_steps = 5 if _QUICK.value else 30
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer = tokenizer_lib.ensure_tokenizer(config.data, workdir)
    train.resolve_vocab_size(config, tokenizer)
    dataset = iter(pipeline.make_train_dataset(config.data, tokenizer))
    batches = [next(dataset) for _ in range(num_steps + 2)]
    step_s = time_steps(config, batches)
    tokens = config.data.global_batch_size * config.data.seq_len
    counts = accounting.param_counts(state_lib.state_spec(config, sharding.make_mesh(config.mesh)).abstract[0])
    flops = accounting.decoder_flops_per_token(config.model, config.data.seq_len, counts["non_embedding"]) * tokens
    peak = peak_flops_per_device(config.train.peak_flops_per_device) * jax.device_count()
    print(f"devices {jax.device_count()} ({jax.devices()[0].device_kind}), params {counts['total']:,}")
    print(f"step {step_s * 1e3:.1f} ms, {tokens / step_s:,.0f} tokens/s, {flops / step_s / 1e9:.1f} GFLOP/s, "
          f"MFU {100 * flops / step_s / peak:.1f}% of {peak / 1e9:.0f} GFLOP/s peak")
    print(f"RESULT train_tokens_per_s {tokens / step_s:.1f}")
    print(f"RESULT train_mfu {flops / step_s / peak:.4f}")


if __name__ == "__main__":
    app.run(main)
