"""End-to-end training: exact resume in a new process, NaN handling, bad input via the CLI."""
import json
import os

import jax
import numpy as np
import pytest

from scone_jax import sharding
from scone_jax.data import tokenizer as tokenizer_lib
from scone_jax.training import assets, checkpoint, state as state_lib, train
from tests.common import REPO, config_with, run_main, small_config, step_records


def final_params(config, workdir):
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    state, _ = ckpt.restore(ckpt.latest_step(), state_lib.abstract_with_shardings(spec))
    ckpt.close()
    return jax.device_get(jax.tree.leaves(state[0]))


@pytest.mark.slow
def test_resume_in_new_process_replays_the_same_batches_and_parameters(tokenizer_path, tmp_path):
    """Two grain worker processes build the batches; interrupted after 3 steps and resumed in a
    new process (where the workers start again at batch 3) == uninterrupted."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    config = config_with(tokenizer_path)
    config.data.worker_count = 2
    train.run(config, straight)
    config = config_with(tokenizer_path, max_steps_per_run=3)
    config.data.worker_count = 2
    train.run(config, split)
    assert checkpoint.Checkpointer(os.path.join(split, "checkpoints")).latest_step() == 3
    # The workdir as a path with '..' (relative to the repository the process runs in): resolved once by main
    # (issue 62; orbax and tensorstore refuse '..' in a local path).
    relative = os.path.relpath(split, REPO)
    assert relative.startswith("..")
    result = run_main(relative, "--config.data.worker_count=2", config=f"tests/small_config.py:{tokenizer_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed from step 3" in result.stderr

    a, b = step_records(straight), step_records(split)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [a[s]["batch_crc"] for s in a] == [b[s]["batch_crc"] for s in a]
    assert len({a[s]["batch_crc"] for s in a}) == 6  # six different batches
    np.testing.assert_allclose([a[s]["loss"] for s in a], [b[s]["loss"] for s in a], rtol=1e-5)
    for x, y in zip(final_params(config, straight), final_params(config, split)):  # same program and devices
        np.testing.assert_array_equal(x, y)


def test_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tokenizer_path, tmp_path):
    config = config_with(tokenizer_path, dict(num_layers=1), learning_rate=1e30, checkpoint_every=1, log_every=1,
                         grad_clip_norm=0.0)  # one block: the stop does not depend on depth
    with pytest.raises(train.NonFiniteLossError, match="Non-finite"):
        train.run(config, str(tmp_path))
    ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
    last_good = ckpt.latest_step()
    ckpt.close()
    assert last_good is not None and last_good < config.train.num_steps
    assert all(np.isfinite(p).all() for p in final_params(config, str(tmp_path)))


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_from_another_tokenizer(tokenizer_path, tmp_path):
    train.run(config_with(tokenizer_path, max_steps_per_run=1), str(tmp_path))
    assets.ensure_tokenizer(_other_vocab_data(), str(tmp_path / "other"))
    config = config_with(str(tmp_path / "other" / "tokenizer.model"))
    with pytest.raises(checkpoint.CheckpointMismatchError, match="tokenizer_fingerprint"):
        train.run(config, str(tmp_path))
    assert checkpoint.Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 1


def _other_vocab_data():
    data = small_config().data
    data.vocab_size = 400
    return data


@pytest.mark.parametrize("args,message", [
    (["--config.model.num_layrs=3"], "Valid keys there: ['attention', 'd_ff', 'd_model'"),
    (["--config.data.source=text", "--config.data.train_files=/nonexistent/*.txt"], "/nonexistent/*.txt"),
])
@pytest.mark.slow
def test_bad_input_is_a_clear_error(tmp_path, args, message):
    result = run_main(str(tmp_path / "w"), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_empty_corpus_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run_main(str(tmp_path / "w"), "--config.data.source=text", f"--config.data.train_files={empty}")
    assert result.returncode == 2
    assert "empty" in result.stderr.lower() and "Traceback" not in result.stderr


def scone_config(tokenizer_path, **scone_overrides):
    config = config_with(tokenizer_path, max_steps_per_run=2, log_every=1)
    config.scone.update({**dict(enabled=True, max_len=4, num_fgrams=2000, min_count=3, fgram_capacity=64,
                                num_layers=1, extract_max_tokens=200_000), **scone_overrides})
    return config


@pytest.mark.slow
def test_scone_training_extracts_fgrams_logs_their_figures_and_pins_the_vocabulary(tokenizer_path, tmp_path):
    workdir = str(tmp_path / "run")
    result = train.run(scone_config(tokenizer_path), workdir)
    assert result["step"] == 2 and np.isfinite(result["loss"])
    assert 0.3 < result["fgram/hit_rate"] <= 1.0
    assert 2.0 <= result["fgram/mean_matched_length"] <= 4.0
    assert 0.0 < result["fgram/unique_ratio"] <= 1.0
    assert result["fgram/model_tokens"] == 8 * 64 * 4  # 8 data shards x U rows x K tokens
    assert 0 < result["fgram/model_grad_norm"] < result["grad_norm"]  # a part of the whole (log_every=1)
    assert os.path.exists(os.path.join(workdir, "fgrams", "vocab.json"))

    other = str(tmp_path / "other_fgrams")
    config = scone_config(tokenizer_path, num_fgrams=500)
    assets.ensure_vocab(config.scone, config.data, tokenizer_lib.Tokenizer.load(tokenizer_path), other)
    config.scone.vocab_path = os.path.join(other, "fgrams")
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"changes .* scone.num_fgrams: 2000 -> 500"):
        train.run(config, workdir)
    # Allowing the config change still leaves the vocabulary itself pinned by its fingerprint.
    with pytest.raises(checkpoint.CheckpointMismatchError, match="fgram_vocab_fingerprint"):
        train.run(config, workdir, allow_config_changes=["scone.num_fgrams"])


@pytest.mark.slow
def test_a_finished_run_extended_past_its_done_step_carries_no_done_until_it_finishes(tokenizer_path, tmp_path,
                                                                                       caplog):
    """A finished 3-step run extended to 5 with max_steps_per_run=1 stops at 4 without DONE (launch/tpu.py babysit
    and tools/bench_quality.py would take it for finished), and writes DONE at 5; the extension's profile range
    (step 5), which its first start never reaches, is named in one warning line at that start. Caught:
    train.run not calling workdir.remove_stale_done (DONE {"step": 3} left at step 4), and the `unreached`
    warning not logged."""
    workdir = str(tmp_path / "run")
    done = os.path.join(workdir, "DONE")
    assert train.run(config_with(tokenizer_path, num_steps=3), workdir)["step"] == 3
    assert json.load(open(done))["step"] == 3
    extended = config_with(tokenizer_path, num_steps=5, max_steps_per_run=1, profile_steps="5:5")
    caplog.clear()
    assert train.run(extended, workdir)["step"] == 4
    assert not os.path.exists(done)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "profile_" in r.getMessage()]
    assert warnings == ["train.profile_steps=5:5: this start trains steps 4 to 4, so it traces none of them (it stops "
                        "at step 4 (train.max_steps_per_run) before step 5: a later start traces them)."]
    assert train.run(config_with(tokenizer_path, num_steps=5), workdir)["step"] == 5
    assert json.load(open(done))["step"] == 5


@pytest.mark.slow
def test_scone_with_accumulation_resumes_exactly(tokenizer_path, tmp_path):
    """SCONE with 2 micro-batches per step, interrupted after 3 of 6 steps and resumed, equals the
    uninterrupted run: the same batches (fingerprints cover the f-gram rows, lengths and slots),
    losses, held-out losses and parameters. Catches a data iterator restored one batch off and
    f-gram arrays rebuilt differently after a restart (e.g. another vocabulary order)."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    overrides = dict(max_steps_per_run=0, grad_accum_steps=2, eval_every=3, checkpoint_every=3)
    config = scone_config(tokenizer_path)
    config.train.update(overrides)
    train.run(config, straight)
    config = scone_config(tokenizer_path)
    config.train.update({**overrides, "max_steps_per_run": 3})
    assert train.run(config, split)["step"] == 3
    # Stopped by max_steps_per_run (exit 0 on the command line): not finished, so no DONE for launchers.
    assert not os.path.exists(os.path.join(split, "DONE"))
    assert train.run(config, split)["step"] == 6
    assert json.load(open(os.path.join(split, "DONE")))["step"] == 6

    a, b = step_records(straight), step_records(split)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [a[s]["batch_crc"] for s in a] == [b[s]["batch_crc"] for s in a]
    assert len({a[s]["batch_crc"] for s in a}) == 6
    np.testing.assert_allclose([a[s]["loss"] for s in a], [b[s]["loss"] for s in a], rtol=1e-6)
    assert all(a[s]["fgram/hit_rate"] == b[s]["fgram/hit_rate"] > 0.3 for s in a)
    ea, eb = step_records(straight, "eval"), step_records(split, "eval")
    assert sorted(ea) == sorted(eb) == [3, 6]
    np.testing.assert_allclose([ea[s]["loss"] for s in ea], [eb[s]["loss"] for s in ea], rtol=1e-6)
    for x, y in zip(final_params(config, straight), final_params(config, split)):  # same program and devices
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_a_bad_document_in_a_worker_stops_the_run_at_a_saved_step(tokenizer_path, tmp_path):
    """A worker process that fails on a document mid-run (a token id outside the vocabulary)
    stops training with one error naming the problem, after saving a checkpoint at the step
    reached; with the document repaired, rerunning resumes there and finishes."""
    from scone_jax.data import documents, packing, sources

    rng = np.random.default_rng(0)
    docs = [rng.integers(10, 400, 5) for _ in range(2000)]
    config = config_with(tokenizer_path, num_steps=8, checkpoint_every=100, max_steps_per_run=0)
    config.data.update(dict(source="arrayrecord", train_files=str(tmp_path / "train.arrayrecord"), worker_count=2))
    # Which batch holds document `bad`: the run's own packing arithmetic, from the lengths alone.
    share = documents.process_share(len(docs), config.data.shuffle_seed, 0, 1)
    stream = packing.Stream(np.full(len(share), 6), seed=config.data.shuffle_seed)
    size = config.data.global_batch_size * config.data.seq_len
    batch_of = {}
    for b in range(config.train.num_steps):
        for local in stream.pieces(b * size, (b + 1) * size).docs:
            batch_of.setdefault(int(share[local]), b)
    bad = next(d for d, b in batch_of.items() if b == 4)
    broken = [d.copy() for d in docs]
    broken[bad][2] = 99999
    sources.write_token_arrayrecord(config.data.train_files, broken)
    workdir = str(tmp_path / "run")
    with pytest.raises(train.InputPipelineError, match=rf"preparing step 5: ValueError: Pre-tokenized document {bad} .*token id 99999.*saved at step 4"):
        train.run(config, workdir)
    assert checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() == 4
    assert sorted(step_records(workdir)) == [1, 2, 3, 4]
    sources.write_token_arrayrecord(config.data.train_files, docs)
    with pytest.raises(checkpoint.CheckpointMismatchError, match="train.arrayrecord changed"):
        train.run(config, workdir)  # the repaired file is other data: resuming on it must be asked for
    assert train.run(config, workdir, allow_config_changes=["data.train_files"])["step"] == 8
    assert sorted(step_records(workdir)) == list(range(1, 9))


