"""A SCONE run (and a baseline whose model.embedding_multiplier no family expresses) exported with --format=hf runs
inside transformers through the remote-code model (scone_jax/hf/remote_code, serving/hf_remote.py): greedy generation
gives scone_jax's tokens, padded batches scoring within 1e-4 of our serving path, the table holds the bundle's rows bit
for bit, the matcher agrees with a plain reading of docs/method.md §2 (across padding and the decoding step), the
harness's Hugging Face backend scores as our adapter does, and damaged files are refused in one line.

Deliberate bugs these tests were run against once (each made the named test fail):
  - FgramMatcher.longest pairing a token with the one before it without checking that one is real (a match
    reaching across left padding): test_the_matcher_follows_the_method;
  - prepare_inputs_for_generation's window one token short (new + K - 2): test_decoding_windows_find_every_match;
  - scone_inputs multiplying the f-gram rows by embedding_multiplier as well: test_padded_batches_score_as_ours[scone]
    and test_greedy_generation_gives_our_tokens[scone];
  - scone_inputs dropping embedding_multiplier: test_padded_batches_score_as_ours[baseline];
  - open_tensor not comparing the file's size with its header: test_a_table_that_disagrees_with_config_is_refused
    [truncated] (numpy's own multi-line mmap error instead) and [appended] (accepted);
  - hf_remote.write_table computing the rows of f-grams r+1 for row r: test_the_export_holds_the_bundles_rows_...;
  - FgramTable.gather returning a large batch's rows in sorted order: test_table_rows_read_back_as_written.
The greedy generation test does not see the short window (its prompts' matches across the step boundary are 2-grams
and 3-grams); the decoding-windows test does.
"""
import ast
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from scone_jax.batch import Batch
from scone_jax.data import corpus
from scone_jax.fgram.vocab import load_vocab
from scone_jax.hf.remote_code import scone_fgrams
from scone_jax.model import scone
from scone_jax.serving import bundle, generate, hf_export, inference, table as table_lib
from tests import hf_scone_runs

TEXTS = ["In the beginning God created the heaven", "And the LORD said unto Moses,", "and the",
         "Let there be light: and there was light."]


# Tests on the two exported runs (about a minute of training and export on 2 cores, then transformers' models):
# the slow tier; the fast tier keeps the checks of the table file and the remote-code choice.
EXPORTED = pytest.mark.slow


@pytest.fixture(scope="module")
def scone_export(tmp_path_factory):
    return hf_scone_runs.exports(tmp_path_factory, "scone")


@pytest.fixture(scope="module")
def baseline_export(tmp_path_factory):
    return hf_scone_runs.exports(tmp_path_factory, "baseline")


@pytest.fixture(scope="module")
def loaded(scone_export, baseline_export):
    """{kind: (our served bundle, transformers' model of the hf export)}."""
    from transformers import AutoModelForCausalLM

    out = {}
    for kind, paths in (("scone", scone_export), ("baseline", baseline_export)):
        model = AutoModelForCausalLM.from_pretrained(paths["hf"], trust_remote_code=True, dtype=torch.float32).eval()
        out[kind] = (inference.load(paths["bundle"]), model)
    return out


def encode(served, text):
    return np.concatenate([[served.tokenizer.bos_id], served.tokenizer.encode(text)]).astype(np.int32)


def our_logits(served, rows):
    """Our serving path's logits for token rows of several lengths (right-padded, segment 0 on padding)."""
    width = max(len(r) for r in rows)
    tokens, segments = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], segments[i, :len(r)] = r, 1
    positions = np.where(segments > 0, np.arange(width)[None], 0).astype(np.int32)
    batch = inference.host_rows(served, Batch(inputs=tokens, segment_ids=segments, positions=positions))
    logits = scone.batch_logits(served.decoder, jax.tree.map(jnp.asarray, batch.for_device()))
    return np.asarray(logits), batch.fgram_ids


