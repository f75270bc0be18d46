"""The lm-evaluation-harness adapter scores with the table exactly as evaluation and decoding do, and its
program runs local tasks offline."""
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance

from scone_jax.batch import Batch
from scone_jax.data import corpus
from scone_jax.model import scone
from scone_jax.serving import evaluate, generate, inference, lm_eval as harness
from tests import serving_run
from tests.common import REPO, xla_flags

PROGRAM = "scone_jax.serving.lm_eval"


@pytest.fixture(scope="module")
def export_path(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def served(export_path):
    return inference.load(export_path)


@pytest.fixture(scope="module")
def lm(served):
    """One adapter (and its compiled steps) for the module: 8 rows, one per virtual device."""
    return harness.SconeHarnessLM(served, batch_size=8)


@pytest.fixture(scope="module")
def docs():
    """Held-out KJV paragraphs: short ones and one joined document of several seq_len windows."""
    verses = corpus.kjv_documents("eval", 0.02)
    return {"short": list(verses[:3]), "long": " ".join(verses[3:8])}


def reference_logp(served, inputs):
    """log-softmax [T, V] after each of `inputs` (one sequence from position 0): the decoder on the whole
    row (no jit, no padding, no batching), f-gram rows from inference.host_rows."""
    inputs = np.asarray(inputs, np.int32)[None]
    batch = inference.host_rows(served, Batch(inputs=inputs, segment_ids=np.ones_like(inputs),
                                              positions=np.arange(inputs.shape[1], dtype=np.int32)[None]))
    logits = scone.batch_logits(served.decoder, jax.tree.map(jnp.asarray, batch.for_device()))
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[0].astype(np.float64)


def reference_logprobs(served, tokens):
    """log P(tokens[i+1] | tokens[:i+1]) and whether it is the argmax, for one sequence."""
    logp = reference_logp(served, tokens[:-1])
    targets = np.asarray(tokens[1:])
    return logp[np.arange(len(targets)), targets], logp.argmax(-1) == targets


def rolling(lm, texts):
    return lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])


def loglikelihood(lm, pairs):
    return lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])


