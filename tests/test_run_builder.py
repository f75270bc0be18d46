"""training/run.py: the one builder of a run (the training loop and the tools take its Run)."""
import jax
import numpy as np
import pytest

from scone_jax import sharding
from scone_jax.data import pipeline
from scone_jax.training import checkpoint, run as run_lib
from tests.common import config_with


def scone_config(tokenizer_path, **train_overrides):
    # One decoder block: what the builder reads and restores does not depend on depth.
    config = config_with(tokenizer_path, dict(num_layers=1),
                         **(dict(num_steps=3, checkpoint_every=3) | train_overrides))
    config.scone.update(dict(enabled=True, max_len=3, fgram_capacity=96, num_layers=1, num_fgrams=2000,
                             min_count=2, extract_max_tokens=200_000))
    return config


@pytest.fixture(scope="module")
def trained(tokenizer_path, tmp_path_factory):
    """A SCONE run's workdir with one checkpoint, at step 3, saved as the loop saves it (run.save_initial_state:
    the run's state and Run.meta); what build restores does not depend on the steps that led there, so none
    are compiled."""
    workdir = str(tmp_path_factory.mktemp("run"))
    run_lib.save_initial_state(scone_config(tokenizer_path), workdir, 3)
    return workdir


def test_build_resumes_the_checkpoint_reading_its_metadata_once(tokenizer_path, trained, monkeypatch):
    """build() on a workdir with a checkpoint: its step, its metadata and state, the training data from that step
    on; the metadata is read once (the resume check, the layout check and the restore's fingerprint check used to
    read it three times). Caught: _restore_newest_good not passing the metadata it has (two reads), and
    Checkpointer.restore ignoring the metadata it is given (three)."""
    reads = []
    read = checkpoint.Checkpointer.read_checkpoint_meta
    monkeypatch.setattr(checkpoint.Checkpointer, "read_checkpoint_meta",
                        lambda self, step: reads.append(step) or read(self, step))
    config = scone_config(tokenizer_path, num_steps=6)
    mesh = sharding.make_mesh(config.mesh)
    run = run_lib.build(config, trained, mesh)
    try:
        assert reads == [3]
        assert run.step == 3 and run.restored["step"] == 3
        assert run.restored["tokenizer_fingerprint"] == run.tokenizer.fingerprint == run.expect["tokenizer_fingerprint"]
        assert run.restored["fgram_vocab_fingerprint"] == run.vocab.fingerprint
        saved, _ = run.checkpointer.restore(3, run.abstract.state)
        for a, b in zip(jax.tree.leaves(run.state), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # The training data continues at batch 3 (one batch per step), f-grams added.
        [first] = pipeline.first_batches(run.train_data, 1)
        want = pipeline.batch_builder(config.data, run.tokenizer, batch_transform=run.batcher)(3)
        np.testing.assert_array_equal(first.inputs, want.inputs)
        np.testing.assert_array_equal(first.fgram_tokens, want.fgram_tokens)
    finally:
        run.close()


def test_the_abstract_run_has_a_real_batch_and_state_shapes(tokenizer_path, tmp_path):
    """Run.abstract (what aot_compile lowers) against the real thing: the device batch the loop sends (with
    gradient accumulation, so each data shard's f-grams come in two groups) and the fresh state, array by array
    in shape, dtype and sharding; build_abstract sizes model.vocab_size 0 as a run does for a tokenizer of
    data.vocab_size pieces. Caught: abstract_batch leaving out train.grad_accum_steps (one group of U rows per
    shard instead of two of U/2)."""
    config = scone_config(tokenizer_path, grad_accum_steps=2)
    mesh = sharding.make_mesh(config.mesh)
    run = run_lib.build(config, str(tmp_path), mesh, start=run_lib.FRESH)
    assert run.step == 0 and run.restored is None and run.checkpointer is None
    [host] = pipeline.first_batches(run.train_data, 1)
    real = sharding.global_batch(host.for_device(), mesh)
    abstract = run.abstract

    def described(tree):
        return [(jax.tree_util.keystr(p), x.shape, np.dtype(x.dtype), x.sharding)
                for p, x in jax.tree_util.tree_leaves_with_path(tree)]

    assert described(abstract.batch) == described(real)
    assert abstract.batch.fgram_tokens.shape == (8 * 2, 48, 3)
    assert described(abstract.state) == described(run.state)
    unsized = scone_config(tokenizer_path, grad_accum_steps=2)
    unsized.model.vocab_size = 0
    assert described(run_lib.build_abstract(unsized, mesh).state) == described(run.state)
    assert unsized.model.vocab_size == 512