@EXPORTED
def test_the_export_holds_the_bundles_rows_and_code_of_its_own(scone_export, baseline_export):
    """The table's bytes are the bundle table's (bf16, same rows), the vocabulary is the run's, config.json nests the
    family's config, and the remote code imports nothing but the standard library, numpy, torch and transformers."""
    hf, meta = scone_export["hf"], scone_export["meta"]
    assert meta["remote_code"] and meta["table_dtype"] == "bfloat16" and meta["family"] == "llama"
    config = json.load(open(os.path.join(hf, "config.json")))
    assert config["model_type"] == "scone" and config["text_config"]["model_type"] == "llama"
    assert config["embedding_multiplier"] == 2.0 and config["text_config"]["num_key_value_heads"] == 2
    section = config["fgrams"]
    opened = bundle.Bundle.open(scone_export["bundle"])
    ram = table_lib.open_table(opened, table="ram")
    s, d = section["num_fgrams"], section["width"]
    want = np.asarray(ram.gather(np.arange(s)[None]))[0]
    rows = scone_fgrams.FgramTable(os.path.join(hf, section["table"]), s, d, section["dtype"]).rows
    assert want.dtype == jnp.bfloat16 and section["dtype"] == "BF16" and s == opened.meta["num_fgrams"] > 500
    np.testing.assert_array_equal(np.asarray(rows), want.view(np.uint16))
    vocab = load_vocab(os.path.join(scone_export["workdir"], "fgrams"))
    path = os.path.join(hf, section["vocabulary"])
    np.testing.assert_array_equal(scone_fgrams.open_tensor(path, "tokens", "I32", (s, vocab.max_len)), vocab.tokens)
    np.testing.assert_array_equal(scone_fgrams.open_tensor(path, "lengths", "I32", (s,)), vocab.lengths)
    baseline = json.load(open(os.path.join(baseline_export["hf"], "config.json")))
    assert baseline["fgrams"] is None and baseline["embedding_multiplier"] == 4.0
    assert baseline["text_config"]["model_type"] == "gpt2"
    for name in hf_scone_runs.remote_files(hf):
        tree = ast.parse(open(os.path.join(hf, name)).read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert imported <= {"json", "math", "os", "numpy", "torch", "transformers", "__future__"}, (name, imported)


@EXPORTED
@pytest.mark.parametrize("kind", ["scone", "baseline"])
def test_padded_batches_score_as_ours(loaded, kind):
    """Four rows of several lengths, right- and left-padded (position_ids from the mask, as generate makes them):
    transformers' logits at every real position within 1e-4 of our serving path's; the SCONE rows match f-grams."""
    served, model = loaded[kind]
    rows = [encode(served, t) for t in TEXTS]
    want, ids = our_logits(served, rows)
    width = max(len(r) for r in rows)
    for side in ("right", "left"):
        tokens, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            at = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
            tokens[i, at], mask[i, at] = r, 1
        positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
        with torch.no_grad():
            got = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(positions)).logits.numpy()
        for i, r in enumerate(rows):
            real = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
            np.testing.assert_allclose(got[i, real], want[i, :len(r)], rtol=0, atol=1e-4, err_msg=f"{side} row {i}")
    assert np.abs(want).max() > 5
    if kind == "scone":
        assert (ids >= 0).sum() > 20


def prompts_for(served, lengths=(11, 7)):
    """One prompt per length: [bos] + the first tokens of a held-out verse. With f-grams, the first verse whose
    greedy next token (our serving path) ends an f-gram: the next step's input is then that f-gram's row, reached
    across the step boundary (a random model's own tokens seldom form f-grams). One forward pass over the verses'
    longest prompts predicts the next token after every shorter prefix too (the decoder is causal)."""
    verses = [encode(served, v)[:max(lengths)] for v in corpus.kjv_documents("eval", 0.02)[:64]]
    verses = np.stack([v for v in verses if len(v) == max(lengths)])
    if not served.bundle.meta["num_fgrams"]:
        return [verses[0, :n] for n in lengths]
    logits, _ = our_logits(served, list(verses))
    chosen = []
    for n in lengths:
        grown = np.concatenate([verses[:, :n], logits[:, n - 1].argmax(-1)[:, None]], 1).astype(np.int32)
        hits = np.flatnonzero(served.matcher.match(grown, np.ones_like(grown))[:, -1] >= 0)
        assert len(hits), f"no prompt of {n} tokens whose next token ends an f-gram"
        chosen.append(verses[hits[0], :n])
    return chosen


