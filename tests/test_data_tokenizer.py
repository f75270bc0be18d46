"""Tests for the SentencePiece wrapper: lossless round trips, fingerprints, and the workdir default."""
import json
import os
import pickle
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from scone_jax.data import corpus, sources, tokenizer, tokenizer_training
from scone_jax.training import assets


def _data_cfg(**overrides):
    cfg = dict(source="kjv", train_files="", eval_files="", text_field="text", document_unit="line",
               eval_fraction=0.02, tokenizer_path="", vocab_size=400, character_coverage=0.9995)
    cfg.update(overrides)
    return ml_collections.ConfigDict(cfg)


def test_special_ids_and_sizes(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 2, 3, 500)
    ids = tok.encode("In the beginning")
    assert ids.dtype == np.int32 and 0 < len(ids) < 16
    assert ids.min() > 3 and ids.max() < 500


def test_exact_round_trip_on_real_and_awkward_text(tok):
    held_out = corpus.kjv_documents("eval", 0.02)
    double_space = next(d for d in corpus.kjv_documents("train", 0.02) if "  " in d)
    texts = list(held_out[:10]) + [
        double_space,
        held_out[0] + "\n" + held_out[1],  # a newline inside a document
        "  leading and trailing  \t",
        "Æsop’s naïve café — 中文 ✓",  # characters never seen in training: byte fallback
        "",
    ]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_fingerprint_stable_across_loads_and_pickles(tok, tmp_path):
    path = tmp_path / "copy.model"
    other = tokenizer_training.train_tokenizer(corpus.kjv_documents("train", 0.02)[:300], str(path), vocab_size=400)
    assert len(tok.fingerprint) == 16
    assert other.fingerprint != tok.fingerprint
    assert tokenizer.Tokenizer.load(str(path)).fingerprint == other.fingerprint
    clone = pickle.loads(pickle.dumps(tok))
    assert (clone.fingerprint, clone.path) == (tok.fingerprint, tok.path)
    text = corpus.kjv_documents("eval", 0.02)[3]
    np.testing.assert_array_equal(clone.encode(text), tok.encode(text))


def test_training_writes_only_the_model_file(tmp_path):
    tokenizer_training.train_tokenizer(corpus.kjv_documents("train", 0.02)[:100], str(tmp_path / "t.model"), 400)
    assert os.listdir(tmp_path) == ["t.model"]


def test_vocab_too_small_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=200 is too small"):
        tokenizer_training.train_tokenizer(["some text"], str(tmp_path / "t.model"), 200)


def test_ensure_tokenizer_trains_once_then_reuses(tmp_path):
    cfg = _data_cfg()
    first = assets.ensure_tokenizer(cfg, str(tmp_path), max_chars=150_000)
    path = tmp_path / "tokenizer.model"
    assert first.path == str(path)
    mtime = path.stat().st_mtime_ns
    assert first.vocab_size == 400
    second = assets.ensure_tokenizer(cfg, str(tmp_path), max_chars=150_000)
    assert second.fingerprint == first.fingerprint
    assert path.stat().st_mtime_ns == mtime
    # An explicit tokenizer_path wins over the workdir.
    cfg.tokenizer_path = str(path)
    assert assets.ensure_tokenizer(cfg, str(tmp_path / "elsewhere")).fingerprint == first.fingerprint


def test_sample_documents_caps_characters():
    docs = tokenizer_training.sample_documents(corpus.kjv_documents("train", 0.02), max_chars=10_000)
    assert sum(map(len, docs)) == 10_000
    assert docs == tokenizer_training.sample_documents(corpus.kjv_documents("train", 0.02), max_chars=10_000)


def test_missing_tokenizer_path_is_a_clear_error(tmp_path):
    cfg = _data_cfg(tokenizer_path=str(tmp_path / "nope.model"))
    with pytest.raises(FileNotFoundError, match="nope.model.*does not exist"):
        assets.ensure_tokenizer(cfg, str(tmp_path))


def test_pre_tokenized_corpus_cannot_train_a_tokenizer(tmp_path):
    sources.write_token_arrayrecord(str(tmp_path / "d.arrayrecord"), [[5, 6, 7]])
    cfg = _data_cfg(source="arrayrecord", train_files=str(tmp_path / "*.arrayrecord"))
    with pytest.raises(ValueError, match="pre-tokenized.*data.tokenizer_path"):
        assets.ensure_tokenizer(cfg, str(tmp_path))


def test_command_line_tool_trains_and_checks_round_trip(tmp_path):
    (tmp_path / "docs.jsonl").write_text(
        "\n".join(json.dumps({"body": d}) for d in corpus.kjv_documents("train", 0.02)[:200]))
    tool = [sys.executable, os.path.join(os.path.dirname(__file__), "..", "tools", "train_tokenizer.py")]
    output = tmp_path / "out" / "t.model"
    done = subprocess.run(tool + [f"--input={tmp_path}/*.jsonl", "--format=jsonl", "--text_field=body",
                                  f"--output={output}", "--vocab_size=400"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "sampled 200 of 200 documents" in done.stdout
    assert "round trip exact on 200/200 documents" in done.stdout
    assert tokenizer.Tokenizer.load(str(output)).fingerprint in done.stdout
    failed = subprocess.run(tool + [f"--input={tmp_path}/*.txt", f"--output={output}"], capture_output=True, text=True)
    assert failed.returncode == 2 and "error: No files match the pattern" in failed.stderr


def test_a_model_without_pad_or_eos_pieces(tmp_path):
    """Llama-style models have no pad piece: pad falls back to eos (it only fills masked positions), and the
    changed ids make it the wrapped serialized form; with no eos either, the error names data.eos_token."""
    import io

    import sentencepiece as spm

    def train(**ids):
        writer = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus.kjv_documents("train", 0.02)[:200]),
                                       model_writer=writer, vocab_size=400, minloglevel=2, **ids)
        return writer.getvalue()

    no_pad = tokenizer.Tokenizer(train(pad_id=-1, unk_id=0, bos_id=1, eos_id=2))
    assert no_pad.special_ids == {"bos": 1, "eos": 2, "pad": 2} and no_pad.proto.startswith(b"scone-tokenizer\n")
    with pytest.raises(ValueError, match=r"declares no end-of-document token .*Fix: set data.eos_token to a token of "
                                         r"its vocabulary \(or train one with tools/train_tokenizer.py\)\.$"):
        tokenizer.Tokenizer(train(pad_id=-1, unk_id=0, bos_id=1, eos_id=-1))
