"""Held-out perplexity of baseline, SCONE and 2x-depth baseline trained on the same tokens.

  python tools/bench_quality.py [--quick] [--num_steps=600]
All three share the tiny config's main model, data order, tokenizer and schedule:
  baseline     the main model alone
  scone        + an f-gram model as large as the main model's blocks (1x non-embedding size)
  baseline_2x  the main model with twice the layers (the paper's doubled-size baseline)
Perplexity is measured over the whole held-out split of the embedded corpus.
"""
import os
import tempfile

from absl import app, flags, logging

from scone_jax import train
from scone_jax.config import load_config_file

_QUICK = flags.DEFINE_bool("quick", False, "30 steps per model (a smoke run, not a comparison).")
_STEPS = flags.DEFINE_integer("num_steps", 600, "Training steps per model (same tokens for all).")
_FGRAM_LAYERS = flags.DEFINE_integer("fgram_layers", 4, "F-gram model depth for the scone run (4 = 1x).")


def config_for(variant: str, num_steps: int, tokenizer_path: str):
    config = load_config_file(f"configs/tiny.py:{variant}")
    t = config.train
    t.num_steps, t.eval_every, t.eval_batches, t.checkpoint_every = num_steps, num_steps, 0, num_steps
    t.log_every = max(1, num_steps // 10)
    t.warmup_steps = max(1, num_steps // 10)
    config.data.tokenizer_path = tokenizer_path
    if variant == "scone":
        config.scone.num_layers = _FGRAM_LAYERS.value
    return config


def main(_):
    logging.set_verbosity(logging.WARNING)
    num_steps = 30 if _QUICK.value else _STEPS.value
    results = {}
    with tempfile.TemporaryDirectory() as root:
        tokenizer_path = os.path.join(root, "tokenizer.model")
        for variant in ("baseline", "scone", "baseline_2x"):
            config = config_for(variant, num_steps, tokenizer_path if results else "")
            workdir = os.path.join(root, variant)
            summary = train.run(config, workdir)
            if not results:  # the first run trained the tokenizer; the others reuse it
                os.replace(os.path.join(workdir, "tokenizer.model"), tokenizer_path)
            results[variant] = summary["eval_perplexity"]
            tokens = num_steps * config.data.global_batch_size * config.data.seq_len
            print(f"{variant:12s} {num_steps} steps ({tokens:,} tokens): held-out ppl {results[variant]:.2f}", flush=True)
    for variant, ppl in results.items():
        print(f"RESULT ppl_{variant} {ppl:.3f}")


if __name__ == "__main__":
    app.run(main)
