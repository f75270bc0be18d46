"""Tiny GPT-2-style decoder on the embedded KJV corpus: the default CPU job.

Run (a few minutes on a 2-core CPU; builds the tokenizer into the workdir first):
  python -m scone_jax.main --config=configs/tiny.py --workdir=/tmp/scone_tiny
Expect the training loss to fall from ~9 to ~4.5 and held-out perplexity near 90 after
200 steps. Running the same command again resumes from the latest checkpoint.
Override any field from the command line, e.g. `--config.model.num_layers=2`.
"""
import ml_collections

from scone_jax.config import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg  # no variants yet
    config = base_config()
    m = config.model
    m.d_model, m.num_layers, m.num_heads, m.d_ff = 256, 4, 4, 1024
    m.max_seq_len = 128
    d = config.data
    d.source, d.seq_len, d.global_batch_size, d.vocab_size = "kjv", 128, 16, 8000
    t = config.train
    t.num_steps, t.warmup_steps, t.learning_rate = 200, 20, 2e-3
    t.log_every, t.eval_every, t.checkpoint_every, t.eval_batches = 10, 100, 100, 20
    config.lock()
    return config
