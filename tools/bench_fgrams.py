"""Benchmark f-gram extraction and matching on one core; prints figures and `RESULT <name> <value>` lines.

  python tools/bench_fgrams.py --quick   # < 1 min: KJV + 10M synthetic tokens, matcher at S = 1e6
  python tools/bench_fgrams.py           # 100M synthetic tokens, matcher at S = 1e5, 1e6, 1e7

Corpora: the embedded KJV (BPE tokenizer, 8000 pieces, trained on the fly) and a
synthetic Zipfian corpus: Zipf(1.1) tokens over 32,000 ids with 15% of draws
replaced by phrases from a Zipfian lexicon of 2..6-token runs, cut into documents
of 500..1500 tokens, so long n-grams repeat as in text. K = 5 throughout. The
process is pinned to one core (os.sched_setaffinity), extraction runs with
num_workers=1. The synthetic corpus is generated to a file first and extraction
reads it from there (timing starts after generation). Peak RSS is the whole
process's (corpus generation included).
"""
import os
import resource
import tempfile
import time

import numpy as np
from absl import app, flags

from scone_jax.data import corpus, tokenizer_training
from scone_jax.fgram.extract import extract_fgrams
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import FgramVocab

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Small sizes; finishes in under a minute.")
flags.DEFINE_integer("synthetic_tokens", 0, "Override the synthetic corpus size (0: 10M quick, 100M full).")

MAX_LEN = 5
SYNTH_VOCAB = 32_000
BATCH, SEQ = 16, 2048