def test_a_finished_run_started_again_says_so_and_starts_no_input_pipeline(tokenizer_path, tmp_path, monkeypatch,
                                                                            caplog):
    """Rerunning a finished run (issue 62: it stopped in 17 s, exit 0, without a word) says it has finished and what
    to do, and builds no batch. Caught: the old rerun, which started the data workers and logged nothing more."""
    import logging

    from scone_jax.data import pipeline

    config = config_with(tokenizer_path, num_steps=2, checkpoint_every=2, log_every=1, eval_every=0)
    workdir = str(tmp_path / "run")
    train.run(config, workdir)

    def no_batches(*args, **kwargs):
        raise AssertionError("a finished run started its input pipeline")

    monkeypatch.setattr(pipeline, "make_train_dataset", no_batches)
    with caplog.at_level(logging.INFO):
        assert train.run(config, workdir) == {"step": 2}
    assert "This run has finished: its checkpoint of step 2 is the last of train.num_steps=2" in caplog.text
    assert json.load(open(os.path.join(workdir, "DONE")))["step"] == 2


def test_the_heartbeat_says_the_step_and_eta_between_log_lines():
    """_Heartbeat's ETA is the mean step time since the first step (compilation left out) times the steps left.
    Caught: the ETA over the time since the process started (the minute of compilation counted in every step)."""
    now = [0.0]
    lines = []
    beat = train._Heartbeat(200, clock=lambda: now[0])
    original = train.logging.info
    try:
        train.logging.info = lambda fmt, *args: lines.append(fmt % args)
        beat.beat(1)  # before the first step: silent
        now[0] = 40.0
        beat.started(1)
        now[0] = 50.0
        beat.beat(3)  # 10 s after the last line: silent
        now[0] = 56.0
        beat.beat(5)  # 4 steps in 16 s: 195 left take 780 s
        beat.logged()
        now[0] = 70.0
        beat.beat(8)  # 14 s after the log line: silent
    finally:
        train.logging.info = original
    assert lines == ["step 5/200, ETA 13m00s"]


def test_the_loop_shows_progress_between_its_log_lines(tokenizer_path, tmp_path, monkeypatch, caplog):
    """With log_every past the run's end, the heartbeat (every 0 s here) reports each step but the last, which
    the log line reports. Caught: the loop never calling the heartbeat (only the log_every lines, as before)."""
    import logging

    monkeypatch.setattr(train._Heartbeat, "EVERY_S", 0.0)
    config = config_with(tokenizer_path, num_steps=4, checkpoint_every=4, log_every=100, eval_every=0)
    with caplog.at_level(logging.INFO):
        train.run(config, str(tmp_path / "run"))
    beats = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ") and ", ETA " in
             r.getMessage()]
    assert [b.split(",")[0] for b in beats] == ["step 2/4", "step 3/4"]
