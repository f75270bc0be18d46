"""Hugging Face tokenizer.json tokenizers beside SentencePiece (scone_jax/data/tokenizer.py): kind detection,
lossless round trips, the special-id policy and its override, fingerprints, pickling, batch encoding in
worker processes, vocabulary sizes, pre-tokenized shards, and a SCONE run trained, exported and served
with a tokenizer.json.

Deliberate bugs these tests were run against once (each made the named test fail):
  - the fingerprint hashing only the file, not the resolved ids
    (test_fingerprint_changes_with_the_file_and_with_the_policy_not_with_the_path);
  - the export's run (then export.Run) loading the tokenizer without the run's data.*_token overrides
    (test_scone_run_with_a_tokenizer_json_trains_exports_and_serves_with_the_runs_ids: the export refused
    the run's own f-gram vocabulary, whose fingerprint has the overridden ids);
  - encode leaving the library's default of matching special tokens inside text
    (test_round_trip_is_exact_and_special_spellings_in_text_stay_text).
"""
import hashlib
import json
import math
import os
import pickle
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

from scone_jax.data import corpus, eval_sets, sources, tokenize
from scone_jax.data.tokenizer import Tokenizer, in_worker_process
from scone_jax.serving import evaluate, export, generate, inference
from scone_jax.training import assets, train
from tests.common import REPO, small_config

TRAIN_DOCS = 2000  # KJV verses the test tokenizers learn from (~0.6 s each)

AWKWARD_TEXTS = [
    "",
    "  leading and trailing  \t",
    "tabs\tand\r\nCRLF\nand blank\n\nlines",
    "Æsop’s naïve café — 中文 ✓ 🙂 Ωμέγα",  # never seen in training: byte-level pieces
    "double  spaces   and\u00a0no-break\u2009thin",
    "a literal <|endoftext|> and <s> </s> <pad> inside a document",
]