def test_rolling_loglikelihood_equals_evaluate_on_the_same_document(lm, served, docs, tmp_path):
    """A document of 65 windows (the last one partial), held out alone: the adapter's total equals
    -(loss x tokens) that evaluate reports (evaluate counts the end-of-document prediction; so does the
    default rolling_eos); without that prediction it is less the eos term of the plain reference.
    Measured: equal to 1.4e-8 relative. Deliberate bugs, each injected once: the harness's usual rolling
    windows (lm_eval.utils.get_rolling_token_windows: the last window gets a full context) 9.9e-4 off;
    rows left-padded with positions from the column index 1.2e-4 off (only the last window is padded,
    so a tolerance of 1e-4 would pass it: rtol 1e-6)."""
    text = docs["long"]
    ids = served.tokenizer.encode(text)
    seq_len = served.config.data.seq_len
    assert len(ids) + 1 > 3 * seq_len  # windows: full, full, full, partial
    path = tmp_path / "one_document.txt"
    path.write_text(text + "\n")
    data = evaluate.data_config(served, {"data.source": "text", "data.eval_files": str(path)}).data
    result = evaluate.evaluate(served, data)
    assert result["tokens"] == len(ids) + 1
    [total] = rolling(lm, [text])
    np.testing.assert_allclose(total, -result["loss"] * result["tokens"], rtol=1e-6)
    last_window = np.concatenate([[served.tokenizer.bos_id], ids, [served.tokenizer.eos_id]])
    last_window = last_window[(len(ids) // seq_len) * seq_len:]  # inputs and the eos target of the last window
    eos_logp = reference_logprobs(served, last_window)[0][-1]
    lm.rolling_eos = False
    try:
        [text_only] = rolling(lm, [text])
    finally:
        lm.rolling_eos = True
    np.testing.assert_allclose(text_only, total - eos_logp, rtol=1e-6)


def test_a_run_without_bos_is_scored_without_bos(served, docs, tmp_path):
    """A bundle whose run had data.add_bos=False: evaluate packs the held-out document as its ids alone
    (len(ids) positions, not len(ids) + 1), the adapter's rolling total equals it, contexts carry no bos and
    an empty one is [eos] (data/prompt.py); loglikelihood equals the plain reference on the context's ids.
    Caught, each tried: the adapter's windows still [bos] + ids (rolling total 0.19% off evaluate's, rtol 1e-6);
    tok_encode prepending bos whatever the bundle says."""
    import dataclasses

    config = served.config.copy_and_resolve_references()
    with config.unlocked():
        config.data.add_bos = False
    plain = dataclasses.replace(served, config=config)
    lm = harness.SconeHarnessLM(plain, batch_size=8)
    tok = served.tokenizer
    text = docs["long"]
    ids = list(tok.encode(text))
    path = tmp_path / "one_document.txt"
    path.write_text(text + "\n")
    data = evaluate.data_config(plain, {"data.source": "text", "data.eval_files": str(path)}).data
    result = evaluate.evaluate(plain, data)
    assert result["tokens"] == len(ids)
    [total] = rolling(lm, [text])
    np.testing.assert_allclose(total, -result["loss"] * result["tokens"], rtol=1e-6)
    assert lm.tok_encode("In the beginning") == list(tok.encode("In the beginning"))
    assert lm.prefix_token_id == tok.eos_id
    context, continuation = "In the beginning God created", " the heaven and the earth."
    [(ll, _)] = loglikelihood(lm, [(context, continuation)])
    whole = list(tok.encode(context + continuation))
    n = len(whole) - len(tok.encode(context))
    np.testing.assert_allclose(ll, reference_logprobs(served, whole)[0][-n:].sum(), rtol=1e-5)


@pytest.mark.slow  # 10-13 s: the fast tier stays under 5 minutes
def test_loglikelihood_equals_the_plain_reference(lm, served, docs):
    """(context, continuation) -> sum of the continuation's log-probs after [bos] + context, and
    is_greedy; a context longer than seq_len keeps its newest tokens (the reference scores that window).
    Measured: equal to 2e-7 relative. Catches (injected once) an off-by-one continuation slice, the
    last context token scored instead of the last continuation token (52% off), which the batching
    test cannot see: it shifts every request alike."""
    tok, seq_len = served.tokenizer, served.config.data.seq_len
    context, continuation = "In the beginning God created", " the heaven and the earth."
    long_context = docs["long"][:400].rstrip()
    results = loglikelihood(lm, [(context, continuation), (long_context, continuation), ("", continuation)])
    for (ll, greedy), ctx in zip(results, [context, long_context, ""]):
        whole = [tok.bos_id] + list(tok.encode(ctx + continuation))
        n = len(whole) - 1 - len(tok.encode(ctx)) if ctx else len(tok.encode(continuation))
        window = whole[-(seq_len + 1):]
        logp, is_max = reference_logprobs(served, window)
        np.testing.assert_allclose(ll, logp[-n:].sum(), rtol=1e-5)
        assert greedy == bool(is_max[-n:].all())
    assert len(tok.encode(long_context)) > 2 * seq_len
    # A continuation that is the model's own greedy token is greedy.
    prompt = [tok.bos_id] + list(tok.encode(context))
    last = reference_logp(served, prompt)[-1]
    [(ll, greedy)] = lm._loglikelihood_tokens([((context, "?"), prompt, [int(last.argmax())])])
    assert greedy and ll == pytest.approx(last.max(), rel=1e-5)


def test_batching_does_not_change_scores(lm, served, docs):
    """Each request scored alone (7 padding rows, its own length bucket) equals it scored among 12
    others of mixed lengths (two batches, 32-wide buckets, sorted by length).
    Measured: equal to 1.5e-7 relative. Deliberate bugs this caught, each injected once in
    SconeHarnessLM.score_rows: rows left-padded with positions taken from the column index (positions
    then depend on the batch's padding: up to 21 nats, 50%, off); results written back in sorted order
    instead of request order (a request gets another's score: up to 92 nats off)."""
    tok = served.tokenizer
    verses = corpus.kjv_documents("eval", 0.02)[:13]
    requests = []
    for i, verse in enumerate(verses):
        ids = list(tok.encode(verse))
        cut = 3 + (5 * i) % 20  # contexts of 3..22 tokens, continuations of 1..9
        requests.append(((verse, ""), [tok.bos_id] + ids[:cut], ids[cut:cut + 1 + i % 9]))
    together = lm._loglikelihood_tokens(requests)
    alone = [lm._loglikelihood_tokens([r])[0] for r in requests]
    np.testing.assert_allclose([x for x, _ in together], [x for x, _ in alone], rtol=1e-5)
    assert [g for _, g in together] == [g for _, g in alone]
    assert len({x for x, _ in together}) == len(requests)  # distinct scores: a mix-up would show


def test_generate_until_is_the_generators_greedy_text_cut_at_the_stop_string(lm, served):
    """Two requests decoded as one batch: one cut before a stop string met halfway, one run to
    max_gen_toks; both the Generator's greedy text for [bos] + context. Catches (injected once) a
    prompt without bos; sampling options the Generator lacks (beam search) are refused."""
    tok = served.tokenizer
    context = "And God said, Let there be light"
    prompt = np.asarray([[tok.bos_id, *tok.encode(context)]], np.int32)
    tokens = generate.Generator(served).generate(prompt, 12)["tokens"][0, prompt.shape[1]:]
    full = lm._finish(tokens, [])
    assert len(full) > 6, full
    stop = full[len(full) // 2: len(full) // 2 + 2]  # a stop string met halfway through
    cut = full.split(stop)[0]
    assert len(cut) < len(full)
    requests = [Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 12, "do_sample": False}), 0),
                Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 12, "temperature": 0}), 1)]
    assert lm.generate_until(requests) == [cut, full]
    with pytest.raises(ValueError, match="num_beams=4.*cannot serve"):
        lm.generate_until([Instance("generate_until", {}, (context, {"do_sample": True, "num_beams": 4}), 0)])