@EXPORTED
@pytest.mark.parametrize("kind", ["scone", "baseline"])
def test_greedy_generation_gives_our_tokens(loaded, kind):
    """transformers' generate (greedy, KV cache) continues each prompt with the tokens scone_jax's Generator picks at
    temperature 0, alone and in a left-padded batch; f-grams are matched in the prompts and in the generated tokens."""
    served, model = loaded[kind]
    prompts = prompts_for(served)
    new = 24
    generator = generate.Generator(served, temperature=0.0)
    ours = [generator.generate(p[None], new)["tokens"][0] for p in prompts]
    model.generation_config.eos_token_id = None  # ours never stops early
    width = max(len(p) for p in prompts)
    tokens, mask = np.zeros((len(prompts), width), np.int64), np.zeros((len(prompts), width), np.int64)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with torch.no_grad():
        alone = [model.generate(torch.from_numpy(p[None].astype(np.int64)), max_new_tokens=new, do_sample=False)[0]
                 for p in prompts]
        batched = model.generate(torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                                 do_sample=False)
    for i, (p, want) in enumerate(zip(prompts, ours)):
        np.testing.assert_array_equal(alone[i].numpy(), want)
        np.testing.assert_array_equal(batched[i, width - len(p):].numpy(), want)
    if kind == "scone":
        ids = [served.matcher.match(t[None], np.ones((1, len(t)), np.int32))[0] for t in ours]
        in_prompts = sum(int((m[:len(p)] >= 0).sum()) for m, p in zip(ids, prompts))
        generated = sum(int((m[len(p):] >= 0).sum()) for m, p in zip(ids, prompts))
        print(f"f-gram hits: {in_prompts} in the prompts, {generated} in the generated tokens")
        assert in_prompts > 0 and generated > 0


def reference_longest(fgrams: dict, max_len: int, tokens: np.ndarray, real: np.ndarray) -> np.ndarray:
    """docs/method.md §2 read plainly: position i uses the f-gram tokens j..i for the smallest j < i that forms one,
    here only among real tokens (a match never reaches across padding); -1 where none ends at i."""
    out = np.full(tokens.shape, -1, np.int64)
    for b in range(tokens.shape[0]):
        for i in range(tokens.shape[1]):
            for j in range(max(0, i - max_len + 1), i):
                gram = tuple(int(t) for t in tokens[b, j:i + 1])
                if real[b, j:i + 1].all() and gram in fgrams:
                    out[b, i] = fgrams[gram]
                    break
    return out


def fgram_text(vocab, rng, rows: int, length: int) -> np.ndarray:
    """Rows of f-grams laid end to end (so matches, long ones and ones spanning two f-grams, are everywhere), with
    a random token here and there."""
    out = np.empty((rows, length), np.int64)
    for r in range(rows):
        seq = []
        while len(seq) < length:
            f = rng.integers(vocab.num_fgrams)
            seq.extend(vocab.tokens[f, :vocab.lengths[f]].tolist() if rng.random() < 0.85 else [rng.integers(300)])
        out[r] = seq[:length]
    return out


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_table_rows_read_back_as_written(tmp_path, dtype):
    """A table file written by our safetensors writer, read by the remote code: the rows of given ids, the repeated
    and unordered ones of a large batch included, viewed in torch as the values written."""
    from scone_jax.hf import safetensors as st
    from scone_jax.hf.remote_code.modeling_scone import TORCH_VIEWS

    rows = np.random.default_rng(0).standard_normal((300, 8)).astype(st.DTYPES[dtype])
    path = str(tmp_path / "table.safetensors")
    st.write_file(path, [("rows", rows.dtype, rows.shape)], lambda name: rows)
    table = scone_fgrams.FgramTable(path, 300, 8, dtype)
    for ids in (np.array([5, 0, 5]), np.random.default_rng(1).integers(300, size=500)):
        got = torch.from_numpy(table.gather(ids)).view(TORCH_VIEWS[dtype]).float().numpy()
        np.testing.assert_array_equal(got, rows[ids].astype(np.float32))


@pytest.fixture(scope="module")
def vocab(scone_export):
    return load_vocab(os.path.join(scone_export["workdir"], "fgrams"))


