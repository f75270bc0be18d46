"""An Over-Encoding run (docs/method.md §8) exported and served the way a user serves it: its n-gram tables travel in
the bundle's decoder, the host computes every batch's n-gram ids, serving.evaluate's perplexity equals training's
evaluation of the same text, and cached generation equals a full forward pass; bad settings stop the job at once.
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scone_jax import sharding
from scone_jax.batch import Batch
from scone_jax.model import scone
from scone_jax.serving import evaluate, export, generate, inference
from scone_jax.training import assets, checkpoint, evaluation, run as run_lib, state as state_lib, steps
from tests import serving_run
from tests.common import run_main, small_config

TEXT = "And God said, Let there be light: and there was light. And God saw the light, that it was good"


def oe_run_config(tokenizer_path):
    # init_std 0.5: an untrained model whose logits are far from uniform, so a wrong input shows in the perplexity.
    config = small_config(init_std=0.5)
    with config.unlocked():
        config.data.tokenizer_path = tokenizer_path
        config.train.update(dict(num_steps=2, checkpoint_every=2, log_every=1))
        config.overencoding.update(dict(enabled=True, n=3, k=2, m=1001))
    return config


@pytest.fixture(scope="module")
def oe_run(tmp_path_factory, tokenizer_path):
    """A workdir holding the initial state of an Over-Encoding run as a checkpoint, and its export."""
    root = tmp_path_factory.mktemp("oe_run")
    config = oe_run_config(tokenizer_path)
    workdir, path = str(root / "run"), str(root / "export")
    tokenizer, _ = run_lib.save_initial_state(config, workdir, 1)
    export.export(workdir, path, dtype="float32", chunk_rows=64, batch_rows=512)
    return {"config": config, "workdir": workdir, "export": path, "tokenizer": tokenizer}


def training_eval(oe_run, text, with_ids=True):
    """Training's held-out evaluation of the checkpoint: the eval step the loop runs, the loader's n-gram ids."""
    config = oe_run["config"].copy_and_resolve_references()
    with config.unlocked():
        config.data.update(dict(source="text", eval_files=text))
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(oe_run["workdir"], "checkpoints"))
    state, _ = ckpt.restore(ckpt.latest_step(), state_lib.abstract_with_shardings(spec))
    ckpt.close()
    from scone_jax.data import pipeline

    batches = pipeline.make_eval_batches(config.data, oe_run["tokenizer"], process_index=0, process_count=1)
    step = functools.partial(steps.make_eval_step(spec.model_graphdef, spec.model_shardings, mesh), state[0])
    return evaluation.evaluate(step, batches, mesh,
                               rows=assets.ngram_hasher(config, oe_run["tokenizer"]) if with_ids else None)


def test_served_perplexity_equals_training_evaluation(oe_run, tmp_path_factory):
    """The bundle's decoder holds the tables (no f-gram table beside it) and serving.evaluate, hashing each batch's
    n-grams on the host, gives training's held-out perplexity of the same text (float32: equal to ~1e-6). Caught:
    inference.load_decoder building the decoder without its overencoding section (the restore refused the
    bundle's extra arrays); host_rows leaving the n-gram ids out (refused: the decoder needs them)."""
    text = serving_run.eval_text(tmp_path_factory)
    meta = json.load(open(os.path.join(oe_run["export"], "export.json")))
    assert meta["num_fgrams"] == 0 and meta["config"]["overencoding"]["enabled"]
    served = inference.load(oe_run["export"])
    assert served.hasher is not None
    assert served.params["overencoding"]["ngram_tables"]["embedding"].shape == (4096, 16)
    data = evaluate.data_config(served, {"data.source": "text", "data.eval_files": text}).data
    result = evaluate.evaluate(served, data)
    want = training_eval(oe_run, text)
    assert result["tokens"] == want["tokens"] > 10_000 and result["hit_rate"] == want["hit_rate"] == 0.0
    np.testing.assert_allclose(result["perplexity"], want["perplexity"], rtol=1e-5)
    # the ids are the decoder's input: without the table's (absent) rows they still reach it
    np.testing.assert_allclose(evaluate.evaluate(served, data, use_table=False)["perplexity"], want["perplexity"],
                               rtol=1e-5)
    with pytest.raises(ValueError, match="carries no ngram_ids"):
        training_eval(oe_run, text, with_ids=False)


def test_cached_generation_equals_a_full_forward_pass(oe_run):
    """Generation with the KV cache: each new token's ids come from the last n-1 tokens the host keeps
    (NgramHasher.next_ids), and the logits equal the full pass's over the whole sequence. Caught: next_ids given the
    new token alone (no history: every n-gram id of the steps 0; max |diff| far above 1e-4)."""
    served = inference.load(oe_run["export"])
    tok = served.tokenizer
    ids = np.concatenate([[tok.bos_id], tok.encode(TEXT)]).astype(np.int32)
    rows = np.stack([ids[:24], ids[2:26]])
    out = generate.Generator(served).generate(rows[:, :6], num_tokens=18, forced=rows[:, 6:])
    np.testing.assert_array_equal(out["tokens"], rows)
    batch = inference.host_rows(served, Batch(inputs=rows, segment_ids=np.ones_like(rows),
                                              positions=np.broadcast_to(np.arange(24), rows.shape)))
    assert (batch.ngram_ids[:, 6:] > 0).all()  # every generated position has its n-grams
    full = np.asarray(scone.batch_logits(served.decoder, jax.tree.map(jnp.asarray, batch.for_device())))
    np.testing.assert_allclose(out["logits"], full[:, 5:23], rtol=1e-4, atol=1e-4)


def test_the_hugging_face_format_refuses_an_over_encoding_run(oe_run, tmp_path):
    from scone_jax.serving import hf_export

    with pytest.raises(ValueError, match="no Hugging Face family has its n-gram tables"):
        hf_export.export_hf(oe_run["workdir"], str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_the_training_job_refuses_bad_settings_in_one_line_before_writing(tmp_path, tokenizer_path):
    """`python -m scone_jax.main` with an m that shares a factor with model.vocab_size (512), or with SCONE beside
    Over-Encoding: one line naming the key and the fix, exit 2, the workdir left empty."""
    for flags, message in ((["--config.overencoding.m=1000"], "overencoding.m=1000 gives table 0 the modulus "
                                                               "m + 2*0 = 1,000, which shares the factor 8"),
                           (["--config.scone.enabled=true"], "overencoding.enabled and scone.enabled are both set")):
        workdir = tmp_path / flags[0].split(".")[-1].split("=")[0]
        result = run_main(workdir, "--config.overencoding.enabled=true", *flags,
                          config=f"tests/small_config.py:{tokenizer_path}", devices=1)
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr
        assert not workdir.exists() or not any(workdir.iterdir())
