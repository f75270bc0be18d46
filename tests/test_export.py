"""Export: the table holds the f-gram model's outputs; resume skips finished chunks; bad input is refused."""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from scone_jax import sharding
from scone_jax.serving import bundle, export
from scone_jax.training import state as state_lib
from tests import serving_run
from tests.common import REPO, small_config, training_graph_eval


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return serving_run.trained_run(tmp_path_factory)


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "float32")


BATCH_ROWS = 512  # the export's batch in these tests (serving_run.exported)


def reference_rows(run, rows):
    """F-gram embeddings computed directly from the checkpoint's model (not through the export), like with
    like: each row inside the same 512-row batch, sharded over the same devices as the export computes it.
    A 6-row batch on one device reduces in another order: 1 of 384 fp32 elements then differs by ~1e-6 on
    some CPUs, so anything short of this comparison needs a tolerance that would hide a row off by a little."""
    r = export.open_run(run["workdir"])
    mesh, model = r.mesh, r.model()
    r.close()
    graphdef, params = nnx.split(model)
    embed = sharding.under_mesh(mesh, jax.jit(lambda p, t, n: nnx.merge(graphdef, p).fgram_embeddings(t, n)))
    out = []
    for row in rows:
        start = row // BATCH_ROWS * BATCH_ROWS
        tokens, lengths = export.batch_inputs(run["vocab"], start, BATCH_ROWS, mesh)
        out.append(np.asarray(embed(params, tokens, lengths))[row - start])
    return np.stack(out)


