"""F-grams (docs/method.md §1, §2 and §5): extract the vocabulary, match it in batches, deduplicate per shard.

  vocab = extract_fgrams(token_docs, max_len=5, num_fgrams=S, min_count=5, vocab_size=V)
  save_vocab(vocab, "gs://bucket/run/fgrams"); vocab = load_vocab(path, expected_tokenizer_fingerprint=fp)
  batch = FgramBatcher(Matcher(vocab), vocab, num_shards=N, capacity=U)(batch)

The Apache Beam engine (scone_jax.fgram.beam) is an optional extra, imported on use.
"""
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.extract import extract_fgrams
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import FgramVocab, load_vocab, save_vocab

__all__ = ["FgramBatcher", "FgramVocab", "Matcher", "extract_fgrams", "load_vocab", "save_vocab"]
