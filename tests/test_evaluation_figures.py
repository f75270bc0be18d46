"""The evaluation's own figures, against what is worked out here by hand, not through training/evaluation.py (which
training and serving both run, so comparing the two proves nothing about it): the tokens from the tokenizer and
the documents' rule ([bos] + ids + [eos]: one target per id and one for eos), the hit rate from the batches'
tokens and the vocabulary's f-grams with plain Python sets (docs/method.md §2: an f-gram ending at the position,
inside its document), the bytes from the text file, and tokens/s from a step of known duration."""
import math
import os
import time

import pytest

from scone_jax.data import pipeline
from scone_jax.fgram.vocab import load_vocab
from scone_jax.serving import evaluate, inference
from tests import serving_run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return inference.load(serving_run.exported(tmp_path_factory, "float32"))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """The export's f-gram vocabulary, read from its files (not the served Matcher's)."""
    return load_vocab(os.path.join(serving_run.exported(tmp_path_factory, "float32"), "fgrams"))


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    path = serving_run.eval_text(tmp_path_factory)
    with open(path, encoding="utf-8") as f:
        return path, f.read().splitlines()


@pytest.fixture(scope="module")
def data(served, docs):
    return evaluate.data_config(served, {"data.source": "text", "data.eval_files": docs[0]}).data


def matched_positions(batches, vocab) -> tuple[int, int]:
    """(positions with an f-gram ending there inside their document, positions of documents) over `batches`."""
    fgrams = {tuple(vocab.tokens[j, :vocab.lengths[j]].tolist()) for j in range(vocab.num_fgrams)}
    hits = real = 0
    for batch in batches:
        for tokens, segments in zip(batch.inputs.tolist(), batch.segment_ids.tolist()):
            for i, segment in enumerate(segments):
                if segment == 0:
                    continue
                real += 1
                start = i
                while start > 0 and segments[start - 1] == segment:
                    start -= 1
                hits += any(tuple(tokens[i - n + 1:i + 1]) in fgrams for n in range(2, vocab.max_len + 1)
                            if i - n + 1 >= start)
    return hits, real


def test_tokens_hit_rate_and_bits_per_byte_equal_the_figures_worked_out_by_hand(served, vocab, docs, data):
    """Caught: the hit rate over every position of the batch (padding counted); the held-out bytes counted as
    tokens instead of the text's UTF-8 bytes."""
    path, lines = docs
    result = evaluate.evaluate(served, data)
    tokenizer = served.tokenizer
    assert result["tokens"] == sum(len(tokenizer.encode(line)) + 1 for line in lines)
    hits, real = matched_positions(pipeline.make_eval_batches(data, tokenizer), vocab)
    assert 0.3 < hits / real < 1 and result["hit_rate"] == hits / real
    text_bytes = sum(len(line.encode("utf-8")) for line in lines)
    assert result["bytes"] == text_bytes
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * result["tokens"] / math.log(2) / text_bytes,
                                                    rel=1e-12)


def test_bits_per_byte_under_a_batch_limit_only_when_every_document_is_read(served, vocab, docs, data):
    """--max_batches below the batch count reads part of the text: bits per byte would divide part of the loss by
    all of the bytes, so there is none, and the tokens and hit rate are those of the batches read. A limit of the
    batch count or more reads everything: bits per byte as without a limit. Caught: bits per byte given under a
    limit that leaves batches out (all the bytes under part of the loss); dropped under a limit that reads every
    batch (`<=` for `<`)."""
    batches = pipeline.make_eval_batches(data, served.tokenizer)
    count = len(batches)
    full = evaluate.evaluate(served, data)
    part = evaluate.evaluate(served, data, max_batches=3)
    assert part["bits_per_byte"] is None and part["bytes"] == 0 and part["batches"] == 3
    first = [b for _, b in zip(range(3), batches)]
    assert part["tokens"] == int(sum(b.loss_mask.sum() for b in first))
    hits, real = matched_positions(first, vocab)
    assert part["hit_rate"] == hits / real
    for limit in (count, count + 5):
        limited = evaluate.evaluate(served, data, max_batches=limit)
        assert limited["bytes"] == full["bytes"] > 0 and limited["tokens"] == full["tokens"]
        assert limited["bits_per_byte"] == full["bits_per_byte"]


def test_tokens_per_s_counts_the_batches_after_the_first_over_their_time(served, data, monkeypatch):
    """Each step made to take a known time (the first 1.5 s, as a compile would; the others 0.4 s): tokens/s is the
    tokens of batches 2..n over their time, so at most that over 0.4 s a step, and within the machine's overhead
    of it. One batch gives none. Caught: the first batch's tokens counted (about 1.5x the bound); the clock started
    before the first batch (its 1.5 s inside: about 0.35x)."""
    make = inference.make_eval_step

    def slow_steps(served_):
        step, calls = make(served_), [0]

        def timed(batch):
            calls[0] += 1
            time.sleep(1.5 if calls[0] == 1 else 0.4)
            return step(batch)

        return timed

    monkeypatch.setattr(inference, "make_eval_step", slow_steps)
    result = evaluate.evaluate(served, data, max_batches=3)
    first = [b for _, b in zip(range(3), pipeline.make_eval_batches(data, served.tokenizer))]
    later = float(sum(b.loss_mask.sum() for b in first[1:]))
    bound = later / (2 * 0.4)
    assert 0.6 * bound < result["tokens_per_s"] <= bound, (result["tokens_per_s"], bound)
    assert evaluate.evaluate(served, data, max_batches=1)["tokens_per_s"] is None
