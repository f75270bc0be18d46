"""The run's assets: the model's vocabulary size from the tokenizer, and the f-gram vocabulary (load
`scone.vocab_path`, or extract one into the workdir once) with the batch transform that uses it.

Extraction counts the same token stream the model sees: each training document as
[bos] + ids (the packed `inputs`), up to `scone.extract_max_tokens` tokens.
"""
from __future__ import annotations

import math
import os
import time

import jax
import numpy as np
from absl import logging

from scone_jax import sharding
from scone_jax.data import sources
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.extract import extract_fgrams
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import FgramVocab, load_vocab, save_vocab, vocab_exists
from scone_jax.runtime import distributed


def resolve_vocab_size(config, tokenizer) -> None:
    """model.vocab_size 0 -> the tokenizer's size rounded up to 128 (TPU-friendly)."""
    have = config.model.vocab_size
    if have == 0:
        with config.unlocked():
            config.model.vocab_size = int(math.ceil(tokenizer.vocab_size / 128) * 128)
    elif have < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={have} is smaller than the tokenizer's {tokenizer.vocab_size} pieces; "
            "set model.vocab_size=0 to size it from the tokenizer."
        )


def training_token_documents(data_cfg, tokenizer, max_tokens: int):
    """[bos] + ids of each training document, in corpus order, until max_tokens are read."""
    source = sources.open_source(data_cfg, "train")
    budget = max_tokens
    for i in range(len(source)):
        doc = source[i]
        ids = tokenizer.encode(doc) if isinstance(doc, str) else np.asarray(doc, np.int32)
        doc_ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32)[:budget]
        yield doc_ids
        budget -= len(doc_ids)
        if budget <= 0:
            return


def ensure_vocab(scone_cfg, data_cfg, tokenizer, workdir: str, is_chief: bool = True) -> FgramVocab:
    """Load the configured vocabulary (checked against the tokenizer), extracting it first if
    the config names none and the workdir has none yet."""
    path = scone_cfg.vocab_path or os.path.join(workdir, "fgrams")
    if not scone_cfg.vocab_path and is_chief and not vocab_exists(path):
        start = time.time()
        docs = training_token_documents(data_cfg, tokenizer, scone_cfg.extract_max_tokens)
        vocab = extract_fgrams(
            docs, max_len=scone_cfg.max_len, num_fgrams=scone_cfg.num_fgrams, min_count=scone_cfg.min_count,
            vocab_size=tokenizer.vocab_size, tokenizer_fingerprint=tokenizer.fingerprint, num_workers=1,
        )
        save_vocab(vocab, path)
        logging.info("Extracted %d f-grams from %d tokens in %.1f s into %s (count cutoff %d)",
                     vocab.num_fgrams, vocab.tokens_counted, time.time() - start, path,
                     vocab.counts[-1] if vocab.num_fgrams else 0)
    vocab = load_vocab(path, expected_tokenizer_fingerprint=tokenizer.fingerprint)
    if vocab.max_len != scone_cfg.max_len:
        raise ValueError(
            f"The f-gram vocabulary at {path!r} has K={vocab.max_len} but scone.max_len={scone_cfg.max_len}; "
            "set scone.max_len to match or extract a new vocabulary."
        )
    return vocab


def fgram_batcher(config, tokenizer, workdir: str, mesh):
    """(vocab, the grain batch transform that adds per-shard f-grams), or (None, None) without SCONE."""
    if not config.scone.enabled:
        return None, None
    vocab = distributed.chief_first("fgram_vocab", lambda: ensure_vocab(
        config.scone, config.data, tokenizer, workdir, jax.process_index() == 0))
    local_shards = sharding.num_batch_shards(mesh) // jax.process_count()
    batcher = FgramBatcher(Matcher(vocab), vocab, num_shards=local_shards, capacity=config.scone.fgram_capacity,
                           micro_batches=config.train.grad_accum_steps)
    return vocab, batcher
