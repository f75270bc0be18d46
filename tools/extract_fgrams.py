"""Build the f-gram vocabulary of a corpus (docs/method.md §1) and report its statistics.

  # the embedded KJV corpus (train split), tokenized with a SentencePiece model:
  python tools/train_tokenizer.py --format=kjv --output=/tmp/kjv.model
  python tools/extract_fgrams.py --source=kjv --tokenizer=/tmp/kjv.model --num_fgrams=100000 --output=/tmp/fgrams
  # text files (one document per line) or pre-tokenized ArrayRecord (raw int32 per document):
  python tools/extract_fgrams.py --source=text --files='corpus/*.txt' --tokenizer=tok.model --output=gs://b/fgrams
  python tools/extract_fgrams.py --source=arrayrecord --files='tok/*.arrayrecord' --tokenizer=tok.model --output=...
  # conversations, rendered with the chat template beside the tokenizer (--chat_template to name another):
  python tools/extract_fgrams.py --source=chat --files='sft/*.jsonl' --tokenizer=/ckpt/tokenizer.json --noadd_bos ...
  # the same vocabulary with Apache Beam (pip install scone_jax[beam]); --beam_options go to the runner:
  python tools/extract_fgrams.py --engine=beam --source=kjv --tokenizer=/tmp/kjv.model --output=/tmp/fgrams_beam

Shows progress (tokens/s, ETA), then the count of the S-th f-gram (the cutoff),
f-grams per length, and on the first --stats_tokens tokens packed into batches:
hit rate, mean matched length and unique ratio per batch.
"""
import sys
import time

import ml_collections
import numpy as np
from absl import flags

from scone_jax.batch import Batch
from scone_jax.data import prompt, sources, tokenize, tokenizer_flags
from scone_jax.fgram import stats
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.extract import extract_fgrams
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import save_vocab
from scone_jax.runtime import tool_main

FLAGS = flags.FLAGS
flags.DEFINE_enum("source", "kjv", list(sources.SOURCES), "Corpus kind, as data.source in the configs.")
flags.DEFINE_string("files", "", "Comma-separated globs (all sources but kjv).")
flags.DEFINE_string("text_field", "text", "JSONL field holding the text.")
flags.DEFINE_enum("document_unit", "line", ["line", "file"], "Text files: one document per line or per file.")
flags.DEFINE_float("eval_fraction", 0.02, "kjv: fraction of documents held out (not counted).")
TOKENIZER = tokenizer_flags.define("its fingerprint goes into the vocabulary and each document is "
                                    "counted as [bos] + ids (--add_bos), as the training run reads it.")
CHAT = tokenizer_flags.define_chat(loss_on=False)
flags.adopt_module_key_flags(tokenizer_flags)  # listed by --help
flags.DEFINE_integer("vocab_size", 0, "arrayrecord without --tokenizer: the tokenizer's vocabulary size (the "
                     "documents are then counted without bos).")
flags.DEFINE_bool("add_bos", True, "With --tokenizer: count each document as [bos] + ids, as a run with "
                  "data.add_bos=True (the default) reads it; --noadd_bos: its ids alone (data.add_bos=False).")
flags.DEFINE_integer("max_len", 5, "K: longest f-gram, in tokens (>= 2).")
flags.DEFINE_integer("num_fgrams", 1_000_000, "S: f-grams kept.")
flags.DEFINE_integer("min_count", 5, "Minimum count of every f-gram.")
flags.DEFINE_integer("max_tokens", 0, "Read at most this many tokens (0: all).")
flags.DEFINE_string("output", None, "Vocabulary directory: local path or gs://...", required=True)
flags.DEFINE_enum("engine", "local", ["local", "beam"], "One machine (all cores) or an Apache Beam pipeline.")
flags.DEFINE_string("beam_options", "", "Space-separated Beam pipeline options, e.g. '--runner=DataflowRunner ...'.")
flags.DEFINE_integer("num_workers", 0, "Processes for tokenizing and counting (0: all cores).")
flags.DEFINE_string("work_dir", None, "Scratch directory (default: the system temp dir); needs ~4 bytes/token.")
flags.DEFINE_integer("stats_tokens", 2_000_000, "Tokens used for the hit-rate statistics.")
flags.DEFINE_integer("stats_batch", 16, "Rows per statistics batch.")
flags.DEFINE_integer("stats_seq_len", 2048, "Tokens per row of a statistics batch.")

def open_documents():
    """(document source, tokenizer or None, vocab_size, tokenizer fingerprint)."""
    data = ml_collections.ConfigDict({
        "source": FLAGS.source, "train_files": FLAGS.files, "eval_files": "", "text_field": FLAGS.text_field,
        "document_unit": FLAGS.document_unit, "eval_fraction": FLAGS.eval_fraction,
        **CHAT.fields(TOKENIZER.path.value)})
    tok = TOKENIZER.load(required=False)
    source = sources.open_source(data, "train", tokenizer=tok)  # conversations: rendered with their template
    if tok is None and FLAGS.source != "arrayrecord":
        raise ValueError(f"--source={FLAGS.source} is text: pass --tokenizer=<model> (tools/train_tokenizer.py).")
    if tok is None and FLAGS.vocab_size <= 0:
        raise ValueError("Without --tokenizer, pass --vocab_size (the tokenizer's size) for the token ids.")
    return source, tok, tok.vocab_size if tok else FLAGS.vocab_size, tok.fingerprint if tok else ""


