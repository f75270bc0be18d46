"""Tokenize a text or JSONL corpus once, into ArrayRecord shards that training reads directly.

  python tools/pretokenize.py --input='corpus/*.txt' --tokenizer=tok.model --output=/data/tok
  python tools/pretokenize.py --input='web/*.txt' --tokenizer=/models/gpt2/tokenizer.json --output=/data/gpt2
  python tools/pretokenize.py --format=jsonl --text_field=text --input='a/*.jsonl,b/*.jsonl' \
      --tokenizer=gs://bucket/tok.model --output=/data/tok --workers=16
  # conversations (JSONL of messages) rendered with the chat template beside the tokenizer, with their loss mask:
  python tools/pretokenize.py --format=chat --input='sft/*.jsonl' --tokenizer=/ckpt/tokenizer.json --loss_on=assistant \
      --output=/data/sft   # train with data.source=chat, data.train_files='/data/sft/tokens-*.arrayrecord'
  # then train with: --config.data.source=arrayrecord \
  #   --config.data.train_files='/data/tok/tokens-*.arrayrecord' --config.data.tokenizer_path=tok.model

Writes tokens-00000-of-0000N.arrayrecord ... (one record per document: its little-endian int32
token ids, no bos/eos; shard i holds a contiguous range of documents in input order), each
with the sidecars <shard>.lengths.npy and <shard>.json (scone_jax/data/shards.py). Every worker
process writes whole shards, streaming them (memory stays bounded by one chunk of documents);
the output is the same for any --workers. Shards are written into a directory of this run's own
(OUTPUT/.run-<pid>-<random>) and published into OUTPUT only once every shard is complete, so a
rerun replaces the shards and a worker of a killed run, which exits within a second of its
parent anyway, can never remove or replace a newer run's files; the next run deletes a killed
run's directory. --format=chat stores each conversation's ids and loss mask (scone_jax/data/shards.py) and
names the chat template and --loss_on in the sidecar; a conversation the template cannot render or whose
reply cannot be found stops the tool in one line naming its file and line. --tokenizer is a SentencePiece .model or a Hugging
Face tokenizer.json (the kind is read from the file). The shards record its fingerprint, which
covers the special ids too: pass the --bos_token/--eos_token/--pad_token the run sets as
data.*_token (default: the tokenizer's own), or training refuses the shards. Progress
(documents, tokens, tokens/s, ETA) goes to stderr; the last line is
`RESULT pretokenize_tokens_per_s <v>`. Bad input stops with a one-line error and exit status 2.
"""
import glob
import math
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import ml_collections
from absl import flags

from scone_jax.data import chat_sources, shards, sources, tokenize, tokenizer_flags
from scone_jax.runtime import parent_watch, storage, tool_main
from scone_jax.runtime.errors import one_line

FLAGS = flags.FLAGS
flags.DEFINE_string("input", "", "Comma-separated globs of the corpus files.")
flags.DEFINE_string("format", "text", "text (one document per line or per file), jsonl, or chat (JSONL "
                    "conversations, rendered with a chat template, with their loss mask).")
flags.DEFINE_enum("document_unit", "line", ["line", "file"], "--format=text: one document per line or per file.")
flags.DEFINE_string("text_field", "text", "--format=jsonl: the field holding each document's text.")
TOKENIZER = tokenizer_flags.define("training must use the same one (and the same --bos/eos/pad_token).")
CHAT = tokenizer_flags.define_chat(loss_on=True)
flags.adopt_module_key_flags(tokenizer_flags)  # listed by --help
flags.DEFINE_string("output", "", "Local directory for the shards (created if missing).")
flags.DEFINE_integer("num_shards", 0, "Shards to write (0: ~256 MB each, at least one per worker).")
flags.DEFINE_integer("workers", -1, "Processes (-1: every core this process may use).")
flags.DEFINE_float("progress_seconds", 5.0, "Seconds between progress lines.")

FORMATS = ("text", "jsonl", "chat")
SHARD_PREFIX = "tokens"
# int32 ids take about as many bytes as the text they came from (~4 characters per token).
TARGET_SHARD_BYTES = 256 << 20
_REPORT_DOCS = 256  # documents between updates of the shared progress counters
_RUN_DIR = ".run"  # each run writes into OUTPUT/.run-<pid>-<host>-<random>, then publishes
_SHARD_NAME = re.compile(rf"{SHARD_PREFIX}-\d{{5,}}-of-(\d{{5,}})\.arrayrecord")


def shard_name(index: int, count: int) -> str:
    return f"{SHARD_PREFIX}-{index:05d}-of-{count:05d}.arrayrecord"