@EXPORTED  # its vocabulary is the exported run's
def test_the_matcher_follows_the_method(vocab):
    """The remote code's matcher (sorted keys, prefix ids) against the plain reading of §2 on 24 rows of f-gram text:
    right padding, left padding, and a masked stretch inside a row, the padding itself holding f-gram tokens (so a
    match reaching across it would be found)."""
    fgrams = {tuple(vocab.tokens[r, :vocab.lengths[r]].tolist()): r for r in range(vocab.num_fgrams)}
    matcher = scone_fgrams.FgramMatcher(vocab.tokens, vocab.lengths, vocab.vocab_size)
    rng = np.random.default_rng(0)
    tokens = fgram_text(vocab, rng, 24, 40)
    real = np.ones(tokens.shape, bool)
    for r in range(24):
        kind, n = r % 3, rng.integers(1, 12)
        if kind == 0:
            real[r, 40 - n:] = False
        elif kind == 1:
            real[r, :n] = False
        else:
            real[r, n:n + 3] = False
    want = reference_longest(fgrams, vocab.max_len, tokens, real)
    got = matcher.longest(tokens, real)
    np.testing.assert_array_equal(got, want)
    lengths = vocab.lengths[want[want >= 0]]
    assert (want >= 0).mean() > 0.5 and (lengths == vocab.max_len).sum() > 20, np.bincount(lengths)
    assert (matcher.longest(tokens, np.ones_like(real)) != want).any()  # the padding did hold matches


@EXPORTED
def test_decoding_windows_find_every_match(loaded, vocab):
    """Decoding one token at a time (what generate does with a KV cache): the window prepare_inputs_for_generation
    hands forward finds, at every step, the f-gram the whole left-padded sequence has there (the reference above),
    matches begun up to K-1 tokens before the step included; forward refuses a cached step without its window."""
    from transformers import DynamicCache

    _, model = loaded["scone"]
    fgrams = {tuple(vocab.tokens[r, :vocab.lengths[r]].tolist()): r for r in range(vocab.num_fgrams)}
    rng = np.random.default_rng(1)
    tokens = fgram_text(vocab, rng, 6, 24)
    mask = np.ones(tokens.shape, np.int64)
    for r, n in enumerate([0, 3, 7, 1, 5, 0]):
        mask[r, :n] = 0
    want = reference_longest(fgrams, vocab.max_len, tokens, mask > 0)
    crossing = 0
    for t in range(1, tokens.shape[1]):
        inputs = model.prepare_inputs_for_generation(torch.from_numpy(tokens[:, :t + 1]), next_sequence_length=1,
                                                     attention_mask=torch.from_numpy(mask[:, :t + 1]))
        assert inputs["input_ids"].shape == (6, 1)
        got = model.fgram_ids(inputs["fgram_window_ids"], inputs["fgram_window_mask"], 1)[:, 0]
        np.testing.assert_array_equal(got, want[:, t], err_msg=f"step {t}")
        crossing += int((vocab.lengths[want[:, t][want[:, t] >= 0]] == vocab.max_len).sum())
    assert crossing > 5  # matches reaching K-1 tokens back, across the step boundary
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens[:, :4]), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="Fix: pass fgram_window_ids"):
            model(input_ids=torch.from_numpy(tokens[:, 4:5]), cache=out.cache, use_cache=True)


@EXPORTED
def test_the_harness_hf_backend_scores_as_our_adapter(loaded, scone_export):
    """lm_eval's HFLM with pretrained=the export and trust_remote_code=True: the loglikelihoods (and is-greedy) of
    text requests equal our harness adapter's on the bundle within 1e-4: the same tokens (the export's tokenizer.json
    adds bos as our adapter does) and the same f-gram rows."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from scone_jax.serving import lm_eval as harness

    served, _ = loaded["scone"]
    pairs = [("In the beginning God created", " the heaven and the earth."), ("And the LORD said", " unto Moses,"),
             ("And God said, Let there be", " light"), ("", "And the earth was without form")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    # One process on the CPU (HFLM's accelerate, from the [test] and [hf] extras, sees one process).
    theirs = HFLM(pretrained=scone_export["hf"], trust_remote_code=True, batch_size=4, device="cpu", dtype="float32",
                  parallelize=False, device_map="cpu").loglikelihood(requests)
    ours = harness.SconeHarnessLM(served, batch_size=8).loglikelihood(requests)
    for (ll, greedy), (want, want_greedy) in zip(theirs, ours):
        assert ll == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    assert min(want for want, _ in ours) < -5


@EXPORTED
def test_an_output_holding_other_files_is_refused(scone_export, tmp_path):
    """A SCONE export, like any --format=hf export, never writes into a directory holding what it did not write."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds 'notes.txt', which a Hugging Face export of scone_jax does not write"):
        hf_export.export_hf(scone_export["workdir"], str(out))
    assert os.listdir(out) == ["notes.txt"]


