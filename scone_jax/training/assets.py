"""The run's assets: its tokenizer (load `data.tokenizer_path`, or train one into the workdir once), the model's
vocabulary size from it, and the f-gram vocabulary (load `scone.vocab_path`, or extract one into the workdir
once) with the batch transform that uses it; with Over-Encoding instead, the batch transform that adds the hashed
n-gram ids (data/ngram_hash.py).

Extraction counts the same token stream the model sees: each training document as
[bos] + ids (the packed `inputs`; ids alone with data.add_bos=False), up to `scone.extract_max_tokens` tokens;
a conversation (data.source='chat') as its chat template renders it, every token (data/chat_sources.py).
"""
from __future__ import annotations

import itertools
import math
import time

import jax
from absl import logging

from scone_jax import sharding
from scone_jax.data import engram_hash, mixture, prompt, sources, tokenize, tokenizer as tokenizer_lib
from scone_jax.data import tokenizer_training
from scone_jax.data.engram_hash import EngramHasher
from scone_jax.data.ngram_hash import NgramHasher
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.extract import extract_fgrams
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import FgramVocab, load_vocab, save_vocab, vocab_exists
from scone_jax.model import engram, overencoding
from scone_jax.runtime import distributed, workdir as workdir_layout


def ensure_tokenizer(data_cfg, workdir: str,
                     max_chars: int = tokenizer_training.DEFAULT_MAX_CHARS) -> tokenizer_lib.Tokenizer:
    """The tokenizer for a run: data.tokenizer_path, else <workdir>/tokenizer.model, trained on first use.

    Training is deterministic in its input but not coordinated across processes:
    in a multi-process job call this on process 0 first, then on the others.
    """
    special_tokens = tokenizer_lib.special_tokens_of(data_cfg)  # data.bos/eos/pad_token: the same ids on every load
    if data_cfg.tokenizer_path:
        try:
            return tokenizer_lib.Tokenizer.load(data_cfg.tokenizer_path, special_tokens)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"data.tokenizer_path={data_cfg.tokenizer_path!r} does not exist. Fix: point it at a "
                "SentencePiece .model file or a Hugging Face tokenizer.json, or set it to '' to train one into the "
                "workdir."
            ) from None
    path = workdir_layout.path(workdir, workdir_layout.TOKENIZER)
    if data_cfg.source == "chat" and tokenizer_lib.read_model(path) is None:
        raise ValueError("data.source='chat' reads conversations with a checkpoint's tokenizer and chat template; "
                         "none is trained on them. Fix: set data.tokenizer_path (and data.chat_template if the "
                         "tokenizer's directory has none).")
    if tokenizer_lib.read_model(path) is None:
        docs = [doc for cfg, weight in _components(data_cfg)
                for doc in tokenizer_training.sample_documents(sources.open_source(cfg, "train"), int(max_chars * weight))]
        tokenizer_training.train_tokenizer(docs, path, data_cfg.vocab_size,
                                           character_coverage=data_cfg.character_coverage)
    return tokenizer_lib.Tokenizer.load(path, special_tokens)


def existing_tokenizer(data_cfg, workdir: str) -> tokenizer_lib.Tokenizer:
    """The tokenizer a run was trained with, as it is (data.tokenizer_path, else <workdir>/tokenizer.model), with
    the run's special-id policy: the fingerprint (and the ids an export stores) must be the run's."""
    path = data_cfg.tokenizer_path or workdir_layout.path(workdir, workdir_layout.TOKENIZER)
    return tokenizer_lib.Tokenizer.load(path, tokenizer_lib.special_tokens_of(data_cfg))


def _components(data_cfg) -> list:
    """[(data config, weight)] of the training data: the mixture's components (data/mixture.py), or the data
    config itself with weight 1."""
    components = mixture.components(data_cfg)
    if components is None:
        return [(data_cfg, 1.0)]
    return [(mixture.component_config(data_cfg, c), c.weight) for c in components]