def open_corpus(tok):
    """(document source, input bytes, JSON description of the input) from the flags; conversations are rendered
    for `tok`."""
    if FLAGS.format not in FORMATS:
        raise ValueError(f"--format={FLAGS.format!r} is unknown; use one of {', '.join(FORMATS)}.")
    if not FLAGS.input:
        raise ValueError("--input is empty. Fix: pass comma-separated globs of the corpus files.")
    data = ml_collections.ConfigDict(dict(
        source=FLAGS.format, train_files=FLAGS.input, eval_files="", text_field=FLAGS.text_field,
        document_unit=FLAGS.document_unit, eval_fraction=0.0, **CHAT.fields(TOKENIZER.path.value)))
    source = sources.open_source(data, "train", tokenizer=tok)
    size = sum(os.path.getsize(f) for f in sources.expand_files(FLAGS.input))
    if FLAGS.format == "chat":
        if not isinstance(source, chat_sources.ChatJsonlSource):
            raise ValueError("--format=chat reads JSONL conversations, and --input lists .arrayrecord shards. Fix: "
                             "list the JSONL files.")
        template = source.encoder.template
        unit = {"messages_field": FLAGS.messages_field, "loss_on": FLAGS.loss_on,
                "chat_template": template.origin, "chat_template_fingerprint": template.fingerprint}
    else:
        unit = {"document_unit": FLAGS.document_unit} if FLAGS.format == "text" else {"text_field": FLAGS.text_field}
    return source, size, {"input": FLAGS.input, "format": FLAGS.format, **unit}


def prepare_output(directory: str, num_shards: int) -> str:
    """Creates the directory, checks it is writable, refuses other runs' shards and a live run writing there,
    removes the directories of killed runs; returns this run's own directory inside it."""
    if not directory:
        raise ValueError("--output is empty. Fix: pass a local directory for the shards.")
    if storage.is_remote(directory):
        raise ValueError(f"--output={directory!r} is remote; shards are written locally. Fix: write to a "
                         "local directory, then copy it (gsutil -m cp -r).")
    try:
        tool_main.probe_directory(directory)
    except OSError as e:
        raise OSError(f"--output={directory!r} is not writable ({e.strerror}). Fix: choose a directory you "
                      "can write to.") from None
    others = sorted(name for name in os.listdir(directory)
                    if (m := _SHARD_NAME.fullmatch(name)) and int(m.group(1)) != num_shards)
    if others:
        raise ValueError(f"--output={directory!r} holds shards of another run ({others[0]}, {len(others)} in all) "
                         f"that a glob would mix with these {num_shards}. Fix: delete them or choose another --output.")
    parent_watch.remove_stale_scratch(directory, _RUN_DIR)  # killed runs' shards: never published
    live = sorted(glob.glob(os.path.join(glob.escape(directory), f"{_RUN_DIR}-*-*")))
    if live:
        pid, host = parent_watch.scratch_owner(live[0], _RUN_DIR) or ("?", "")
        where = f"process {pid} on {host}" if host else f"process {pid}"
        raise ValueError(f"Another pretokenize ({where}) is writing into --output={directory!r} ({live[0]}). "
                         "Fix: wait for it to finish, or stop it, then rerun.")
    return tempfile.mkdtemp(dir=directory, prefix=parent_watch.scratch_name(_RUN_DIR))


def plan_shards(num_docs: int, input_bytes: int, workers: int) -> int:
    if FLAGS.num_shards < 0 or FLAGS.num_shards > num_docs:
        raise ValueError(f"--num_shards={FLAGS.num_shards} is not in [0, {num_docs}] (the corpus has {num_docs} "
                         "documents). Fix: use 0 (automatic) or fewer shards.")
    if FLAGS.num_shards:
        return FLAGS.num_shards
    return min(num_docs, max(workers, math.ceil(input_bytes / TARGET_SHARD_BYTES)))


class Counters:
    """Documents and tokens done, shared by all worker processes."""

    def __init__(self, context):
        self.docs, self.tokens = context.Value("q", 0), context.Value("q", 0)

    def add(self, docs: int, tokens: int) -> None:
        with self.docs.get_lock():
            self.docs.value += docs
        with self.tokens.get_lock():
            self.tokens.value += tokens


