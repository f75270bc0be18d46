"""Two JAX processes on loopback (4 CPU devices each, gloo collectives) against one process
with 8 devices: the same losses, every held-out token counted once, and checkpoints that
move between the two worlds. Then the export CLI on two processes against a one-process export, and the ways a job can
fail to form, each within a deadline.

The data pipeline gives each process its own documents, so a two-process run does not see
the one-process run's batches; these tests feed fixed global batches instead (each process
its block of rows), which isolates what multi-process changes: assembly and collectives.
"""
import json
import os
import sys
import time

import jax
import numpy as np
import pytest

from scone_jax.data import pipeline, tokenizer as tokenizer_lib
from scone_jax.serving import bundle, inference
from tests import multihost_worker as worker, serving_run
from tests.common import free_port, main_process_argv as cli, processes_report, run_processes

pytestmark = pytest.mark.slow  # every test here starts processes or runs whole jobs


def run_workers(task: str, tokenizer_path: str, workdir: str) -> None:
    port = free_port()
    argvs = [[sys.executable, "-m", "tests.multihost_worker", task, str(port), str(i), "2", tokenizer_path, workdir]
             for i in range(2)]
    results = run_processes(argvs)
    assert all(r.returncode == 0 for r in results), processes_report(results)


@pytest.fixture(scope="module")
def one_process(tokenizer_path, tmp_path_factory):
    """The reference: the worker's train task in this process (1 process, 8 devices)."""
    workdir = str(tmp_path_factory.mktemp("one"))
    state, losses, ev = worker.train_steps(worker.make_config(tokenizer_path), workdir)
    return workdir, jax.device_get(jax.tree.leaves(state[0])), losses, ev


@pytest.fixture(scope="module")
def two_processes(tokenizer_path, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("two"))
    run_workers("train", tokenizer_path, workdir)
    with open(os.path.join(workdir, "train.json")) as f:
        return workdir, json.load(f)


def test_processes_exit_cleanly_while_the_failure_watcher_polls(tokenizer_path, tmp_path):
    """The watcher thread is stopped before jax shuts its client down. Caught: without the atexit
    stop, the daemon watcher was inside jaxlib at finalization and 3 of 4 such jobs aborted
    ("FATAL: exception not rethrown", status -6); CI saw it once with the normal 0.2 s poll."""
    for _ in range(4):
        run_workers("exit", tokenizer_path, str(tmp_path))


def test_two_processes_train_and_evaluate_like_one_with_the_same_devices(one_process, two_processes, tokenizer_path):
    _, _, losses, ev = one_process
    _, result = two_processes
    assert (result["processes"], result["devices"]) == (2, 8) and jax.device_count() == 8
    assert len(set(losses)) == worker.NUM_STEPS  # the steps really trained
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    # Each process packs only its own documents, so rows (and the loss) differ slightly; the
    # target tokens are all counted, each once.
    data = worker.make_config(tokenizer_path).data
    held_out = pipeline.make_eval_batches(data, tokenizer_lib.Tokenizer.load(tokenizer_path)).num_tokens
    assert result["eval"]["tokens"] == ev["tokens"] == held_out
    np.testing.assert_allclose(result["eval"]["loss"], ev["loss"], rtol=0.02)


def test_checkpoint_from_two_processes_restores_in_one(one_process, two_processes, tokenizer_path):
    _, params, _, _ = one_process
    state, meta = worker.restore(worker.make_config(tokenizer_path), two_processes[0])
    assert meta["process_count"] == 2
    # Gradient sums in another order differ in the last bits; Adam turns that into ~1e-6 moves
    # of parameters whose gradients are near zero. One step moves parameters by ~lr = 3e-3.
    for got, want in zip(jax.device_get(jax.tree.leaves(state[0])), params):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_checkpoint_from_one_process_restores_in_two(one_process, tokenizer_path):
    workdir, params, _, _ = one_process
    run_workers("restore", tokenizer_path, workdir)
    restored = np.load(os.path.join(workdir, "restored.npz"))
    assert len(restored.files) == len(params)
    for i, want in enumerate(params):
        np.testing.assert_array_equal(restored[f"arr_{i}"], want)


