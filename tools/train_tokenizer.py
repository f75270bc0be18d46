"""Train a lossless SentencePiece tokenizer offline, then point data.tokenizer_path at it.

  python tools/train_tokenizer.py --input='corpus/*.txt' --output=/tmp/tok.model --vocab_size=8000
  python tools/train_tokenizer.py --format=jsonl --text_field=text --input='a/*.jsonl,b/*.jsonl' \
      --output=/tmp/tok.model
  python tools/train_tokenizer.py --format=kjv --output=/tmp/kjv.model   # the embedded corpus

Prints the documents and characters sampled, the training time and the fingerprint,
then checks decode(encode(doc)) == doc on a sample of the training documents.
"""
import time

import ml_collections
from absl import flags

from scone_jax.data import sources, tokenizer_training
from scone_jax.runtime import tool_main

FLAGS = flags.FLAGS
flags.DEFINE_string("input", "", "Comma-separated globs of training files (empty for --format=kjv).")
flags.DEFINE_string("output", None, "Path of the .model file to write.", required=True)
flags.DEFINE_enum("format", "text", ["text", "jsonl", "kjv"], "How to read --input.")
flags.DEFINE_string("text_field", "text", "JSONL field holding the text (--format=jsonl).")
flags.DEFINE_enum("document_unit", "line", ["line", "file"], "Text files: one document per line or per file.")
flags.DEFINE_integer("vocab_size", 8000, "Vocabulary size, including 4 special ids and 256 byte pieces.")
flags.DEFINE_enum("model_type", "unigram", ["unigram", "bpe"], "SentencePiece model type.")
flags.DEFINE_float("character_coverage", 0.9995, "Share of the text's characters that get pieces of their own; the "
                   "rest are spelled in bytes (lower it for small vocabularies over many scripts, e.g. 0.99).")
flags.DEFINE_integer("max_chars", tokenizer_training.DEFAULT_MAX_CHARS, "Train on a random sample of this many characters.")

_CHECK_DOCS = 200


def train():
    data_cfg = ml_collections.ConfigDict(dict(
        source=FLAGS.format, train_files=FLAGS.input, eval_files="", text_field=FLAGS.text_field,
        document_unit=FLAGS.document_unit, eval_fraction=0.0,
    ))
    start = time.time()
    source = sources.open_source(data_cfg, "train")
    docs = tokenizer_training.sample_documents(source, FLAGS.max_chars)
    print(f"sampled {len(docs):,} of {len(source):,} documents, {sum(map(len, docs)):,} characters "
          f"({time.time() - start:.1f} s)")

    start = time.time()
    tok = tokenizer_training.train_tokenizer(docs, FLAGS.output, FLAGS.vocab_size, FLAGS.model_type,
                                             character_coverage=FLAGS.character_coverage)
    print(f"trained {FLAGS.model_type} vocab {tok.vocab_size:,} in {time.time() - start:.1f} s -> "
          f"{FLAGS.output} (fingerprint {tok.fingerprint})")

    sample = docs[:_CHECK_DOCS]
    encoded = [tok.encode(doc) for doc in sample]
    broken = [doc for doc, ids in zip(sample, encoded) if tok.decode(ids) != doc]
    chars_per_token = sum(map(len, sample)) / max(1, sum(map(len, encoded)))
    print(f"round trip exact on {len(sample) - len(broken)}/{len(sample)} documents; "
          f"{chars_per_token:.2f} characters per token")
    if broken:
        raise SystemExit(f"Round trip changed {len(broken)} documents, e.g. {broken[0][:80]!r}.")


if __name__ == "__main__":
    tool_main.run(train)