def resolve_vocab_size(config, tokenizer) -> None:
    """model.vocab_size 0 -> the tokenizer's size rounded up to 128 (TPU-friendly). The tokenizer's size counts
    every id it can produce (a tokenizer.json's added tokens too); data.tokenizer_size, if set, pins it exactly."""
    name = f"the {tokenizer.kind} tokenizer {tokenizer.path or '(in memory)'}"
    want = config.data.get("tokenizer_size", 0)
    if want and tokenizer.vocab_size != want:
        raise ValueError(
            f"{name} has {tokenizer.vocab_size} tokens but data.tokenizer_size={want}: the config was made for "
            "another tokenizer. Fix: point data.tokenizer_path at the tokenizer its docstring names, or set "
            "data.tokenizer_size=0 to train with this one."
        )
    have = config.model.vocab_size
    if have == 0:
        with config.unlocked():
            config.model.vocab_size = model_vocab_size(tokenizer.vocab_size)
    elif have < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={have} is smaller than the {tokenizer.vocab_size} tokens of {name}. Fix: set "
            f"model.vocab_size=0 to size it from the tokenizer, or to at least {tokenizer.vocab_size}."
        )


def model_vocab_size(pieces: int) -> int:
    """The model's vocabulary for a tokenizer of `pieces` tokens: rounded up to a multiple of 128."""
    return int(math.ceil(pieces / 128) * 128)


def ensure_vocab(scone_cfg, data_cfg, tokenizer, workdir: str, is_chief: bool = True) -> FgramVocab:
    """Load the configured vocabulary (checked against the tokenizer), extracting it first if
    the config names none and the workdir has none yet."""
    path = scone_cfg.vocab_path or workdir_layout.path(workdir, workdir_layout.FGRAMS)
    if not scone_cfg.vocab_path and is_chief and not vocab_exists(path):
        start = time.time()
        # A mixture is counted with its weights (docs/method.md §1: the f-grams of the training data).
        docs = itertools.chain.from_iterable(
            tokenize.model_documents(sources.open_source(cfg, "train", tokenizer=tokenizer), tokenizer,
                                     bos_id=prompt.document_bos(tokenizer, data_cfg.add_bos),
                                     max_tokens=max(1, round(scone_cfg.extract_max_tokens * weight)))
            for cfg, weight in _components(data_cfg))
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


def existing_vocab(scone_cfg, tokenizer, workdir: str) -> FgramVocab:
    """The f-gram vocabulary a run was trained with, as it is (scone.vocab_path, else <workdir>/fgrams)."""
    return load_vocab(scone_cfg.vocab_path or workdir_layout.path(workdir, workdir_layout.FGRAMS),
                      expected_tokenizer_fingerprint=tokenizer.fingerprint)


def fgram_vocab(config, tokenizer, workdir: str) -> FgramVocab:
    """ensure_vocab on process 0 first, then on the others (which read what it extracted)."""
    return distributed.chief_first("fgram_vocab", lambda: ensure_vocab(
        config.scone, config.data, tokenizer, workdir, jax.process_index() == 0))


def make_batcher(config, vocab: FgramVocab, mesh) -> FgramBatcher:
    """The grain batch transform that adds each of this process's batch shards its f-grams."""
    local_shards = sharding.num_batch_shards(mesh) // jax.process_count()
    return FgramBatcher(Matcher(vocab), vocab, num_shards=local_shards, capacity=config.scone.fgram_capacity,
                        micro_batches=config.train.grad_accum_steps)


def ngram_hasher(config, tokenizer=None) -> NgramHasher | EngramHasher | None:
    """Over-Encoding's or Engram's batch transform (the n-gram ids of its tables over model.vocab_size, in the batch's
    ngram_ids), or None without either. Training's loader, its held-out evaluation and serving (the export's config)
    all make it here; Engram's tokenizer compression (engram.compress_tokens) reads the run's `tokenizer`."""
    en = config.get("engram")
    if en is not None and en.enabled:
        vocab = config.model.vocab_size
        compress = None
        if en.get("compress_tokens", False):
            if tokenizer is None:
                raise ValueError("engram.compress_tokens maps tokens through the run's tokenizer, and none was given "
                                 "here. Fix: pass the tokenizer, or set engram.compress_tokens=False.")
            compress = engram_hash.tokenizer_compression(tokenizer, vocab)
        return EngramHasher(engram.heads(en), [engram_hash.multipliers(en.seed, layer, en.n, vocab)
                                               for layer in engram.layers(en)], vocab, compress)
    oe = config.get("overencoding")
    if oe is None or not oe.enabled:
        return None
    return NgramHasher(overencoding.tables(oe), config.model.vocab_size)


def fgram_batcher(config, tokenizer, workdir: str, mesh):
    """(vocab, the grain batch transform that adds per-shard f-grams), or (None, None) without SCONE."""
    if not config.scone.enabled:
        return None, None
    vocab = fgram_vocab(config, tokenizer, workdir)
    return vocab, make_batcher(config, vocab, mesh)