def test_two_processes_train_scone_through_the_real_pipeline_like_one(tokenizer_path, tmp_path):
    """Two processes, each reading its own documents through the grain pipeline and deduplicating
    f-grams for its 4 data shards (2 micro-batches each), train like one process fed the same
    rows (both processes' pipelines side by side, the f-gram arrays of 8 shards concatenated).
    Catches a process that deduplicates as if it held all 8 shards (seen: the workers stop),
    and any f-gram group that lands beside rows of another process in the global batch.
    (Swapping the two processes' blocks wholesale is no bug: groups are self-contained.)"""
    from scone_jax.fgram.dedup import FgramBatcher
    from scone_jax.fgram.matcher import Matcher
    from scone_jax.training import assets

    workdir = str(tmp_path)
    config = worker.scone_config(tokenizer_path, workdir)
    tokenizer = tokenizer_lib.Tokenizer.load(tokenizer_path)
    with config.unlocked():
        config.scone.vocab_path = ""
    vocab = assets.ensure_vocab(config.scone, config.data, tokenizer, workdir)  # into workdir/fgrams
    run_workers("scone", tokenizer_path, workdir)
    with open(os.path.join(workdir, "scone.json")) as f:
        result = json.load(f)
    assert result["local_shards"] == 4

    config = worker.scone_config(tokenizer_path, workdir)
    batcher = FgramBatcher(Matcher(vocab), vocab, num_shards=4, capacity=64, micro_batches=2)
    pipelines = [worker.scone_pipeline(config, tokenizer, batcher, p, 2) for p in range(2)]

    def side_by_side():
        while True:
            parts = [next(it) for it in pipelines]
            yield jax.tree.map(lambda *rows: np.concatenate(rows), *parts)

    losses = worker.scone_train_steps(config, side_by_side())
    for it in pipelines:
        it.close()
    assert len(set(losses)) == worker.NUM_STEPS
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_peer_that_never_arrives_fails_within_the_timeout(tokenizer_path, tmp_path, process_id):
    """Process 0 alone waits for process 1; process 1 alone finds no coordinator."""
    start = time.monotonic()
    [r] = run_processes([cli(tokenizer_path, free_port(), process_id, 2, f"--workdir={tmp_path}",
                             "--startup_timeout=5")], timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Not all processes joined the JAX job" in r.stderr and "within 5 s" in r.stderr
    assert time.monotonic() - start < 30  # 5 s plus interpreter and JAX start-up


def test_mismatched_process_counts_are_a_clear_error_on_both_sides(tokenizer_path, tmp_path):
    port = free_port()
    results = run_processes([cli(tokenizer_path, port, 0, 2, f"--workdir={tmp_path}", "--startup_timeout=30"),
                             cli(tokenizer_path, port, 1, 3, f"--workdir={tmp_path}", "--startup_timeout=30")],
                            timeout=90)
    for r in results:
        assert r.returncode == 2, r.stderr[-2000:]
        assert "process 0 was started with --num_processes=2 but process 1 with --num_processes=3" in r.stderr
        assert "Traceback" not in r.stderr


def test_an_unreachable_bucket_workdir_fails_fast(tokenizer_path):
    """No credentials or network for gs:// here: a clear error within the startup timeout,
    not a minute of storage-client retries and tracebacks at the first checkpoint."""
    start = time.monotonic()
    [r] = run_processes([cli(tokenizer_path, free_port(), 0, 1, "--workdir=gs://scone-jax-no-such-bucket/run",
                             "--startup_timeout=3")], timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--workdir=gs://scone-jax-no-such-bucket/run" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - start < 30


def test_a_mesh_that_does_not_divide_the_devices_is_a_clear_error(tokenizer_path, tmp_path):
    [r] = run_processes([cli(tokenizer_path, free_port(), 0, 1, f"--workdir={tmp_path}", "--config.mesh.data=3")],
                        timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Mesh (data, fsdp, tensor) = (3, 1, 1) does not divide the 4 devices" in r.stderr
    assert "Traceback" not in r.stderr


def test_export_from_two_processes_equals_the_one_process_export(tmp_path_factory, tmp_path):
    """The export CLI on 2 processes x 4 devices writes the same bundle, row for row, as
    export.export in this process (1 x 8 devices): each process wrote only its own rows."""
    run = serving_run.trained_run(tmp_path_factory)
    reference = serving_run.exported(tmp_path_factory, "float32")
    output, port = str(tmp_path / "export"), free_port()
    argvs = [[sys.executable, "-m", "scone_jax.serving.export", f"--workdir={run['workdir']}", f"--output={output}",
              "--dtype=float32", "--chunk_rows=64", "--batch_rows=512", f"--coordinator_address=127.0.0.1:{port}",
              "--num_processes=2", f"--process_id={i}", "--startup_timeout=60"] for i in range(2)]
    results = run_processes(argvs)
    assert all(r.returncode == 0 for r in results), processes_report(results)
    assert "exported 2,000 f-grams" in results[0].stdout and "exported" not in results[1].stdout
    got, want = bundle.Bundle.open(output).meta, bundle.Bundle.open(reference).meta
    assert got == want  # same fingerprints of model, vocabulary and tokenizer; same shape and dtype
    rows = np.arange(run["vocab"].num_fgrams)
    np.testing.assert_array_equal(serving_run.ram_table(output).gather(rows), serving_run.ram_table(reference).gather(rows))
    assert sorted(os.listdir(os.path.join(output, "done"))) == sorted(os.listdir(os.path.join(reference, "done")))
    # The decoder both processes saved hashes to the fingerprint the table was exported with.
    assert inference.load(output).bundle.meta["model_fingerprint"] == want["model_fingerprint"]


def _job_with_exit_times(argvs, timeout=240):
    """Start every argv at once (4 virtual CPU devices each); (CompletedProcess, seconds from the start to its exit)
    for each; all killed if any outlives `timeout`."""
    import subprocess

    from tests.common import REPO, xla_flags

    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    procs = [subprocess.Popen(a, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argvs]
    ended = [None] * len(procs)
    try:
        while None in ended and time.monotonic() < start + timeout:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.monotonic() - start
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = [subprocess.CompletedProcess(a, p.returncode, *p.communicate()) for a, p in zip(argvs, procs)]
    return results, ended


def _assert_failed_as_one(results, ended, failing: int, cause: str, program: str = "scone_jax"):
    """Every process exits 2 within 30 s of the failing one, with one error line naming it and the cause, and no
    traceback, gloo deadline or C++ stack."""
    report = processes_report(results)
    assert None not in ended, report
    assert [r.returncode for r in results] == [2] * len(results), report
    assert max(ended) - ended[failing] < 30, (ended, report)
    for i, r in enumerate(results):
        errors = [line for line in r.stderr.splitlines() if ": error: " in line and line.split(":")[0] in
                  (program, "scone_jax")]
        assert len(errors) == 1, report
        want = f"{program}: error: process {failing}: " if i == failing else \
            f"scone_jax: error: process {failing} of the job stopped: "
        assert errors[0].startswith(want) and cause in errors[0], report
        for noise in ("Traceback", "DEADLINE_EXCEEDED", "*** ", "Check failure", "Fatal Python error"):
            assert noise not in r.stderr, report


@pytest.mark.parametrize("failing", [1, 0])
def test_bad_input_on_one_process_after_joining_stops_the_whole_job_in_one_line(tokenizer_path, tmp_path, failing):
    """One process's training files match nothing (found after jax.distributed joined): it publishes its line, and
    the other, waiting for it in a collective, stops within seconds with that line, the workdir released (process
    0 holds its lease; it also hosts the coordination service, so when it fails it waits until the other has read
    the line). Bug it caught: the failing process left 72 s later (jax's shutdown barrier) and the other died after
    ~30 s with a 29-line gloo DEADLINE_EXCEEDED traceback that never named the cause."""
    port, workdir = free_port(), tmp_path / "w"
    missing = tmp_path / "nowhere" / "*.txt"
    bad = ["--config.data.source=text", f"--config.data.train_files={missing}"]
    argvs = [cli(tokenizer_path, port, i, 2, f"--workdir={workdir}", "--startup_timeout=60",
                 *(bad if i == failing else [])) for i in range(2)]
    results, ended = _job_with_exit_times(argvs)
    _assert_failed_as_one(results, ended, failing, f"No files match the pattern '{missing}'")
    assert not (workdir / "OWNER").exists()  # process 0 released the workdir on its way out


def test_bad_input_on_one_process_before_joining_stops_the_whole_job_in_one_line(tokenizer_path, tmp_path):
    """Process 1's --workdir cannot be written (found before joining): it joins only to publish its line, and
    process 0, waiting in jax.distributed for it, stops with that line at once. Bug it caught: process 0 waited
    out --startup_timeout and blamed a peer that never arrived."""
    port, blocked = free_port(), tmp_path / "a_file"
    blocked.write_text("")
    argvs = [cli(tokenizer_path, port, 0, 2, f"--workdir={tmp_path / 'w'}", "--startup_timeout=120"),
             cli(tokenizer_path, port, 1, 2, f"--workdir={blocked}/w", "--startup_timeout=120")]
    results, ended = _job_with_exit_times(argvs)
    _assert_failed_as_one(results, ended, 1, f"--workdir={blocked}/w")
    assert max(ended) < 100  # not the 120 s join timeout


@pytest.mark.parametrize("when", ["before joining", "after joining"])
def test_bad_input_on_one_host_stops_a_two_process_import_in_one_line(tmp_path, when):
    """tools/import_hf.py on two processes. Before joining: process 1's --hf_dir is missing (its host never got its
    copy). After joining: process 1's --workdir already holds a run (found by import_checkpoint, through tool_main).
    Either is published, and both processes stop at once. Bug it caught: process 1 exited alone and process 0
    waited out --startup_timeout (before joining: blaming a peer that never joined)."""
    from tests import hf_models

    source, workdir, port = str(tmp_path / "hf"), str(tmp_path / "run"), free_port()
    hf_models.save_checkpoint(source, "llama")
    missing, taken = str(tmp_path / "not_copied"), tmp_path / "taken"
    (taken / "checkpoints" / "5").mkdir(parents=True)
    (taken / "checkpoints" / "5" / "state").write_text("")
    bad = [f"--hf_dir={missing}", f"--workdir={workdir}"] if when == "before joining" else \
        [f"--hf_dir={source}", f"--workdir={taken}"]
    argvs = [[sys.executable, "tools/import_hf.py", *(bad if i else [f"--hf_dir={source}", f"--workdir={workdir}"]),
              f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
              "--startup_timeout=120"] for i in range(2)]
    results, ended = _job_with_exit_times(argvs)
    cause = f"{missing} is not a directory" if when == "before joining" else f"{taken} already holds a run"
    _assert_failed_as_one(results, ended, 1, cause, program="import_hf")
    assert max(ended) < 100 and not os.path.exists(os.path.join(workdir, "checkpoints", "0"))
