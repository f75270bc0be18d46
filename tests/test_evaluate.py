"""Offloaded evaluation equals the training graph's perplexity; mismatched pieces are refused."""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from scone_jax import sharding
from scone_jax.data import corpus, tokenizer_training
from scone_jax.fgram.vocab import FgramVocab, load_vocab, save_vocab
from scone_jax.serving import bundle, evaluate, inference
from scone_jax.training import assets, checkpoint, state as state_lib
from tests import serving_run
from tests.common import REPO, training_graph_eval as held_out_of_state, xla_flags


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return serving_run.trained_run(tmp_path_factory)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return serving_run.eval_text(tmp_path_factory)


def overrides(text):
    return {"data.source": "text", "data.eval_files": text}


@pytest.fixture(scope="module")
def training_graph_eval(run, text):
    """Held-out loss of the training graph: the f-gram model runs on the fly inside the eval step."""
    config = run["config"].copy_and_resolve_references()
    with config.unlocked():
        config.data.update(dict(source="text", eval_files=text))
        config.train.eval_batches = 0
    mesh = sharding.make_mesh(config.mesh)
    _, batcher = assets.fgram_batcher(config, run["tokenizer"], run["workdir"], mesh)
    spec = state_lib.state_spec(config, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(run["workdir"], "checkpoints"))
    state, _ = ckpt.restore(ckpt.latest_step(), state_lib.abstract_with_shardings(spec))
    ckpt.close()
    return held_out_of_state(config, run["tokenizer"], state, mesh, batcher)


def check_counts(result, training_graph_eval, text):
    assert result["tokens"] == training_graph_eval["tokens"] > 10_000  # every document once
    assert 0.3 < result["hit_rate"] < 1.0
    text_bytes = sum(len(line.encode()) for line in open(text, encoding="utf-8").read().splitlines())
    assert result["bytes"] == text_bytes
    np.testing.assert_allclose(result["bits_per_byte"], result["loss"] * result["tokens"] / math.log(2) / text_bytes)


def test_offloaded_perplexity_equals_the_training_graph(tmp_path_factory, text, training_graph_eval):
    """float32 table: the offloaded path (rows from the export, decoder alone on the device) gives the
    training graph's perplexity (measured: equal to the last digit). Catches: an f-gram model whose
    all_positions returns the whole f-gram's output at every position instead of its prefix's (training
    graph +5.3%; offloaded path fed the longest f-gram's row at each position of a maximal f-gram, +4.4%)."""
    served = inference.load(serving_run.exported(tmp_path_factory, "float32"))
    data = evaluate.data_config(served, overrides(text)).data
    result = evaluate.evaluate(served, data)
    # One loop (training/evaluation.py): the training graph's figures come in the same shape, and its f-gram
    # batcher's matches hit where the table's do. Catches (tried): serving.evaluate passing the table's rows
    # only when use_table is False (a hit rate of None against the training graph's 0.3..1).
    assert set(result) - {"use_table"} == set(training_graph_eval)
    assert result["hit_rate"] == training_graph_eval["hit_rate"]
    check_counts(result, training_graph_eval, text)
    np.testing.assert_allclose(result["perplexity"], training_graph_eval["perplexity"], rtol=1e-5)
    baseline = evaluate.evaluate(served, data, use_table=False)  # the table matters: T(token) alone scores differently
    assert abs(baseline["perplexity"] / result["perplexity"] - 1) > 0.02


def test_rows_served_from_disk_evaluate_exactly_as_rows_in_ram(tmp_path_factory, text):
    """The same export with its table on disk (a budget of its block index and 96 head rows): the same tokens, hit
    rate and perplexity to the last bit, the rows read while evaluation runs (caught: DiskTable serving each
    block's first row for every row of it: the perplexity differed)."""
    path = serving_run.exported(tmp_path_factory, "float32")
    ram = inference.load(path)
    disk = inference.load(path, table="disk", max_table_bytes=500 + 96 * 256)
    assert not disk.table.in_ram and disk.table.head_rows == 96
    data = evaluate.data_config(ram, overrides(text)).data
    want, got = evaluate.evaluate(ram, data), evaluate.evaluate(disk, data)
    assert (got["tokens"], got["hit_rate"], got["perplexity"]) == (want["tokens"], want["hit_rate"], want["perplexity"])
    assert disk.table.rows_from_disk > 0 and disk.table.rows_from_head > 0
    disk.table.close()


class _RoundedTable:
    """A table whose rows are another's, rounded to bfloat16 on the host (round to nearest even)."""

    def __init__(self, table):
        self._table = table

    def gather(self, ids):
        return np.asarray(self._table.gather(ids)).astype(jnp.bfloat16)


def test_bf16_table_evaluates_as_the_float32_table_rounded_to_bf16(tmp_path_factory, text, training_graph_eval):
    """A bfloat16 table is the float32 one rounded, so evaluating it must give exactly what the float32
    export gives with its rows rounded to bf16 on the host (measured: bit-equal perplexities), and the
    float32 export is pinned to the training graph above. Against the training graph directly, the
    rounding moves the perplexity by 4.7e-4 (relative): a tolerance there must exceed that, and small
    bugs hide under it: a table truncated to bf16 instead of rounded (tried, in export's cast) moves
    it by only 6e-5 (the old rtol 5e-3 passed it) but by 4.1e-4 from the rounded reference; rows
    through float16 instead, 7e-5 (5.4e-4). The broken f-gram model (the whole f-gram's output at
    every prefix, tried in FgramModel.all_positions) moves it by 5.3%. So: rtol 1e-6 against the
    rounded reference (catches the truncation), and 2e-3 against the training graph, 4x the measured
    rounding effect and 20x below that bug (catches it)."""
    served = inference.load(serving_run.exported(tmp_path_factory, "bfloat16"))
    assert str(served.table.dtype) == "bfloat16"
    data = evaluate.data_config(served, overrides(text)).data
    result = evaluate.evaluate(served, data)
    check_counts(result, training_graph_eval, text)
    f32 = inference.load(serving_run.exported(tmp_path_factory, "float32"))
    rounded = evaluate.evaluate(dataclasses.replace(f32, table=_RoundedTable(f32.table)), data)
    assert rounded["tokens"] == result["tokens"] and rounded["hit_rate"] == result["hit_rate"]
    np.testing.assert_allclose(result["perplexity"], rounded["perplexity"], rtol=1e-6)
    np.testing.assert_allclose(result["perplexity"], training_graph_eval["perplexity"], rtol=2e-3)