def test_bad_task_input_is_one_error_with_its_fix(tmp_path, monkeypatch):
    """Unknown names and a missing harness are ValueErrors naming the fix (the program prints them)."""
    from lm_eval.tasks import TaskManager

    (tmp_path / "tasks").mkdir()
    write_tasks(tmp_path / "tasks", tmp_path)
    manager = TaskManager(include_path=[str(tmp_path / "tasks")], include_defaults=False)
    with pytest.raises(ValueError, match=r"unknown task\(s\) 'tiny_pp'.*did you mean tiny_ppl.*--include_path"):
        harness.load_tasks(manager, ["tiny_pp"], offline=True)
    monkeypatch.setattr(harness, "_HARNESS_MISSING", ImportError("No module named 'lm_eval'"))
    with pytest.raises(ValueError, match=r"pip install -e '\.\[harness\]'"):
        harness.require_harness()


MC_DOCS = [{"question": q, "choices": c, "answer": a} for q, c, a in [
    ("In the beginning God created the heaven and the", ["earth.", "sea.", "stars."], 0),
    ("And God said, Let there be", ["darkness", "light", "water"], 1),
    ("And the evening and the morning were the first", ["night.", "year.", "day."], 2),
    ("And God called the light", ["Day", "Night", "Heaven"], 0),
    ("Thou shalt love thy neighbour as", ["thyself.", "a stranger.", "the law."], 0),
]]


def write_tasks(directory, data_dir, docs=None):
    """A rolling perplexity task and a multiple-choice task over local JSONL files (no hub download)."""
    texts = docs or ["In the beginning God created the heaven and the earth."]
    (data_dir / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (data_dir / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (directory / "tiny_ppl.yaml").write_text(f"""task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_dir / "ppl.jsonl"}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    (directory / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_dir / "mc.jsonl"}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")


def cli_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in harness.OFFLINE_VARIABLES}  # the program sets them
    return env | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8),
                  "HF_HOME": str(tmp_path / "hf_home")}  # datasets' cache stays in the test's directory


@pytest.mark.slow
def test_cli_runs_local_tasks_offline_and_reports_the_adapters_figures(lm, served, docs, export_path, tmp_path):
    """The program's metrics are the adapter's: bits per byte from its rolling log-likelihoods and the
    accuracy its loglikelihoods give, on tasks read from local JSONL with the hub switched off. The program
    serves its rows from disk (a budget of the 500-byte block index and 96 head rows), the adapter from RAM."""
    (tmp_path / "tasks").mkdir()
    texts = docs["short"] + [docs["long"]]
    write_tasks(tmp_path / "tasks", tmp_path, texts)
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", PROGRAM, f"--export={export_path}", "--tasks=tiny_ppl,tiny_mc",
         f"--include_path={tmp_path / 'tasks'}", f"--output={out}", "--bootstrap_iters=0", "--table=disk",
         f"--max_table_bytes={500 + 96 * 256}"],
        cwd=REPO, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tiny_ppl" in result.stdout and "bits_per_byte" in result.stdout  # the results table
    with open(out) as f:
        metrics = json.load(f)["results"]
    total = sum(rolling(lm, texts))
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    np.testing.assert_allclose(metrics["tiny_ppl"]["bits_per_byte,none"], -total / num_bytes / math.log(2), rtol=1e-5)
    np.testing.assert_allclose(metrics["tiny_ppl"]["byte_perplexity,none"], math.exp(-total / num_bytes), rtol=1e-5)
    lls = loglikelihood(lm, [(d["question"], " " + c) for d in MC_DOCS for c in d["choices"]])
    picks = np.asarray([x for x, _ in lls]).reshape(len(MC_DOCS), 3).argmax(1)
    expected = float(np.mean(picks == [d["answer"] for d in MC_DOCS]))
    assert metrics["tiny_mc"]["acc,none"] == pytest.approx(expected)


@pytest.mark.slow
def test_cli_passes_its_table_flags_to_the_loader(export_path, tmp_path):
    """--table=disk with a budget under the block index (500 bytes) is one line, exit 2 (caught: the flags
    defined but not passed to inference.load: the table loaded whole into RAM, exit 0)."""
    (tmp_path / "tasks").mkdir()
    write_tasks(tmp_path / "tasks", tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", PROGRAM, f"--export={export_path}", "--tasks=tiny_ppl",
         f"--include_path={tmp_path / 'tasks'}", "--bootstrap_iters=0", "--table=disk", "--max_table_bytes=100"],
        cwd=REPO, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"{PROGRAM}: error: --max_table_bytes=100 is less than the 500 bytes the block index of "), result.stderr[-3000:]


@pytest.mark.slow
def test_cli_refuses_hub_data_offline_in_one_line(export_path, tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: no-such-org/no-such-dataset\noutput_type: loglikelihood_rolling\n"
        "test_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n")
    result = subprocess.run(
        [sys.executable, "-m", PROGRAM, f"--export={export_path}", "--tasks=hub_task",
         f"--include_path={tmp_path / 'tasks'}"],
        cwd=REPO, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"{PROGRAM}: error: task 'hub_task': its data is not "
                                                     "available offline"), result.stderr[-3000:]
    assert "--allow_downloads" in errors[0]