class ProgressPrinter(threading.Thread):
    """Prints documents, tokens, tokens/s and ETA to stderr every `every` seconds until stopped."""

    def __init__(self, counters: Counters, total_docs: int, every: float):
        super().__init__(daemon=True)
        self.counters, self.total, self.every = counters, total_docs, every
        self.start_time, self.stopped = time.time(), threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            self.print_line()

    def print_line(self) -> None:
        docs, tokens = self.counters.docs.value, self.counters.tokens.value
        elapsed = max(time.time() - self.start_time, 1e-9)
        eta = f"{(self.total - docs) * elapsed / docs:.0f} s" if docs else "unknown"
        print(f"pretokenize: {docs:,}/{self.total:,} documents ({100 * docs / self.total:.1f}%), "
              f"{tokens / 1e6:.2f}M tokens, {tokens / elapsed / 1e6:.2f}M tokens/s, ETA {eta}",
              file=sys.stderr, flush=True)

    def finish(self) -> None:
        self.stopped.set()
        self.join()
        self.print_line()


_state = None


def _init_worker(source, tok, counters) -> None:
    global _state
    _state = (source, tok, counters)


def _write_shard(task) -> tuple[int, int]:
    """Runs in a worker: tokenizes documents start..stop-1 one by one into one shard."""
    path, start, stop, meta = task
    source, tok, counters = _state

    chat = isinstance(source, chat_sources.ChatJsonlSource)
    items = (source.example(i) for i in range(start, stop)) if chat else tokenize.iter_encoded(source, tok, start, stop)

    def documents():
        docs = tokens = 0
        for item in items:
            yield item
            docs, tokens = docs + 1, tokens + len(item[0] if chat else item)
            if docs == _REPORT_DOCS:
                counters.add(docs, tokens)
                docs = tokens = 0
        counters.add(docs, tokens)

    try:
        return shards.write_shard(path, documents(), meta, shards.CHAT_FORMAT if chat else shards.FORMAT)
    except (OSError, RuntimeError) as e:  # a full disk (ENOSPC, EFBIG) reaches us from array_record as either
        raise OSError(f"Writing shard {os.path.basename(path)} into {os.path.dirname(os.path.dirname(path))} failed: "
                      f"{one_line(e)}. Fix: free space there (or choose another --output) and rerun.") from None


def run() -> None:
    start = time.time()
    tok = TOKENIZER.load()
    source, input_bytes, description = open_corpus(tok)
    workers = tokenize.resolve_workers(FLAGS.workers, "--workers")
    if FLAGS.progress_seconds <= 0:
        raise ValueError(f"--progress_seconds={FLAGS.progress_seconds} must be positive.")
    num_docs = len(source)
    num_shards = plan_shards(num_docs, input_bytes, workers)
    run_dir = prepare_output(FLAGS.output, num_shards)
    meta = {"tokenizer_fingerprint": tok.fingerprint, "tokenizer_vocab_size": tok.vocab_size, "source": description}
    if FLAGS.format == "chat":  # what a run checks: the mask it trains on
        meta["loss_on"] = FLAGS.loss_on
    bounds = [num_docs * i // num_shards for i in range(num_shards + 1)]
    tasks = [(os.path.join(run_dir, shard_name(i, num_shards)), bounds[i], bounds[i + 1],
              {**meta, "first_document": bounds[i]}) for i in range(num_shards)]
    processes = min(workers, num_shards)
    print(f"pretokenize: {num_docs:,} documents ({input_bytes / 1e6:.1f} MB) -> {num_shards} shard(s) in "
          f"{FLAGS.output} with {processes} process(es); tokenizer {tok.fingerprint} ({tok.kind}, {tok.vocab_size} "
          f"tokens, bos {tok.bos_id}, eos {tok.eos_id}, pad {tok.pad_id})", file=sys.stderr, flush=True)

    context = multiprocessing.get_context("spawn")
    counters = Counters(context)
    printer = ProgressPrinter(counters, num_docs, FLAGS.progress_seconds)
    printer.start()
    try:
        if processes == 1:
            _init_worker(source, tok, counters)
            results = [_write_shard(task) for task in tasks]
        else:
            results = list(tokenize.run_pool(_write_shard, tasks, processes, _init_worker, (source, tok, counters)))
        for i in range(num_shards):
            shards.publish_shard(os.path.join(run_dir, shard_name(i, num_shards)), FLAGS.output)
    finally:
        printer.finish()
        shutil.rmtree(run_dir, ignore_errors=True)
    tokens = sum(t for _, t in results)
    seconds = time.time() - printer.start_time
    print(f"wrote {num_shards} shard(s): {num_docs:,} documents, {tokens:,} tokens "
          f"({tokens / num_docs:.1f} per document) to {FLAGS.output} in {seconds:.1f} s "
          f"({time.time() - start:.1f} s in all) with {processes} process(es)")
    print(f"RESULT pretokenize_tokens_per_s {tokens / seconds:.0f}")


if __name__ == "__main__":
    tool_main.run(run)
