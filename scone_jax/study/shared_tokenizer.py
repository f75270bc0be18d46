"""The fine-tuning study's tokenizer (tools/bench_finetune.py): a byte-level BPE tokenizer.json trained on the
pretraining corpus, shared by the main model, the larger model and every fine-tune.

Why a tokenizer.json and not the quality study's SentencePiece model: an f-gram model grown from a pretrained
checkpoint (scone.init_from_hf) must read the run's token ids as the same tokens, which hf/fgram_source.py checks
against the source's tokenizer.json, and a run exported with --format=hf carries a tokenizer.json only when it
trained with one. Byte-level BPE without a normalizer (GPT-2's scheme) is lossless: decode(encode(text)) == text
for any text, the conversations' included. One special token, <|endoftext|>: the bos, eos and pad of every run
(data/tokenizer.py's rule for a file with one special token), and the eos the chat template closes replies with.
"""
from __future__ import annotations

import os

from scone_jax.data import sources, tokenizer_training

END_OF_TEXT = "<|endoftext|>"


def train(data_cfg, path: str, vocab_size: int, max_chars: int = 20_000_000) -> None:
    """Train the tokenizer on a sample of `data_cfg`'s training split (data/tokenizer_training.py's sample:
    the same documents for the same split) and write it to `path` (replaced at once)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = tokenizer_training.sample_documents(sources.open_source(data_cfg, "train"), max_chars)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer, length=len(docs))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tokenizer.save(path + ".tmp")
    os.replace(path + ".tmp", path)
