"""The small models of the quality study (tools/bench_quality.py, docs/quality.md): SCONE's protocol on a CPU.

  python tools/split_corpus.py --input=/usr/share/doc/linux-doc-6.1/html/_sources --pattern='**/*.txt' \\
      --output=/data/linux_doc
  python -m scone_jax.main --config=configs/quality.py:scone --workdir=/tmp/q_scone \\
      --config.data.train_files=/data/linux_doc/train.jsonl --config.data.eval_files=/data/linux_doc/validation.jsonl
trains one arm of the study by hand (the tool runs them all, with a shared tokenizer and f-gram
vocabularies, a learning-rate sweep and test-split evaluation through the export).

Main model: GPT-2 style, d 128, 2 blocks, 4 heads, ffw 512, sequences of 256 tokens, batch 32
(8,192 tokens per step), a 2,048-piece tokenizer trained on the training split, data.source jsonl.
Variants (the arms; inference FLOPs per token grow with the decoder's depth only):
  baseline, baseline_2x, baseline_4x   2 / 4 / 8 decoder blocks (about 1x / 2x / 4x inference FLOPs)
  scone                                the 2-block decoder + a 2-block f-gram model (1x its blocks),
                                       S = 20,000 f-grams of up to K = 5 tokens
  scone_fgram0.5x, scone_fgram2x       f-gram model of 1 / 4 blocks
  scone_s5k, scone_s100k               S = 5,000 / 100,000
  scone_k3                             K = 3
  oe, oe_5x                            SCONE's baseline, Over-Encoding (Huang et al. 2025; docs/method.md §8) on the
                                       2-block decoder: n = 3, k = 4 (8 tables of width 16), m = 20,011 (about
                                       S x d = 20k x 128 table parameters, as `scone`'s table) / 100,003 (5x); its
                                       tables and projection stay on the accelerator, so it adds inference FLOPs
                                       (the [d, d] projection) and accelerator bytes that SCONE does not
  engram                               the other n-gram baseline, Engram (DeepSeek 2026; docs/method.md §9) on the
                                       2-block decoder, before its second block: n = 3, 4 heads per order (8
                                       tables of width 16, a memory row of 128), rows from 20,000 on (primes
                                       20,011 ..: about S x d = 20k x 128 table parameters, as `scone`'s table);
                                       on the accelerator like Over-Encoding's, its W_K, W_V, convolution and gate
                                       add inference FLOPs
Every arm multiplies its token inputs by sqrt(d) = 11.31 (model.embedding_multiplier; 1 in the
method): at width 128 the plain GPT-2 input rows are small next to the blocks' output, a handicap the
f-gram rows (final-norm output, norm sqrt(d)) never have, so without it the baseline is 15-22% worse
and SCONE's lead is the scale (docs/quality.md). The SCONE arms' f-gram models read T times sqrt(d)
too (scone.input_multiplier; 1 in the method): with the plain T their blocks carry the same handicap,
and SCONE at 3M tokens is 20% worse (99.7 against 80.6). --config.model.embedding_multiplier=1
--config.scone.input_multiplier=1 gives the method's plain inputs. The f-gram model keeps the method's
final norm (scone.output_norm): without it its rows collapsed for less long early in training, but the
perplexity was no better (docs/quality.md). The step count, learning rate, f-gram capacity and
vocabulary path are set by the tool (or on the command line, e.g. --config.train.num_steps=1220 for 10M
tokens).

The SCONE arms hold the f-gram model's updates back for their first 6.5% of steps
(train.fgram_model_delay_fraction=0.065; 0 in the method): 80 of the 1,221 steps of 10M tokens, the best
delay the study found on validation there (1x, two seeds: 31.90 / 31.80 against 32.12 / 32.05 with 40
steps), and 24 of the 367 of 3M, where 80 steps would be 22% of the run (docs/quality.md, "The hold-back
at each budget": what it costs or buys at each budget on both corpora), so a user running tools/bench_quality.py on a new corpus
gets it without flags, and --config.train.fgram_model_delay_fraction=0 gives the method's. Records made
before this default say so (scone_jax/study/records.py: defaults_version). The other experiments on how
the f-gram model trains are settings of the tool (docs/training.md), off here:
--config.train.fgram_model_delay_steps_per_layer=20 with --config.train.fgram_model_delay_fraction=0
(20, 40, 80 steps for the 1-, 2-, 4-block f-gram models), --config.scone.learning_rate_multiplier=0.5,
--config.scone.gate=true. A baseline arm refuses the last two (they mean nothing without SCONE) unless its
run is already finished, so pass --arms with SCONE arms only when its runs are not.
"""
import math