def test_export_writes_the_fgram_model_outputs_and_a_complete_bundle(run, fp32_export):
    meta = bundle.Bundle.open(fp32_export).meta
    vocab = run["vocab"]
    assert (meta["num_fgrams"], meta["d_model"], meta["max_len"], meta["dtype"]) == (vocab.num_fgrams, 64, 4, "float32")
    assert meta["fgram_vocab_fingerprint"] == vocab.fingerprint
    assert meta["tokenizer_fingerprint"] == run["tokenizer"].fingerprint
    table = serving_run.ram_table(fp32_export)
    rows = np.array([0, 1, 63, 64, 999, vocab.num_fgrams - 1])
    np.testing.assert_array_equal(table.gather(rows), reference_rows(run, rows))
    assert np.abs(table.gather(np.arange(vocab.num_fgrams))).sum(1).min() > 0  # no row left unwritten
    chunks = [n for n in os.listdir(os.path.join(fp32_export, "done")) if n.isdigit()]
    assert len(chunks) == -(-vocab.num_fgrams // 64)


def test_interrupted_export_is_refused_by_readers_and_resumes_only_missing_chunks(run, fp32_export, tmp_path):
    path = str(tmp_path / "partial")
    shutil.copytree(fp32_export, path)
    os.remove(os.path.join(path, "COMPLETE"))
    for chunk in (2, 3):  # files of the first 512-row round: lost together with their rows
        os.remove(os.path.join(path, "done", f"{chunk:09d}"))
        with open(os.path.join(path, "table", f"{chunk:09d}"), "wb") as f:
            f.write(b"\0" * 1000)  # what an interrupted write might leave
    with pytest.raises(bundle.BundleError, match="unfinished export"):
        serving_run.ram_table(path)

    figures = export.export(run["workdir"], path, dtype="float32", chunk_rows=64, batch_rows=512)
    assert figures["rows_computed"] == 512  # one batch recomputed, the other three skipped
    np.testing.assert_array_equal(serving_run.ram_table(path).gather(np.arange(2000)),
                                  serving_run.ram_table(fp32_export).gather(np.arange(2000)))
    assert export.export(run["workdir"], path, dtype="float32", chunk_rows=64, batch_rows=512)["rows_computed"] == 0


def test_files_filled_over_several_steps_hold_the_same_rows(run, fp32_export, tmp_path):
    """256-row files from 64 rows per device per step: each round fills 8 files in 4 steps, the last file short
    (208 rows), and the rows are the same bits as the one-step export's (each device computes the same 64-row
    shapes). Caught: a step's rows written at the file's start (`a = step * per_device` -> 0)."""
    path = str(tmp_path / "steps")
    figures = export.export(run["workdir"], path, dtype="float32", chunk_rows=256, batch_rows=512)
    assert figures["rows_computed"] == 2000
    assert sorted(os.listdir(os.path.join(path, "table"))) == [f"{c:09d}" for c in range(8)]
    assert os.path.getsize(os.path.join(path, "table", "000000007")) == 208 * 256 + 13 * 4  # rows, 13 block CRCs
    rows = np.arange(2000)
    np.testing.assert_array_equal(serving_run.ram_table(path).gather(rows).view(np.uint32),
                                  serving_run.ram_table(fp32_export).gather(rows).view(np.uint32))


def test_export_never_overwrites_a_different_export(run, fp32_export, tmp_path):
    path = str(tmp_path / "copy")
    shutil.copytree(fp32_export, path)
    before = open(os.path.join(path, "export.json")).read()
    with pytest.raises(bundle.BundleError, match=r"differs from this one in \['block_rows', 'dtype'\]"):
        export.export(run["workdir"], path, dtype="bfloat16", chunk_rows=64, batch_rows=512)
    assert open(os.path.join(path, "export.json")).read() == before
    assert json.loads(before)["dtype"] == "float32"


@pytest.mark.slow
@pytest.mark.parametrize("multiplier", [1.0, 2.0])
def test_a_run_without_scone_exports_a_decoder_only_bundle_served_like_any_other(tmp_path, tokenizer_path, multiplier):
    """A baseline's bundle has an empty f-gram set (S = 0): the CLI exports it (it used to refuse), and
    serving.evaluate's perplexity equals the training graph's held-out loss of that checkpoint (fp32), so a
    study compares baseline and SCONE through the same serving programs; model.embedding_multiplier (the
    study's scaled-input control) travels with the bundle. tools/embedding_scale.py reads such a bundle."""
    from scone_jax.serving import evaluate, inference
    from scone_jax.training import assets, checkpoint

    config = small_config(init_std=0.5, embedding_multiplier=multiplier)  # far from uniform logits
    config.data.tokenizer_path = tokenizer_path
    mesh = sharding.make_mesh(config.mesh)
    tokenizer = assets.ensure_tokenizer(config.data, str(tmp_path))
    spec = state_lib.state_spec(config, mesh)
    state = state_lib.init_state(config, spec)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "plain" / "checkpoints"))
    ckpt.save(1, state, {"config": config.to_dict(), "step": 1, "tokenizer_fingerprint": tokenizer.fingerprint,
                         "fgram_vocab_fingerprint": None})
    ckpt.wait()
    ckpt.close()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "scone_jax.serving.export", f"--workdir={tmp_path / 'plain'}",
                             f"--output={tmp_path / 'out'}", "--dtype=float32"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exported 0 f-grams" in result.stdout
    served = inference.load(str(tmp_path / "out"))
    assert served.bundle.meta["num_fgrams"] == 0 and served.bundle.meta["fgram_model_fingerprint"] is None
    config.train.eval_batches = 0
    served_eval = evaluate.evaluate(served, config.data)
    assert served_eval["hit_rate"] == 0.0
    graph = training_graph_eval(config, tokenizer, state, mesh)
    assert served_eval["tokens"] == graph["tokens"] > 1000
    np.testing.assert_allclose(served_eval["perplexity"], graph["perplexity"], rtol=1e-5)
    assert served_eval["perplexity"] > 2 * 512  # init_std 0.5: the untrained decoder is far worse than uniform
    assert served.config.model.embedding_multiplier == multiplier
    scale = subprocess.run([sys.executable, "tools/embedding_scale.py", f"--export={tmp_path / 'out'}"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300)
    assert scale.returncode == 0, scale.stderr[-2000:]
    assert "RESULT token_row_norm_" in scale.stdout and "fgram_row_norm" not in scale.stdout
