"""The paper's fine-tuning setting (SCONE, Table 4): Qwen3-4B-Base fine-tuned on open-r1's Mixture-of-Thoughts with
10M f-grams, the f-gram model grown from Qwen3-8B-Base (variant `14b`: Qwen3-14B-Base), at open-r1's hyperparameters
(docs/training.md, "SCONE on a pretrained model").

Copy the checkpoints to each host's local disk (nothing is downloaded at run time) and the conversations
(Mixture-of-Thoughts' `messages` as JSONL) where every host reads them, then on every host of the slice:

  python -m scone_jax.main --config=configs/finetune_paper.py --workdir=gs://BUCKET/paper-8b \\
      --config.data.train_files='gs://BUCKET/mot/*.jsonl' \\
      --config.model.init_from_hf=/ckpt/Qwen3-4B-Base --config.scone.init_from_hf=/ckpt/Qwen3-8B-Base
  python -m scone_jax.serving.export --workdir=gs://BUCKET/paper-8b --output=/tmp/paper-8b-hf --format=hf \\
      --dtype=bfloat16

Where it fits, compiled here for a TPU slice from the three config.json files alone (configs/hf/):

  python tools/aot_compile.py --config=configs/finetune_paper.py --topology=v5p-128 \\
      --hf_config=configs/hf/qwen3_4b_base --fgram_hf_config=configs/hf/qwen3_8b_base

What is open-r1's (its OpenR1-Distill-7B SFT recipe, which the paper follows; values from our reading of it):
learning rate 4e-5, cosine to 10% of it (cosine_with_min_lr, min_lr_rate 0.1), warm-up 3% of the steps, 5 epochs,
128 sequences of up to 32,768 tokens per step, gradient clipping at 0.2, loss on all tokens, sequences cut at 32,768
tokens, AdamW with transformers' defaults (betas 0.9 / 0.999, epsilon 1e-8, no weight decay).

Steps: Mixture-of-Thoughts ("all") holds 349,317 conversations; open-r1 trains one conversation per sequence
(packing off), so an epoch is ceil(349,317 / 128) = 2,730 steps and 5 epochs are 5 x 2,730 = 13,650 steps, warm-up
3% of them = 410. This loader packs whole conversations into rows (data/packing.py), so a row of 32,768 tokens holds
several and 13,650 steps of 128 rows pass over the corpus more often than 5 times: for 5 epochs of packed rows set
train.num_steps = 5 x ceil(R / 128), R the rows one pass over the corpus makes (were it 2.0B tokens filling rows to
90%: R = 67,817, so 2,650 steps).

What is ours (the paper leaves it open, docs/method.md §4): the f-gram model reads Qwen3-8B-Base's own token table
(scone.own_token_embedding) over RoPE positions 0..K-1, its output is projected from 4,096 (5,120) to 2,560, and
scone.gate starts at g = 0 so step 0 is the plain fine-tune. g trains at 25x the rate (scone.gate_learning_rate_
multiplier): Adam moves it by at most about the rate a step, so at 4e-5 by at most 0.3 over the whole schedule;
at 1e-3 it can reach 1 within about 1,000 steps.
F-grams: the 10M most frequent of 2..5 tokens counted on the rendered corpus (tools/extract_fgrams.py; min count
5); U = 16,384 unique f-grams per data shard and step is a guess for 2 rows of 32k tokens per shard: a batch that
needs more stops naming the value to set. bf16 compute, fp32 master weights, the blocks rematerialised.
"""
import ml_collections

from scone_jax.config import base_config

SOURCES = {"8b": "/ckpt/Qwen3-8B-Base", "14b": "/ckpt/Qwen3-14B-Base"}
VARIANTS = tuple(SOURCES)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "8b"
    if variant not in SOURCES:
        raise ValueError(f"Unknown variant {arg!r} of configs/finetune_paper.py; valid variants: {', '.join(SOURCES)} "
                         "(the f-gram model's source). Pass one as --config=configs/finetune_paper.py:8b.")
    config = base_config()
    m = config.model
    m.init_from_hf = "/ckpt/Qwen3-4B-Base"
    m.dtype, m.remat = "bfloat16", "full"

    s = config.scone
    s.enabled, s.init_from_hf, s.own_token_embedding = True, SOURCES[variant], True
    s.gate, s.gate_learning_rate_multiplier = True, 25.0
    s.num_fgrams, s.max_len, s.min_count = 10_000_000, 5, 5
    s.extract_max_tokens = 4_000_000_000  # the whole corpus (about 2B tokens rendered)
    s.fgram_capacity = 16_384
    s.max_source_params = 16_000_000_000  # Qwen3-14B's f-gram model has 14.8B; more is a mistake on this slice

    d = config.data
    d.seq_len, d.global_batch_size = 32_768, 128
    if "loss_on" in d:  # the conversation loader's keys (data.source='chat')
        d.source, d.loss_on, d.overlong = "chat", "all", "truncate"
    else:
        d.source = "jsonl"

    t = config.train
    t.learning_rate, t.min_lr_ratio, t.num_steps, t.warmup_steps = 4e-5, 0.1, 13_650, 410
    t.grad_clip_norm, t.weight_decay, t.b1, t.b2, t.eps = 0.2, 0.0, 0.9, 0.999, 1e-8
    t.grad_accum_steps = 2  # one 32k row per chip and micro-batch on v5p-128: 52 GiB per chip, not 94 (docs/benchmarks.md)
    t.log_every, t.eval_every, t.checkpoint_every = 10, 0, 500

    config.mesh.data, config.mesh.fsdp = 1, -1
    config.lock()
    return config