import ml_collections

from scone_jax.config import base_config

# Over-Encoding arm -> m (prime; with model.vocab_size 2,048, a power of two, every table's odd modulus m + 2s is
# coprime with it, as docs/method.md §8 requires); n and k are OE_N, OE_K for both
OE_ARMS = {"oe": 20_011, "oe_5x": 100_003}
OE_N, OE_K = 3, 4
# The Engram arm: before block 1, orders 2..3, 4 heads of width 16 per order, rows from 20,000 on (docstring).
ENGRAM = dict(enabled=True, layers="1", n=3, heads=4, head_width=16, rows=20_000)
# The SCONE arms' hold-back: the f-gram model's updates wait for this share of the run (docstring).
HOLD_BACK = 0.065
# arm -> (decoder blocks, f-gram model blocks (0 = no SCONE), S, K)
ARMS = {
    "baseline": (2, 0, 0, 0),
    "baseline_2x": (4, 0, 0, 0),
    "baseline_4x": (8, 0, 0, 0),
    "scone": (2, 2, 20_000, 5),
    "scone_fgram0.5x": (2, 1, 20_000, 5),
    "scone_fgram2x": (2, 4, 20_000, 5),
    "scone_s5k": (2, 2, 5_000, 5),
    "scone_s100k": (2, 2, 100_000, 5),
    "scone_k3": (2, 2, 20_000, 3),
    **{arm: (2, 0, 0, 0) for arm in OE_ARMS},
    "engram": (2, 0, 0, 0),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arm = arg or "scone"
    if arm not in ARMS:
        raise ValueError(f"Unknown variant {arg!r} of configs/quality.py; valid: {', '.join(ARMS)}.")
    layers, fgram_layers, num_fgrams, max_len = ARMS[arm]
    config = base_config()
    m = config.model
    m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_seq_len = 128, layers, 4, 512, 256
    m.vocab_size = 0  # from the tokenizer
    m.embedding_multiplier = math.sqrt(m.d_model)  # the stronger baseline (docstring)
    d = config.data
    d.source, d.seq_len, d.global_batch_size, d.vocab_size = "jsonl", 256, 32, 2048
    d.character_coverage = 0.99  # 2,048 pieces: the CJK of the kernel docs' translations goes to byte pieces
    t = config.train
    t.num_steps, t.warmup_steps, t.learning_rate = 1220, 61, 2e-3
    t.log_every, t.eval_every, t.eval_batches, t.checkpoint_every, t.keep_checkpoints = 50, 1220, 0, 200, 1
    s = config.scone
    s.enabled = fgram_layers > 0
    if s.enabled:
        s.num_layers, s.num_fgrams, s.max_len, s.min_count = fgram_layers, num_fgrams, max_len, 5
        s.fgram_capacity = 4096
        s.input_multiplier = m.embedding_multiplier  # the f-gram model's blocks get the scaled input too
        t.fgram_model_delay_fraction = HOLD_BACK  # chosen on validation (docstring; study/records.py DEFAULTS[3])
    if arm in OE_ARMS:
        config.overencoding.update(dict(enabled=True, n=OE_N, k=OE_K, m=OE_ARMS[arm]))
    if arm == "engram":
        config.engram.update(ENGRAM)
    config.lock()
    return config
