"""Small configs and synthetic batches shared by the tests."""
import numpy as np

from scone_jax.config import base_config


def small_config(**model_overrides):
    """A 2-layer, 64-wide model on the embedded corpus with a 512-piece tokenizer."""
    c = base_config()
    c.model.update(dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=128, max_seq_len=32))
    c.model.update(model_overrides)
    c.data.update(dict(seq_len=32, global_batch_size=16, vocab_size=512, worker_count=0))  # tests pick workers
    c.train.update(dict(num_steps=6, warmup_steps=2, learning_rate=3e-3, log_every=2, eval_every=0,
                        checkpoint_every=3, eval_batches=2))
    c.mesh.data = -1
    c.lock()
    return c


def random_batch(batch=16, seq=32, vocab=512, seed=0):
    """A batch with two packed documents per row, as the pipeline produces."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, (batch, seq + 1)).astype(np.int32)
    split = seq // 3
    segments = np.where(np.arange(seq) < split, 1, 2).astype(np.int32)[None].repeat(batch, 0)
    positions = np.where(np.arange(seq) < split, np.arange(seq), np.arange(seq) - split)
    mask = np.ones((batch, seq), np.float32)
    mask[:, split - 1] = 0  # a document's last input has no target inside the document
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segments,
                positions=positions.astype(np.int32)[None].repeat(batch, 0), loss_mask=mask)
