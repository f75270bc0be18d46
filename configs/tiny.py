"""Tiny GPT-2-style SCONE model on the embedded KJV corpus: the default CPU job.

  python -m scone_jax.main --config=configs/tiny.py --workdir=/tmp/scone_tiny           # SCONE
  python -m scone_jax.main --config=configs/tiny.py:baseline --workdir=/tmp/tiny_base   # no f-grams
The first run trains a tokenizer and extracts the f-grams into the workdir (seconds), then
trains the decoder and the f-gram model jointly for 200 steps (about 4.5 minutes on 2 quiet CPU cores).
Rerunning resumes from the latest checkpoint. Variants: '' or 'scone' (default), 'baseline'
(the same main model alone), 'baseline_2x' (twice the layers).
Override any field from the command line, e.g. `--config.model.num_layers=2`.
"""
import ml_collections

from scone_jax.config import base_config

VARIANTS = ("scone", "baseline", "baseline_2x")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "scone"
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {arg!r} of configs/tiny.py; valid: {VARIANTS}.")
    config = base_config()
    m = config.model
    m.d_model, m.num_layers, m.num_heads, m.d_ff = 256, 4, 4, 1024
    m.max_seq_len = 128
    d = config.data
    d.source, d.seq_len, d.global_batch_size, d.vocab_size = "kjv", 128, 16, 8000
    t = config.train
    t.num_steps, t.warmup_steps, t.learning_rate = 200, 20, 2e-3
    t.log_every, t.eval_every, t.checkpoint_every, t.eval_batches = 10, 100, 100, 20
    s = config.scone
    s.enabled = variant == "scone"
    s.max_len, s.num_fgrams, s.min_count, s.fgram_capacity = 5, 20_000, 5, 1024
    s.num_layers = 2  # f-gram model at 0.5x the main model's blocks (the paper's low end), for speed
    if variant == "baseline_2x":
        m.num_layers = 8
    config.lock()
    return config