@EXPORTED
@pytest.mark.parametrize("damage", ["truncated", "appended", "config_rows"])
def test_a_table_that_disagrees_with_config_is_refused(scone_export, tmp_path, damage):
    """The module checks the table file against config.json before any weight loads: a truncated or padded file, or
    a config.json claiming another number of f-grams, is one line naming the file and the fix."""
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "hf")
    shutil.copytree(scone_export["hf"], out)
    table = os.path.join(out, scone_fgrams.TABLE_FILE)
    if damage == "truncated":
        os.truncate(table, os.path.getsize(table) - 128)
    elif damage == "appended":
        with open(table, "ab") as f:
            f.write(b"\0" * 128)
    else:
        config = json.load(open(os.path.join(out, "config.json")))
        config["fgrams"]["num_fgrams"] -= 1
        json.dump(config, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError) as e:
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    message = str(e.value)
    assert table in message and "Fix:" in message and "\n" not in message, message


@pytest.mark.parametrize("change", [{"scone.enabled": True}, {"model.embedding_multiplier": 2.0},
                                    {"scone.enabled": True, "model.embedding_multiplier": 8.0}])
def test_runs_outside_a_stock_input_take_the_remote_code(change):
    """A SCONE run or an input multiplier no family has: the family is the decoder's (the multiplier set aside, the
    module applies it), and the export goes through the remote code; a plain run does not."""
    from scone_jax.config import base_config
    from scone_jax.serving import hf_remote

    config = base_config()
    assert not hf_remote.needed(config)
    for key, value in change.items():
        section, name = key.split(".")
        config[section][name] = value
    assert hf_remote.needed(config) and hf_export.plan(config)[0].model_type == "gpt2"


@pytest.mark.slow
def test_the_program_exports_a_scone_run_for_transformers(scone_export, loaded, tmp_path):
    """`python -m scone_jax.serving.export --format=hf` on the SCONE run (one CPU device): exit 0, the line saying
    where the decoder went, progress lines for the table and the tensors (caught: the table written silently, as
    it was), and a directory transformers opens whose greedy tokens are the in-process export's; into
    a directory holding another file, exit 2 and one line."""
    from transformers import AutoModelForCausalLM

    from tests.common import run_tool

    out = str(tmp_path / "hf")
    done = run_tool("-m scone_jax.serving.export", [f"--workdir={scone_export['workdir']}", f"--output={out}",
                                                    "--format=hf", "--batch_rows=256"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "as a llama checkpoint (F32) inside the SCONE remote-code model" in done.stdout, done.stdout
    # Progress a person can follow (issue 62: this export ran 7.5 minutes silently on a real run): a line for each
    # tenth of the f-gram table crossed (4 batches of 256 of 1,000 rows here) and of the tensors, with rate and ETA.
    table = [line for line in done.stderr.splitlines() if "hf export: f-gram table: " in line]
    assert len(table) == 4 and "1,000/1,000 rows (100%)" in table[-1] and "rows/s, ETA 0 s" in table[-1], table
    assert any("hf export: tensors: " in line and "(100%)" in line for line in done.stderr.splitlines())
    served, model = loaded["scone"]
    again = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    prompt = torch.from_numpy(encode(served, TEXTS[1])[None].astype(np.int64))
    model.generation_config.eos_token_id = again.generation_config.eos_token_id = None
    with torch.no_grad():
        want, got = (m.generate(prompt, max_new_tokens=8, do_sample=False) for m in (model, again))
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    refused = run_tool("-m scone_jax.serving.export", [f"--workdir={scone_export['workdir']}",
                                                       f"--output={tmp_path / 'other'}", "--format=hf"])
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and "holds 'notes.txt', which a Hugging Face export" in lines[-1], refused.stderr[-2000:]
