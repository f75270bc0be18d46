"""F-gram extraction as an Apache Beam pipeline, for corpora beyond one machine (optional extra).

The same rule-1 scans as extract.py, written the plain Beam way: scan n emits,
per document, the n-grams whose (n-1)-prefix and (n-1)-suffix are in scan n-1's
frequent set (a side input), sums them per n-gram, and keeps counts >= min_count.
A distributed Top with the deterministic rank as its key keeps the best S over
all lengths, and vocab.build_vocab orders them, so the result (and its
fingerprint) is identical to extract_fgrams on the same input. Runs locally on the
DirectRunner and on any runner (`pipeline_args`, e.g. ['--runner=DataflowRunner', ...]).
"""
from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np

from scone_jax.fgram.extract import check_document, check_extract_args
from scone_jax.fgram.vocab import FgramVocab, build_vocab, load_vocab, save_vocab


def _beam():
    try:
        import apache_beam  # noqa: PLC0415 (optional dependency, imported on use)
    except ImportError as e:
        raise ImportError("The Beam engine needs Apache Beam: pip install scone_jax[beam]") from e
    return apache_beam


def _ngram_counts(doc: np.ndarray, n: int, frequent=None) -> Iterable[tuple[tuple[int, ...], int]]:
    """This document's n-grams (as tuples) with counts, keeping those whose two (n-1)-grams are frequent."""
    doc = doc.tolist()
    grams = (tuple(doc[i : i + n]) for i in range(len(doc) - n + 1))
    if frequent is not None:
        grams = (g for g in grams if g[:-1] in frequent and g[1:] in frequent)
    return collections.Counter(grams).items()


def _rank_key(gram_count: tuple[tuple[int, ...], int]):
    """Larger is better: count desc, then shorter first, then token ids ascending (docs/method.md §1)."""
    gram, count = gram_count
    return count, -len(gram), tuple(-t for t in gram)


def _to_vocab(best, tokens_counted: int, *, max_len, num_fgrams, min_count, vocab_size, tokenizer_fingerprint):
    if tokens_counted == 0:
        raise ValueError("The corpus is empty: 0 tokens in all. Fix: point at real data.")
    if not best:
        raise ValueError(f"No 2-gram occurs min_count={min_count} times in the {tokens_counted} tokens counted. "
                         "Fix: lower min_count or give more text.")
    by_length = collections.defaultdict(list)
    for gram, count in best:
        by_length[len(gram)].append((gram, count))
    grams = [(np.array([g for g, _ in items], np.int32), np.array([c for _, c in items], np.int64))
             for _, items in sorted(by_length.items())]
    return build_vocab(grams, num_fgrams=num_fgrams, max_len=max_len, min_count=min_count,
                       tokens_counted=tokens_counted, vocab_size=vocab_size,
                       tokenizer_fingerprint=tokenizer_fingerprint)


def add_extraction(documents, *, max_len: int = 5, num_fgrams: int, min_count: int = 5, vocab_size: int,
                   tokenizer_fingerprint: str = ""):
    """Appends the extraction to a PCollection of int token arrays; returns a PCollection of one FgramVocab."""
    beam = _beam()
    check_extract_args(max_len, num_fgrams, min_count, vocab_size)
    docs = documents | "CheckDocuments" >> beam.Map(lambda doc: check_document(None, doc, vocab_size))
    tokens_counted = docs | "Length" >> beam.Map(len) | "TokensCounted" >> beam.CombineGlobally(sum)
    levels, frequent = [], None
    for n in range(2, max_len + 1):
        side = {} if frequent is None else {"frequent": beam.pvalue.AsDict(frequent)}
        counts = (
            docs
            | f"Emit{n}" >> beam.FlatMap(_ngram_counts, n, **side)
            | f"Sum{n}" >> beam.CombinePerKey(sum)
            | f"MinCount{n}" >> beam.Filter(lambda gram_count: gram_count[1] >= min_count)
        )
        levels.append(counts)
        frequent = counts
    return (
        levels
        | "AllLengths" >> beam.Flatten()
        | "TopS" >> beam.combiners.Top.Of(num_fgrams, key=_rank_key)
        | "Vocab" >> beam.Map(
            _to_vocab, beam.pvalue.AsSingleton(tokens_counted), max_len=max_len, num_fgrams=num_fgrams,
            min_count=min_count, vocab_size=vocab_size, tokenizer_fingerprint=tokenizer_fingerprint)
    )


def extract_fgrams_beam(documents: Iterable[np.ndarray], *, output: str, pipeline_args: list[str] | None = None,
                        **extraction) -> FgramVocab:
    """Runs the pipeline over in-memory `documents`, writes the vocabulary to `output`, and returns it.

    For corpora that do not fit in memory, build the pipeline yourself: read the
    documents into a PCollection and call `add_extraction` on it.
    """
    beam = _beam()
    options = beam.options.pipeline_options.PipelineOptions(pipeline_args or [])
    with beam.Pipeline(options=options) as pipeline:
        docs = pipeline | "Documents" >> beam.Create([np.asarray(d) for d in documents])
        vocab = add_extraction(docs, **extraction)
        _ = vocab | "Write" >> beam.Map(save_vocab, output)
    return load_vocab(output)