def test_named_sets_are_each_evaluated_as_alone_and_averaged(tmp_path_factory, text, tmp_path):
    """data.eval_files='first=A;second=B' (data/eval_sets.py): each set's figures equal an evaluation of
    that file alone; the average is their unweighted mean (the paper's "Average" column)."""
    lines = open(text, encoding="utf-8").read().splitlines()
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("\n".join(lines[:15]) + "\n")
    second.write_text("\n".join(lines[15:]) + "\n")
    served = inference.load(serving_run.exported(tmp_path_factory, "float32"))
    both = evaluate.evaluate_all(served, evaluate.data_config(
        served, {"data.source": "text", "data.eval_files": f"first={first}; second={second}"}).data)
    assert sorted(both["sets"]) == ["first", "second"]
    for name, path in (("first", first), ("second", second)):
        alone = evaluate.evaluate(served, evaluate.data_config(served, overrides(str(path))).data)
        got = both["sets"][name]
        assert got["tokens"] == alone["tokens"] and got["bytes"] == alone["bytes"] == len(path.read_bytes()) - len(
            path.read_text().splitlines())  # the text without its line breaks
        np.testing.assert_allclose([got["loss"], got["bits_per_byte"]], [alone["loss"], alone["bits_per_byte"]],
                                   rtol=1e-6)
    sets = both["sets"].values()
    for key in ("loss", "perplexity", "bits_per_byte"):
        np.testing.assert_allclose(both["average"][key], np.mean([r[key] for r in sets]), rtol=1e-12)
    assert both["sets"]["first"]["perplexity"] != both["sets"]["second"]["perplexity"]


@pytest.mark.slow
def test_cli_writes_the_json_result(tmp_path_factory, text, training_graph_eval, tmp_path):
    path = serving_run.exported(tmp_path_factory, "float32")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8)}
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, "-m", "scone_jax.serving.evaluate", f"--export={path}", "--config.data.source=text",
         f"--config.data.eval_files={text}", f"--result={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "perplexity" in result.stdout and "bits/byte" in result.stdout and "hit rate" in result.stdout
    saved = json.loads(out.read_text())
    np.testing.assert_allclose(saved["perplexity"], training_graph_eval["perplexity"], rtol=1e-5)
    assert saved["tokens_per_s"] > 0


def test_pieces_of_another_model_vocabulary_or_tokenizer_are_refused(tmp_path_factory, tmp_path):
    original = serving_run.exported(tmp_path_factory, "float32")
    served = inference.load(original)

    other_tokenizer = tokenizer_training.train_tokenizer(corpus.kjv_documents("train", 0.02)[:300], str(tmp_path / "t.model"),
                                                    400, model_type="bpe")
    with pytest.raises(ValueError, match="not the tokenizer the export was trained with"):
        evaluate.data_config(served, {"data.tokenizer_path": other_tokenizer.path})
    with pytest.raises(ValueError, match="model comes from the export"):
        evaluate.data_config(served, {"model.num_layers": 3})

    path = str(tmp_path / "swapped_decoder")
    shutil.copytree(original, path)
    with bundle.decoder_checkpointer() as saver:
        saver.save(os.path.join(path, "decoder"), args=ocp.args.StandardSave(jax.tree.map(lambda x: x * 2, served.params)),
                   force=True)
    with pytest.raises(bundle.BundleError, match="swapped_decoder/decoder/.* is damaged: it hashes to .* COMPLETE"):
        inference.load(path)  # the files' CRCs catch it first
    serving_run.reseal(path)  # a forged seal: the parameters' fingerprint still catches it
    with pytest.raises(bundle.BundleError, match="belongs to another model"):
        inference.load(path)

    path = str(tmp_path / "swapped_vocab")
    shutil.copytree(original, path)
    other_vocab = FgramVocab(  # another vocabulary over the same tokenizer
        tokens=np.array([[4, 5, 0, 0]], np.int32), lengths=np.array([2], np.int32), counts=np.array([9]),
        max_len=4, min_count=3, tokens_counted=10, vocab_size=served.matcher.vocab_size,
        tokenizer_fingerprint=served.matcher.tokenizer_fingerprint)
    save_vocab(other_vocab, os.path.join(path, "fgrams"))
    with pytest.raises(ValueError, match=r"fgrams/tokens has shape \(1, 4\), not the 2000 f-grams it must hold"):
        inference.load(path)  # its size gives it away before its arrays are read (caught: load_vocab without
        # num_fgrams, the fingerprint's refusal came instead, after the arrays were read)
    mine = load_vocab(os.path.join(original, "fgrams"))
    save_vocab(dataclasses.replace(mine, counts=mine.counts + 1), os.path.join(path, "fgrams"))  # same size
    with pytest.raises(bundle.BundleError, match="fgram_vocab_fingerprint.*a piece was replaced"):
        inference.load(path)
