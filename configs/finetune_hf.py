"""Fine-tune a Hugging Face checkpoint (Llama 3/3.1, Qwen3, GPT-2, OLMo 1; docs/training.md, "Bring your own
checkpoint"). Only fine-tuning settings live here: the model section and the tokenizer come from the checkpoint.

  python -m scone_jax.main --config=configs/finetune_hf.py --config.model.init_from_hf=/ckpt/Qwen3-0.6B-Base \
      --workdir=/tmp/ft --config.data.source=jsonl --config.data.train_files='/data/sft/*.jsonl'
  python -m scone_jax.main --config=configs/finetune_hf.py:/ckpt/Qwen3-0.6B-Base --workdir=/tmp/ft   # the same
  python tools/import_hf.py --hf_dir=/ckpt/Qwen3-0.6B-Base --workdir=/tmp/ft   # only step 0, saved; main resumes it
  python -m scone_jax.serving.export --workdir=/tmp/ft --output=/tmp/ft-hf --format=hf   # back to transformers

Without data settings it fine-tunes on the embedded KJV corpus (the checkpoint's tokenizer.json tokenizes it) in rows
of 128 tokens: set --config.data.seq_len (up to the checkpoint's max_position_embeddings for GPT-2) for real data.
The f-gram model of a SCONE run (--config.scone.enabled=True) starts random; the decoder starts from the checkpoint.
"""
import ml_collections

from scone_jax.config import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = base_config()
    config.model.init_from_hf = arg or ""
    d = config.data
    d.seq_len, d.global_batch_size = 128, 16  # valid with any checkpoint; raise it (e.g. 2048) for real data
    t = config.train
    t.num_steps, t.warmup_steps, t.learning_rate, t.min_lr_ratio = 200, 20, 2e-5, 0.1
    t.weight_decay, t.grad_clip_norm = 0.0, 1.0
    t.log_every, t.eval_every, t.checkpoint_every, t.eval_batches = 10, 100, 100, 20
    config.lock()
    return config