def token_documents(source, tok, workers: int):
    """The documents as the model reads them ([bos] + ids, or ids alone with --noadd_bos, as the training run's own
    extraction counts them; no bos without --tokenizer), up to --max_tokens tokens."""
    bos = prompt.document_bos(tok, FLAGS.add_bos) if tok else None
    return tokenize.model_documents(source, tok, bos_id=bos, max_tokens=FLAGS.max_tokens, workers=workers)


class ProgressPrinter:
    """Prints phase, tokens/s and ETA at most every few seconds (and at the end of each phase)."""

    def __init__(self, scans: int, every: float = 5.0):
        self.scans, self.every = scans, every
        self.phase, self.start, self.last_call, self.last_print = None, time.time(), time.time(), 0.0

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.time()
        if phase != self.phase:  # a phase starts when the previous one reported its end
            self.phase, self.start, self.last_print = phase, self.last_call, 0.0
        self.last_call = now
        if now - self.last_print < self.every and done != total:
            return
        self.last_print = now
        rate = done / max(now - self.start, 1e-9)
        line = f"{phase}: {done / 1e6:.1f}M tokens, {rate / 1e6:.2f}M tokens/s"
        if total:
            scans_left = self.scans - int(phase.split()[1].split("-")[0]) + 1  # "count 3-grams" -> 3
            eta = max(0, total - done + (scans_left - 1) * total) / max(rate, 1)
            line += f", {100 * done / total:.0f}% of this scan, ETA {eta:.0f} s for all scans"
        print(line, file=sys.stderr, flush=True)


def packed_batches(docs, rows: int, length: int):
    """Batches (inputs and segment ids) of documents laid end to end (segment ids count from 1 per row)."""
    tokens = np.concatenate(docs)
    segments = np.concatenate([np.full(len(d), i % 2**30 + 1, np.int32) for i, d in enumerate(docs)])
    per_batch = rows * length
    for start in range(0, len(tokens) - per_batch + 1, per_batch):
        yield Batch(inputs=tokens[start: start + per_batch].reshape(rows, length),
                    segment_ids=segments[start: start + per_batch].reshape(rows, length))


def report(vocab, docs) -> None:
    print(f"f-grams: {vocab.num_fgrams} (asked for {FLAGS.num_fgrams}) from {vocab.tokens_counted} tokens; "
          f"fingerprint {vocab.fingerprint}")
    if vocab.num_fgrams < FLAGS.num_fgrams:
        print(f"  only {vocab.num_fgrams} n-grams occur >= min_count={vocab.min_count} times")
    print(f"count cutoff (count of f-gram #{vocab.num_fgrams}): {vocab.counts[-1]}; top count {vocab.counts[0]}")
    per_length = np.bincount(vocab.lengths, minlength=vocab.max_len + 1)[2:]
    print("per length: " + ", ".join(f"{n}: {c}" for n, c in enumerate(per_length, start=2)))
    batcher = FgramBatcher(Matcher(vocab), vocab, num_shards=1, capacity=FLAGS.stats_batch * FLAGS.stats_seq_len)
    figures = [stats.batch_stats(batcher(b)) for b in packed_batches(docs, FLAGS.stats_batch, FLAGS.stats_seq_len)]
    if not figures:
        print("corpus statistics: too few tokens for one statistics batch")
        return
    means = {k: float(np.mean([f[k] for f in figures])) for k in figures[0]}
    print(f"corpus statistics over {len(figures)} batches of {FLAGS.stats_batch}x{FLAGS.stats_seq_len}: "
          + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in means.items()))


def run() -> None:
    source, tok, vocab_size, fingerprint = open_documents()
    workers = tokenize.resolve_workers(FLAGS.num_workers or -1, "--num_workers") if tok is not None else 1
    args = dict(max_len=FLAGS.max_len, num_fgrams=FLAGS.num_fgrams, min_count=FLAGS.min_count,
                vocab_size=vocab_size, tokenizer_fingerprint=fingerprint)
    start = time.time()
    if FLAGS.engine == "beam":
        from scone_jax.fgram import beam  # noqa: PLC0415 (optional extra)
        vocab = beam.extract_fgrams_beam(list(token_documents(source, tok, workers)), output=FLAGS.output,
                                         pipeline_args=FLAGS.beam_options.split(), **args)
    else:
        vocab = extract_fgrams(token_documents(source, tok, workers), num_workers=FLAGS.num_workers or None,
                               work_dir=FLAGS.work_dir, progress=ProgressPrinter(FLAGS.max_len - 1), **args)
        save_vocab(vocab, FLAGS.output)
    print(f"wrote {FLAGS.output} in {time.time() - start:.1f} s "
          f"({vocab.tokens_counted / (time.time() - start) / 1e6:.2f}M tokens/s overall)")
    stats_docs, held = [], 0
    for doc in token_documents(source, tok, 1):  # in-process: stopping early must not leave work queued
        if held >= FLAGS.stats_tokens:
            break
        stats_docs.append(doc)
        held += len(doc)
    report(vocab, stats_docs)


if __name__ == "__main__":
    tool_main.run(run)
