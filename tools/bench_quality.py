"""Held-out perplexity of baseline, SCONE and 2x-depth baseline trained on the same tokens.

  python tools/bench_quality.py [--quick] [--num_steps=600] [--variants=scone --num_fgrams=2000 --max_len=3]
All three share the tiny config's main model, data order, tokenizer and schedule:
  baseline     the main model alone
  scone        + an f-gram model as large as the main model's blocks (1x non-embedding size)
  baseline_2x  the main model with twice the layers (the paper's doubled-size baseline)
Perplexity is measured over the whole held-out split of the embedded corpus.
"""
import os
import tempfile

from absl import app, flags, logging

from scone_jax.config import load_config_file
from scone_jax.training import train

_QUICK = flags.DEFINE_bool("quick", False, "30 steps per model (a smoke run, not a comparison).")
_STEPS = flags.DEFINE_integer("num_steps", 600, "Training steps per model (same tokens for all).")
_FGRAM_LAYERS = flags.DEFINE_integer("fgram_layers", 4, "F-gram model depth for the scone run (4 = 1x).")
_NUM_FGRAMS = flags.DEFINE_integer("num_fgrams", 0, "S for the scone run (0 = the config's 20,000).")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "K for the scone run (0 = the config's 5).")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.0, "Peak learning rate of every model (0 = the config's 2e-3).")
_VARIANTS = flags.DEFINE_list("variants", "baseline,scone,baseline_2x", "Which models to train.")


def config_for(variant: str, num_steps: int, tokenizer_path: str):
    config = load_config_file(f"configs/tiny.py:{variant}")
    t = config.train
    t.num_steps, t.eval_every, t.eval_batches, t.checkpoint_every = num_steps, num_steps, 0, num_steps
    t.log_every = max(1, num_steps // 10)
    t.warmup_steps = max(1, num_steps // 10)
    config.data.tokenizer_path = tokenizer_path
    t.learning_rate = _LEARNING_RATE.value or t.learning_rate
    if variant == "scone":
        config.scone.num_layers = _FGRAM_LAYERS.value
        config.scone.num_fgrams = _NUM_FGRAMS.value or config.scone.num_fgrams
        config.scone.max_len = _MAX_LEN.value or config.scone.max_len
    return config


def main(_):
    logging.set_verbosity(logging.WARNING)
    num_steps = 30 if _QUICK.value else _STEPS.value
    results = {}
    with tempfile.TemporaryDirectory() as root:
        tokenizer_path = os.path.join(root, "tokenizer.model")
        for variant in _VARIANTS.value:
            config = config_for(variant, num_steps, tokenizer_path if results else "")
            workdir = os.path.join(root, variant)
            summary = train.run(config, workdir)
            if not results:  # the first run trained the tokenizer (deterministically); the others reuse it
                os.replace(os.path.join(workdir, "tokenizer.model"), tokenizer_path)
            results[variant] = summary["eval_perplexity"]
            tokens = num_steps * config.data.global_batch_size * config.data.seq_len
            print(f"{variant:12s} {num_steps} steps ({tokens:,} tokens): held-out ppl {results[variant]:.2f}", flush=True)
    for variant, ppl in results.items():
        print(f"RESULT ppl_{variant} {ppl:.3f}")


if __name__ == "__main__":
    app.run(main)
