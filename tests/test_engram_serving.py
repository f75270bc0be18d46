"""An Engram run (docs/method.md §9) exported and served the way the quality study serves every arm: its tables
travel in the bundle's decoder, the host computes every batch's ids, serving.evaluate's perplexity equals training's
evaluation of the same text, and cached generation equals a full forward pass.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scone_jax.batch import Batch
from scone_jax.model import scone
from scone_jax.serving import evaluate, export, generate, inference
from scone_jax.training import run as run_lib
from tests import serving_run
from tests.common import run_main, small_config
from tests.test_overencoding_serving import TEXT, training_eval


@pytest.fixture(scope="module")
def engram_run(tmp_path_factory, tokenizer_path):
    """A workdir holding the initial state of an Engram run as a checkpoint, and its export (its convolution is 0
    there, the paper's start: tests/test_engram.py checks the cached convolution with random weights)."""
    config = small_config(init_std=0.5)
    with config.unlocked():
        config.data.tokenizer_path = tokenizer_path
        config.train.update(dict(num_steps=2, checkpoint_every=2, log_every=1))
        config.engram.update(dict(enabled=True, layers="1", n=3, heads=2, head_width=8, rows=1000))
    root = tmp_path_factory.mktemp("engram_run")
    workdir, path = str(root / "run"), str(root / "export")
    tokenizer, _ = run_lib.save_initial_state(config, workdir, 1)
    export.export(workdir, path, dtype="float32", chunk_rows=64, batch_rows=512)
    return {"config": config, "workdir": workdir, "export": path, "tokenizer": tokenizer}


def test_served_perplexity_equals_training_evaluation(engram_run, tmp_path_factory):
    """The bundle's decoder holds the tables and serving.evaluate, hashing each batch's n-grams on the host, gives
    training's held-out perplexity of the same text (float32: equal to ~1e-5). Caught: inference.load_decoder
    building the decoder without its engram section (the restore refused the bundle's extra arrays)."""
    text = serving_run.eval_text(tmp_path_factory)
    meta = json.load(open(os.path.join(engram_run["export"], "export.json")))
    assert meta["num_fgrams"] == 0 and meta["config"]["engram"]["enabled"]
    served = inference.load(engram_run["export"])
    assert served.params["engram"][0]["engram_tables"]["embedding"].shape == (4096, 8)
    data = evaluate.data_config(served, {"data.source": "text", "data.eval_files": text}).data
    result = evaluate.evaluate(served, data)
    want = training_eval(engram_run, text)
    assert result["tokens"] == want["tokens"] > 10_000
    np.testing.assert_allclose(result["perplexity"], want["perplexity"], rtol=1e-5)


def test_cached_generation_equals_a_full_forward_pass(engram_run):
    """Generation with the KV cache (its Engram buffers) and NgramHasher-style next_ids gives the full pass's logits.
    Caught: Generator.empty_cache built without the engram config (no buffers: the decoder refused the cache)."""
    served = inference.load(engram_run["export"])
    tok = served.tokenizer
    ids = np.concatenate([[tok.bos_id], tok.encode(TEXT)]).astype(np.int32)
    rows = np.stack([ids[:24], ids[2:26]])
    out = generate.Generator(served).generate(rows[:, :6], num_tokens=18, forced=rows[:, 6:])
    np.testing.assert_array_equal(out["tokens"], rows)
    batch = inference.host_rows(served, Batch(inputs=rows, segment_ids=np.ones_like(rows),
                                              positions=np.broadcast_to(np.arange(24), rows.shape)))
    full = np.asarray(scone.batch_logits(served.decoder, jax.tree.map(jnp.asarray, batch.for_device())))
    np.testing.assert_allclose(out["logits"], full[:, 5:23], rtol=1e-4, atol=1e-4)


def test_the_hugging_face_format_refuses_an_engram_run(engram_run, tmp_path):
    from scone_jax.serving import hf_export

    with pytest.raises(ValueError, match="uses Engram"):
        hf_export.export_hf(engram_run["workdir"], str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_the_training_job_refuses_bad_settings_in_one_line_before_writing(tmp_path, tokenizer_path):
    """`python -m scone_jax.main` with Engram beside Over-Encoding, or before a block the model lacks: one line naming
    the key and the fix, exit 2, the workdir left empty."""
    for flags, message in ((["--config.overencoding.enabled=true"], "engram.enabled and overencoding.enabled are "
                                                                      "both set"),
                           (["--config.engram.layers=5"], "engram.layers='5' is not an ascending list of distinct "
                                                           "block indices in [0, 2)")):
        workdir = tmp_path / flags[0].split(".")[-1].split("=")[0]
        result = run_main(workdir, "--config.engram.enabled=true", *flags,
                          config=f"tests/small_config.py:{tokenizer_path}", devices=1)
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr
        assert not workdir.exists() or not any(workdir.iterdir())