def train_byte_level_bpe(path, vocab_size: int, special_tokens: list[str]) -> str:
    """A GPT-2-style byte-level BPE tokenizer.json (lossless: every byte has a piece)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.kjv_documents("train", 0.02)[:TRAIN_DOCS], trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def gpt2_json(tmp_path_factory):
    """Like GPT-2's: one special token, <|endoftext|> (here id 0); 500 tokens fit the small model's 512."""
    return train_byte_level_bpe(tmp_path_factory.mktemp("gpt2") / "tokenizer.json", 500, ["<|endoftext|>"])


@pytest.fixture(scope="module")
def llama_json(tmp_path_factory):
    """Three named special tokens: <pad> 0, <s> 1, </s> 2."""
    return train_byte_level_bpe(tmp_path_factory.mktemp("llama") / "tokenizer.json", 480, ["<pad>", "<s>", "</s>"])


@pytest.fixture(scope="module")
def sp_path(tokenizer_path):
    return tokenizer_path  # the session's 512-piece SentencePiece model (tests/conftest.py)


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text and "Fix:" in text, text
    return text


def test_kind_is_read_from_the_content_not_the_name(gpt2_json, sp_path, tmp_path):
    misnamed_json, misnamed_model = tmp_path / "tok.model", tmp_path / "tokenizer.json"
    misnamed_json.write_bytes(open(gpt2_json, "rb").read())
    misnamed_model.write_bytes(open(sp_path, "rb").read())
    hf, sp = Tokenizer.load(str(misnamed_json)), Tokenizer.load(str(misnamed_model))
    assert (hf.kind, hf.vocab_size, hf.path) == ("huggingface", 500, str(misnamed_json))
    assert (sp.kind, sp.vocab_size) == ("sentencepiece", 512)
    # A SentencePiece model with its own ids is stored as is, and its fingerprint is what it always was, so
    # checkpoints, f-gram vocabularies and bundles made before tokenizer.json support still pair with it.
    assert sp.proto == open(sp_path, "rb").read()
    assert sp.fingerprint == hashlib.sha256(open(sp_path, "rb").read()).hexdigest()[:16]
    assert hf.proto.startswith(b"scone-tokenizer\n") and hf.proto.endswith(open(gpt2_json, "rb").read())
    for tok in (hf, sp):  # the serialized form reads back as the same tokenizer (what bundles store)
        again = Tokenizer.from_bytes(tok.proto)
        assert (again.kind, again.fingerprint, again.special_ids) == (tok.kind, tok.fingerprint, tok.special_ids)
    saved = tmp_path / "saved.tok"
    hf.save(str(saved))
    assert Tokenizer.load(str(saved)).fingerprint == hf.fingerprint


@pytest.mark.parametrize("content, message", [
    (b"", "is empty: not a tokenizer"),
    (b"\x00\x01garbage that is no proto", "is neither a SentencePiece model nor a Hugging Face tokenizer.json"),
    (b'{"bos_token": "<s>", "model_max_length": 2048}', "is JSON but not a Hugging Face tokenizer.json"),
    (b'{"model": {"type": "BPE"', "starts like JSON but is not valid JSON"),
    (b'{"model": {"type": "NoSuchModel"}}', "is a tokenizer.json that tokenizers"),
    (b'scone-tokenizer\n{"kind": "huggingface"}\n{}', "its header is damaged"),
])
def test_a_file_of_neither_kind_is_a_one_line_error(content, message, tmp_path):
    path = tmp_path / "bad"
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        Tokenizer.load(str(path))
    assert message in one_line(error) and str(path) in str(error.value)


def test_round_trip_is_exact_and_special_spellings_in_text_stay_text(gpt2_json, llama_json):
    held_out = list(corpus.kjv_documents("eval", 0.02)[:20])
    for path in (gpt2_json, llama_json):
        tok = Tokenizer.load(path)
        for text in held_out + AWKWARD_TEXTS:
            ids = tok.encode(text)
            assert ids.dtype == np.int32 and tok.decode(ids) == text
            assert not set(ids.tolist()) & set(tok.special_ids.values())  # no document boundary from text
        assert tok.decode(tok.encode_batch(AWKWARD_TEXTS)[-1]) == AWKWARD_TEXTS[-1]


def test_default_ids_come_from_the_file(gpt2_json, llama_json, tmp_path):
    gpt2 = Tokenizer.load(gpt2_json)
    assert gpt2.special_ids == {"bos": 0, "eos": 0, "pad": 0}  # a lone special token is bos, eos and pad
    assert Tokenizer.load(llama_json).special_ids == {"bos": 1, "eos": 2, "pad": 0}  # by name
    # Declared roles win over names: a post-processor template and the file's padding.
    tok = HFTokenizer.from_file(gpt2_json)
    tok.add_special_tokens([AddedToken("[START]", special=True), AddedToken("[STOP]", special=True),
                            AddedToken("[FILL]", special=True)])
    ids = {t: tok.token_to_id(t) for t in ("[START]", "[STOP]", "[FILL]")}
    tok.post_processor = processors.TemplateProcessing(single="[START] $A [STOP]", special_tokens=list(ids.items()))
    tok.enable_padding(pad_id=ids["[FILL]"], pad_token="[FILL]")
    tok.save(str(tmp_path / "declared.json"))
    declared = Tokenizer.load(str(tmp_path / "declared.json"))
    assert declared.special_ids == {"bos": ids["[START]"], "eos": ids["[STOP]"], "pad": ids["[FILL]"]}
    assert declared.vocab_size == 503  # added tokens count
    assert declared.encode("In the").tolist() == gpt2.encode("In the").tolist()  # no template, no padding added
    # Several special tokens and none named or declared: no guess, the error names the keys to set.
    tok = HFTokenizer.from_file(gpt2_json)
    tok.add_special_tokens([AddedToken("[X]", special=True)])
    tok.save(str(tmp_path / "ambiguous.json"))
    raw = json.loads(open(tmp_path / "ambiguous.json").read())
    for added in raw["added_tokens"]:
        added["content"] = {"<|endoftext|>": "[Y]"}.get(added["content"], added["content"])
    raw["model"]["vocab"]["[Y]"] = raw["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "ambiguous.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as error:
        Tokenizer.load(str(tmp_path / "ambiguous.json"))
    assert "declares no end-of-document token (its special tokens: '[Y]', '[X]')" in one_line(error)
    assert str(error.value).endswith("Fix: set data.eos_token to a token of its vocabulary.")
    y = raw["model"]["vocab"]["[Y]"]
    assert Tokenizer.load(str(tmp_path / "ambiguous.json"), {"eos": "[Y]"}).special_ids == dict(bos=y, eos=y, pad=y)


def test_override_from_the_config_and_a_token_not_in_the_vocabulary(llama_json, gpt2_json, sp_path, tmp_path):
    data = small_config().data.copy_and_resolve_references()
    data.tokenizer_path, data.bos_token, data.pad_token = llama_json, "</s>", "</s>"
    tok = assets.ensure_tokenizer(data, str(tmp_path))
    assert tok.special_ids == {"bos": 2, "eos": 2, "pad": 2}
    assert Tokenizer.from_bytes(tok.proto).special_ids == tok.special_ids  # no config needed to read it back
    data.tokenizer_path, data.bos_token, data.pad_token = gpt2_json, "", "<pad>"
    with pytest.raises(ValueError) as error:
        assets.ensure_tokenizer(data, str(tmp_path))
    assert one_line(error).startswith(f"data.pad_token='<pad>' is not a token of {gpt2_json} (huggingface, 500 "
                                      "tokens) (its special tokens: '<|endoftext|>'). Fix: name a token")
    # The same keys work for a SentencePiece model; its own ids keep its plain .model form.
    sp = Tokenizer.load(sp_path, {"pad": "</s>"})
    assert (sp.pad_id, sp.eos_id, sp.proto[:16]) == (3, 3, b"scone-tokenizer\n")
    assert Tokenizer.load(sp_path, {"pad": "<pad>", "bos": "<s>"}).proto == open(sp_path, "rb").read()
    with pytest.raises(ValueError, match=r"^--eos_token='<\|endoftext\|>' is not a token of "):
        Tokenizer.load(sp_path, {"eos": "<|endoftext|>"}, key="--{}_token")


def test_fingerprint_changes_with_the_file_and_with_the_policy_not_with_the_path(gpt2_json, llama_json, tmp_path):
    """Catches a fingerprint of the file alone: two policies would pair with each other's f-gram
    vocabularies, shards and checkpoints, whose [bos] + ids streams differ."""
    gpt2, llama = Tokenizer.load(gpt2_json), Tokenizer.load(llama_json)
    assert len(gpt2.fingerprint) == 16 and gpt2.fingerprint != llama.fingerprint
    separator = Tokenizer.load(llama_json, {"bos": "</s>"})
    assert separator.bos_id != llama.bos_id and separator.fingerprint != llama.fingerprint
    assert Tokenizer.load(llama_json, {"bos": "<s>", "pad": "<pad>"}).fingerprint == llama.fingerprint  # same ids
    moved = tmp_path / "elsewhere.json"
    moved.write_bytes(open(gpt2_json, "rb").read())
    assert Tokenizer.load(str(moved)).fingerprint == gpt2.fingerprint
    edited = HFTokenizer.from_file(gpt2_json)
    edited.add_tokens(["Ġzz"])  # one more token, nothing else changed
    edited.save(str(moved))
    assert Tokenizer.load(str(moved)).fingerprint != gpt2.fingerprint


def test_pickles_as_its_bytes_and_keeps_kind_ids_and_encoding(gpt2_json, llama_json):
    separator = Tokenizer.load(llama_json, {"bos": "</s>"})
    for tok in (Tokenizer.load(gpt2_json), separator):
        blob = pickle.dumps(tok)
        assert len(blob) < len(open(tok.path, "rb").read()) + 512  # the file's bytes and a small header
        clone = pickle.loads(blob)
        assert (clone.kind, clone.fingerprint, clone.special_ids, clone.path) == (
            tok.kind, tok.fingerprint, tok.special_ids, tok.path)
        np.testing.assert_array_equal(clone.encode(AWKWARD_TEXTS[3]), tok.encode(AWKWARD_TEXTS[3]))


def _worker_encodes(task):
    """Runs in a spawned tokenize.run_pool worker: what the library is told, and a batch encoded there."""
    source, tok = tokenize._worker_state
    encoded = [ids.tolist() for ids in tok.encode_batch(source[task])]
    return in_worker_process(), os.environ.get("TOKENIZERS_PARALLELISM"), encoded


def test_encode_batch_equals_encode_in_this_process_and_in_workers(gpt2_json, sp_path, monkeypatch, capfd):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    docs = list(corpus.kjv_documents("eval", 0.02)[:40]) + AWKWARD_TEXTS
    hf = Tokenizer.load(gpt2_json)
    for tok in (hf, Tokenizer.load(sp_path)):
        batch = tok.encode_batch(docs)
        assert [b.tolist() for b in batch] == [tok.encode(d).tolist() for d in docs]
        assert all(b.dtype == np.int32 for b in batch) and tok.encode_batch([]) == []
        tokens, lengths = tokenize.encode_documents(docs + [np.array([7, 8], np.int32)], tok, 0, len(docs) + 1)
        assert tokens.tolist() == [i for d in docs for i in tok.encode(d).tolist()] + [7, 8]
        assert lengths.tolist() == [len(tok.encode(d)) for d in docs] + [2]
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # the main process keeps the library's parallel batches
    # Spawned workers (as run_pool, pretokenize and grain start them) encode on one thread each, quietly.
    halves = [slice(0, 23), slice(23, None)]
    results = list(tokenize.run_pool(_worker_encodes, halves, 2, tokenize._init_worker, (docs, hf)))
    assert [r[:2] for r in results] == [(True, "false")] * 2
    assert [ids for r in results for ids in r[2]] == [hf.encode(d).tolist() for d in docs]
    assert "huggingface/tokenizers" not in capfd.readouterr().err


def test_a_vocabulary_larger_than_the_model_is_a_one_line_error(gpt2_json, tmp_path):
    tok = HFTokenizer.from_file(gpt2_json)
    tok.add_tokens(["<|extra_a|>", "<|extra_b|>"])  # added tokens count toward the size
    tok.save(str(tmp_path / "bigger.json"))
    bigger = Tokenizer.load(str(tmp_path / "bigger.json"))
    assert bigger.vocab_size == 502
    config = small_config()
    with config.unlocked():
        config.model.vocab_size = 501
    with pytest.raises(ValueError) as error:
        assets.resolve_vocab_size(config, bigger)
    assert one_line(error).startswith(f"model.vocab_size=501 is smaller than the 502 tokens of the huggingface "
                                      f"tokenizer {tmp_path / 'bigger.json'}. Fix: set model.vocab_size=0")
    with config.unlocked():
        config.model.vocab_size, config.data.tokenizer_size = 0, 50257  # a paper config's pin
    with pytest.raises(ValueError) as error:
        assets.resolve_vocab_size(config, bigger)
    assert "has 502 tokens but data.tokenizer_size=50257: the config was made for another" in one_line(error)
    with config.unlocked():
        config.data.tokenizer_size = 502
    assets.resolve_vocab_size(config, bigger)
    assert config.model.vocab_size == 512


def test_an_explicit_model_vocab_size_is_kept_exactly(tok):
    """A checkpoint's embedding rows are model.vocab_size as set (GPT-2's 50,257, not a multiple of 128; Qwen3's
    151,936), never rounded; 0 rounds the tokenizer's size up to 128. Caught: rounding applied to explicit
    sizes too (50,257 -> 50,304)."""
    config = small_config()
    for rows in (50_257, 151_936):
        with config.unlocked():
            config.model.vocab_size = rows
        assets.resolve_vocab_size(config, tok)
        assert config.model.vocab_size == rows and tok.vocab_size == 500
    with config.unlocked():
        config.model.vocab_size = 0
    assets.resolve_vocab_size(config, tok)
    assert config.model.vocab_size == 512


def test_pretokenize_records_the_fingerprint_and_training_refuses_another_tokenizer(gpt2_json, llama_json,
                                                                                   tmp_path):
    docs = list(corpus.kjv_documents("eval", 0.02)[:30]) + [t for t in AWKWARD_TEXTS[1:] if "\n" not in t]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    out = str(tmp_path / "shards")
    result = subprocess.run([sys.executable, "tools/pretokenize.py", f"--input={tmp_path}/docs.jsonl",
                             "--format=jsonl", f"--tokenizer={gpt2_json}", f"--output={out}", "--workers=2"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    tok = Tokenizer.load(gpt2_json)
    assert f"tokenizer {tok.fingerprint} (huggingface, 500 tokens, bos 0, eos 0, pad 0)" in result.stderr
    assert "huggingface/tokenizers" not in result.stderr
    shards = sorted(f for f in os.listdir(out) if f.endswith(".arrayrecord"))
    metas = [json.load(open(os.path.join(out, s + ".json"))) for s in shards]
    assert len(shards) == 2 and {(m["tokenizer_fingerprint"], m["tokenizer_vocab_size"]) for m in metas} == {
        (tok.fingerprint, 500)}
    data = ml_collections.ConfigDict(dict(source="arrayrecord", train_files=f"{out}/*.arrayrecord",
                                          eval_files=f"{out}/*.arrayrecord", text_field="text",
                                          document_unit="line", eval_fraction=0.0))
    source = sources.open_source(data, "train", tokenizer_fingerprint=tok.fingerprint)
    assert [source[i].tolist() for i in range(len(source))] == [tok.encode(d).tolist() for d in docs]
    # Bits per byte counts the UTF-8 bytes of decoded pre-tokenized documents: exact for a lossless tokenizer.
    assert eval_sets.held_out_bytes(data, tok) == sum(len(d.encode()) for d in docs)
    for other in (Tokenizer.load(llama_json), Tokenizer.load(gpt2_json, {"pad": "Ġthe"})):
        with pytest.raises(ValueError, match=f"was tokenized with tokenizer {tok.fingerprint} but this run uses "
                                             f"{other.fingerprint}. Fix: set data.tokenizer_path"):
            sources.open_source(data, "train", tokenizer_fingerprint=other.fingerprint)


@pytest.mark.slow
def test_scone_run_with_a_tokenizer_json_trains_exports_and_serves_with_the_runs_ids(llama_json, tmp_path):
    """The run overrides bos (</s> opens documents too, GPT-2's convention): the export must load the run's
    tokenizer with that policy, and serving must read the ids from the bundle, not the file's defaults."""
    config = small_config()
    config.data.update(dict(tokenizer_path=llama_json, bos_token="</s>"))
    config.train.update(dict(num_steps=2, checkpoint_every=2, log_every=1))
    config.scone.update(dict(enabled=True, max_len=4, num_fgrams=2000, min_count=3, fgram_capacity=64, num_layers=1,
                             extract_max_tokens=100_000))
    workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
    result = train.run(config, workdir)
    assert result["step"] == 2 and np.isfinite(result["loss"])
    run_tok = Tokenizer.load(llama_json, {"bos": "</s>"})
    export.export(workdir, out, dtype="float32", chunk_rows=64, batch_rows=512)
    served = inference.load(out)
    tok = served.tokenizer
    assert (tok.kind, tok.special_ids, tok.fingerprint) == ("huggingface", {"bos": 2, "eos": 2, "pad": 0},
                                                            run_tok.fingerprint)
    assert served.bundle.meta["tokenizer_fingerprint"] == run_tok.fingerprint != Tokenizer.load(llama_json).fingerprint
    # Bits per byte on a small held-out text file, decoded generation.
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(list(corpus.kjv_documents("eval", 0.02)[:30]) + [AWKWARD_TEXTS[3]]) + "\n")
    data = served.config.data.copy_and_resolve_references()
    data.update(dict(source="text", train_files=str(held_out), eval_files=str(held_out)))
    figures = evaluate.evaluate(served, data)
    assert math.isfinite(figures["bits_per_byte"]) and figures["bits_per_byte"] > 0
    # Evaluation naming the run's tokenizer file again is accepted with the run's policy, refused without it.
    assert evaluate.data_config(served, {"data.tokenizer_path": llama_json, "data.bos_token": "</s>"})
    with pytest.raises(ValueError, match="is not the tokenizer the export was trained with"):
        evaluate.data_config(served, {"data.tokenizer_path": llama_json, "data.bos_token": ""})
    prompt = np.concatenate([[tok.bos_id], tok.encode("In the beginning")]).astype(np.int32)
    new = generate.Generator(served, temperature=0.0).generate(prompt[None], 4)["tokens"][0, len(prompt):]
    assert isinstance(tok.decode(new), str) and tok.decode(prompt[1:]) == "In the beginning"
    # Exporting under another policy than the run's is refused: its fingerprint is not the vocabulary's.
    other = config.copy_and_resolve_references()
    other.data.bos_token = ""
    with pytest.raises(ValueError, match="tokenizer"):
        export.export(workdir, str(tmp_path / "other"), config=other, dtype="float32", chunk_rows=64, batch_rows=512)