def synthetic_documents(num_tokens: int, seed: int, block: int = 10_000_000):
    """Yields the synthetic corpus's documents, generated block by block (bounded memory)."""
    lexicon_rng = np.random.default_rng(12345)  # one lexicon for every seed: held-out text shares phrases
    lengths = lexicon_rng.integers(2, 7, size=1_000_000)
    offsets = np.r_[0, np.cumsum(lengths)]
    lexicon = (np.minimum(lexicon_rng.zipf(1.1, size=offsets[-1]), SYNTH_VOCAB) - 1).astype(np.int32)
    rng = np.random.default_rng(seed)
    for start in range(0, num_tokens, block):
        size = min(block, num_tokens - start)
        draws = size  # more than enough: every draw yields >= 1 token
        is_phrase = rng.random(draws) < 0.15
        phrase = np.minimum(rng.zipf(1.1, size=draws), len(lengths)) - 1
        run = np.where(is_phrase, lengths[phrase], 1)
        single = (np.minimum(rng.zipf(1.1, size=draws), SYNTH_VOCAB) - 1).astype(np.int32)
        source = np.r_[lexicon, single]
        first = np.where(is_phrase, offsets[phrase], len(lexicon) + np.arange(draws))
        where = np.repeat(first - np.r_[0, np.cumsum(run)[:-1]], run) + np.arange(run.sum())
        tokens = source[where[:size]]
        cuts = np.cumsum(rng.integers(500, 1500, size=size // 500 + 1))
        yield from np.split(tokens, cuts[cuts < size])


def spooled_documents(num_tokens: int, seed: int, path: str):
    """Writes the synthetic corpus to `path` (int32 tokens + a .lengths.npy of document lengths) and
    returns a function that reads its documents back from disk: extraction is timed on a tokenized
    corpus, as in real use, without the generator's Zipf draws (slower than extraction itself)."""
    lengths = []
    with open(path, "wb") as out:
        for doc in synthetic_documents(num_tokens, seed):
            out.write(doc.astype(np.int32).tobytes())
            lengths.append(len(doc))
    ends = np.cumsum(lengths)

    def read():
        tokens = np.asarray(np.memmap(path, dtype=np.int32, mode="r"))  # a plain view: slicing a memmap is slow
        for start, stop in zip(np.r_[0, ends[:-1]], ends):
            yield tokens[start:stop]
    return read


def packed(docs, num_batches: int):
    """[BATCH, SEQ] batches of documents laid end to end, with their segment ids."""
    tokens = np.concatenate(docs)[: num_batches * BATCH * SEQ]
    segments = np.concatenate([np.full(len(d), i + 1, np.int32) for i, d in enumerate(docs)])[: len(tokens)]
    shape = (-1, BATCH, SEQ)
    return tokens.reshape(shape), segments.reshape(shape)


def top(vocab: FgramVocab, size: int) -> FgramVocab:
    """The best `size` f-grams: a prefix of the ranking is closed under sub-n-grams too."""
    return FgramVocab(tokens=vocab.tokens[:size], lengths=vocab.lengths[:size], counts=vocab.counts[:size],
                      max_len=vocab.max_len, min_count=vocab.min_count, tokens_counted=vocab.tokens_counted,
                      vocab_size=vocab.vocab_size, tokenizer_fingerprint=vocab.tokenizer_fingerprint)


def reference_rate(vocab: FgramVocab, tokens: np.ndarray, segments: np.ndarray) -> float:
    """Tokens/s of the plain way: a dict of tuples, all K-1 lengths probed at every position."""
    ids = {vocab.fgram(r): r for r in range(vocab.num_fgrams)}
    start = time.perf_counter()
    for row, seg in zip(tokens.tolist(), segments.tolist()):
        for i in range(len(row)):
            best = -1
            for n in range(2, MAX_LEN + 1):
                if i - n + 1 < 0 or seg[i - n + 1] != seg[i]:
                    break
                best = ids.get(tuple(row[i - n + 1 : i + 1]), best)
    return tokens.size / (time.perf_counter() - start)


def match_rate(matcher: Matcher, tokens: np.ndarray, segments: np.ndarray) -> tuple[float, float]:
    """(tokens/s, hit rate) over all batches, after one warm-up batch."""
    matcher.match(tokens[0], segments[0])
    start, hits = time.perf_counter(), 0
    for batch, seg in zip(tokens, segments):
        hits += int((matcher.match(batch, seg) >= 0).sum())
    return tokens.size / (time.perf_counter() - start), hits / tokens.size


def timed_extract(docs, num_tokens: int, **args) -> tuple[FgramVocab, float]:
    start = time.perf_counter()
    vocab = extract_fgrams(docs, max_len=MAX_LEN, num_workers=1, **args)
    return vocab, num_tokens / (time.perf_counter() - start)


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the extraction and matcher kernels, so that the timings
    below measure the work, not this once-per-process cost."""
    start = time.perf_counter()
    docs = [np.arange(12, dtype=np.int32) % 5] * 3
    vocab = extract_fgrams(docs, max_len=MAX_LEN, num_fgrams=10, min_count=1, vocab_size=5, num_workers=1)
    Matcher(vocab).match(np.stack(docs), np.ones((3, 12), np.int32))
    print(f"kernels compiled or loaded from cache in {time.perf_counter() - start:.1f} s (once per process)")


def bench_kjv(work_dir: str) -> None:
    docs = corpus.kjv_documents("train", 0.02)
    tok = tokenizer_training.train_tokenizer(docs, os.path.join(work_dir, "kjv.model"), 8000, model_type="bpe")
    ids = [tok.encode(d) for d in docs]
    num_tokens = sum(len(d) for d in ids)
    vocab, rate = timed_extract(ids, num_tokens, num_fgrams=100_000, min_count=5, vocab_size=tok.vocab_size)
    tokens, segments = packed(ids, num_tokens // (BATCH * SEQ))
    speed, hit = match_rate(Matcher(vocab), tokens, segments)
    print(f"KJV: {num_tokens / 1e6:.2f}M tokens, extract {rate / 1e6:.2f}M tokens/s, S={vocab.num_fgrams} "
          f"(cutoff {vocab.counts[-1]}), match {speed / 1e6:.2f}M tokens/s, hit rate {hit:.3f}")


def main(argv):
    del argv
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    print(f"pinned to core {core}")
    num_tokens = FLAGS.synthetic_tokens or (10_000_000 if FLAGS.quick else 100_000_000)
    sizes = [1_000_000] if FLAGS.quick else [100_000, 1_000_000, 10_000_000]
    warm_up()
    with tempfile.TemporaryDirectory() as work_dir:
        bench_kjv(work_dir)
        documents = spooled_documents(num_tokens, 0, os.path.join(work_dir, "synthetic.i32"))
        vocab, rate = timed_extract(documents(), num_tokens,
                                    num_fgrams=max(sizes), min_count=2, vocab_size=SYNTH_VOCAB)
    per_length = np.bincount(vocab.lengths, minlength=MAX_LEN + 1)[2:].tolist()
    print(f"synthetic: {num_tokens / 1e6:.0f}M tokens, extract {rate / 1e6:.2f}M tokens/s, S={vocab.num_fgrams} "
          f"(cutoff {vocab.counts[-1]}), per length 2..5: {per_length}")
    print(f"RESULT extract_tokens_per_s_per_core {rate:.0f}")
    held_out = list(synthetic_documents(BATCH * SEQ * (8 if FLAGS.quick else 40) + 100_000, seed=1))
    tokens, segments = packed(held_out, 8 if FLAGS.quick else 40)
    for size in sizes:
        if size > vocab.num_fgrams:
            print(f"S={size}: the corpus has only {vocab.num_fgrams} f-grams; skipped")
            continue
        part = top(vocab, size)
        start = time.perf_counter()
        matcher = Matcher(part)
        built = time.perf_counter() - start
        speed, hit = match_rate(matcher, tokens, segments)
        per_fgram = (matcher.nbytes + part.tokens.nbytes) / size
        print(f"matcher S={size}: {speed / 1e6:.2f}M tokens/s, hit rate {hit:.3f}, built in {built:.1f} s, "
              f"{per_fgram:.1f} bytes/f-gram (index {matcher.nbytes / size:.1f} + tokens {part.tokens.nbytes / size:.0f})")
        print(f"RESULT matcher_tokens_per_s_per_core_S{size:.0e} {speed:.0f}".replace("+0", ""))
    print(f"RESULT matcher_tokens_per_s_per_core {speed:.0f}")
    print(f"RESULT matcher_bytes_per_fgram {per_fgram:.1f}")
    ref = reference_rate(part, tokens[0][:2], segments[0][:2])  # two rows: 4096 tokens are plenty
    print(f"reference (dict, all K-1 probes) at S={part.num_fgrams}: {ref / 1e6:.3f}M tokens/s")
    print(f"RESULT matcher_speedup_vs_reference {speed / ref:.1f}")
    print(f"RESULT peak_rss_mb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")


if __name__ == "__main__":
    app.run(main)
