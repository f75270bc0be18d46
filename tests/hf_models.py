"""Tiny random Hugging Face checkpoints of each supported family, built offline with transformers (the reference),
and the helpers the tests/test_hf_*.py files share: a small byte-level BPE tokenizer.json, a config that imports a
checkpoint, logits on both sides for a right-padded batch."""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

from scone_jax.config import base_config
from scone_jax.data import corpus

VOCAB = 320  # checkpoint rows (> the tokenizer's 300 tokens: a checkpoint may have spare rows, as Qwen3 does)
TOKENIZER_SIZE = 300
SPECIALS = {  # each family's tokenizer files as its releases spell them: (bos, eos, add_bos_token or None)
    "llama": ("<|begin_of_text|>", "<|end_of_text|>", None),  # tokenizer.json's template adds the bos
    "qwen3": (None, "<|endoftext|>", False),
    "gpt2": ("<|endoftext|>", "<|endoftext|>", None),
    "olmo": (None, "<|endoftext|>", False),
}


def tiny_config(family: str, *, tie: bool = False, **overrides):
    """A 2-layer transformers config of `family`: 4 query heads, 2 key/value heads and head_dim 16 != 48 / 4
    where the family allows it (GPT-2 has neither)."""
    from transformers import GPT2Config, LlamaConfig, OlmoConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=tie)
    if family == "gpt2":
        return GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64, n_inner=80,
                                    tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0), **overrides})
    if family == "olmo":
        return OlmoConfig(**{**common, "num_key_value_heads": 2, "eos_token_id": 0, "pad_token_id": 0, **overrides})
    if family == "qwen3":
        return Qwen3Config(**{**common, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, **overrides})
    if family == "llama":
        return LlamaConfig(**{**common, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                              "bos_token_id": 1, "eos_token_id": 2, **overrides})
    raise ValueError(family)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random at a scale that keeps activations O(1) (logits of a few units, so 1e-4 is a tight
    bound): matrices N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.2) (transformers sets them to 1,
    which would hide a norm mapped to the wrong place), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or "ln_" in name:
                value = 1 + 0.2 * noise if name.endswith("weight") else 0.1 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
                value = noise
            else:
                value = noise / np.sqrt(p.shape[0] if "transformer.h" in name else p.shape[-1])  # Conv1D is [in, out]
            p.copy_(value.to(p.dtype))
    return model


def tokenizer_json(path: str, family: str) -> str:
    """A 300-token byte-level BPE tokenizer.json with the family's special tokens (Llama 3's template adds its bos,
    as the real one does)."""
    bos, eos, _ = SPECIALS[family]
    specials = list(dict.fromkeys(t for t in (eos, bos) if t))
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.kjv_documents("train", 0.02)[:500], trainer)
    if family == "llama":
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(path)
    return path


def save_checkpoint(directory: str, family: str, *, tie: bool = False, dtype=torch.float32, seed: int = 0,
                    shard_size: str | None = None, **overrides) -> torch.nn.Module:
    """A random `family` checkpoint in `directory` (config.json, model.safetensors or shards of `shard_size` with
    their index, generation_config.json, tokenizer.json, tokenizer_config.json), as transformers writes it;
    returns the model (eval mode, fp32: the checkpoint's values)."""
    from transformers import AutoModelForCausalLM

    model = randomize(AutoModelForCausalLM.from_config(tiny_config(family, tie=tie, **overrides)), seed).eval()
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    tokenizer_json(os.path.join(directory, "tokenizer.json"), family)
    bos, eos, add_bos = SPECIALS[family]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    if dtype == torch.float32:
        return model
    # Read back in fp32: .to(bf16) also rounded the RoPE frequencies buffer, which .float() would keep.
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def import_config(directory: str, **data):
    """The base config importing `directory`: model keys at their defaults, a small batch, scanned layers."""
    c = base_config()
    c.model.init_from_hf = directory
    c.data.update(dict(seq_len=16, global_batch_size=8, worker_count=0, **data))
    c.train.update(dict(num_steps=4, warmup_steps=1, log_every=1, eval_every=0, checkpoint_every=2))
    c.lock()
    return c


def padded_batch(seed: int = 0, rows: int = 4, length: int = 12, vocab: int = TOKENIZER_SIZE):
    """(tokens [rows, length], lengths): rows of several lengths, right-padded with 0s."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (rows, length)).astype(np.int32)
    lengths = np.array([length, length - 3, 5, 1][:rows])
    for r, n in enumerate(lengths):
        tokens[r, n:] = 0
    return tokens, lengths


def hf_logits(model: torch.nn.Module, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """transformers' logits (fp32) of the right-padded batch, its attention mask marking the padding."""
    mask = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask))
    return out.logits.float().numpy()


def our_logits(decoder, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Our decoder's logits of the same batch: one document per row (segment 1), padding segment 0."""
    import jax.numpy as jnp

    valid = np.arange(tokens.shape[1])[None] < lengths[:, None]
    segments = valid.astype(np.int32)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(decoder(jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions)))


def assert_logits_match(got: np.ndarray, want: np.ndarray, lengths: np.ndarray, atol: float = 1e-4) -> float:
    """Every real (unpadded) position's logits within `atol`; returns the largest difference."""
    worst = 0.0
    for r, n in enumerate(lengths):
        diff = float(np.abs(got[r, :n] - want[r, :n]).max())
        worst = max(worst, diff)
    assert worst <= atol, f"logits differ by {worst:.2e} (> {atol:g})"
    return worst


def save_run(config, workdir: str, devices: int | None = None, randomize_params: bool = False, seed: int = 0):
    """`config`'s run built over the first `devices` devices (all by default: fewer compile faster), saved at step
    0 in `workdir` as the loop saves it; with `randomize_params` every parameter is first made random at randomize's
    scales (norm scales and biases too, which a fresh run sets to 1 and 0). Returns the run's decoder."""
    import jax
    from flax import nnx

    from scone_jax import sharding
    from scone_jax.training import run as run_lib

    run = run_lib.build(config, workdir, sharding.make_mesh(config.mesh, jax.devices()[:devices]))
    try:
        model, optimizer = nnx.merge(run.spec.graphdef, run.state)
        if randomize_params:
            rng, new = np.random.default_rng(seed), []
            for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
                old = variable.get_value()
                noise = rng.standard_normal(old.shape).astype(np.float32)
                name = path[-1]
                value = (1 + 0.2 * noise if name == "scale" else 0.1 * noise if name == "bias" else
                         noise if name == "embedding" else noise / np.sqrt(old.shape[-2]))
                new.append((path, variable.replace(jax.device_put(value.astype(old.dtype), old.sharding))))
            nnx.update(model, nnx.from_flat_state(new))
        run.save(0, nnx.split((model, optimizer))[1])
        run.checkpointer.wait()
    finally:
        run.close()
    return model.decoder if config.scone.enabled else model
