"""SIGINT and SIGTERM during `python -m scone_jax.serving.evaluate` and `.export`: one line saying what stopped
and how to go on, exit 130 / 143 (as the training job), nothing corrupt: a stopped export resumes where it stopped
and ends equal to one never stopped."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from scone_jax.serving import bundle, export
from tests import serving_run
from tests.common import REPO, xla_flags

pytestmark = pytest.mark.slow  # every test here starts a process

GATE = "GATE: waiting for the test's signal"

# `python -c GATED PROGRAM MODULE NAME CALLS ARGS` = `python -m PROGRAM ARGS`, except that the CALLS-th call of
# MODULE.NAME (a function, or Class.method) first prints GATE to stderr and waits for the test's signal: the
# signal lands there, mid-work, however fast or slow the machine. (MODULE is not PROGRAM: runpy runs PROGRAM's
# code afresh, so only what it takes from other modules can be patched.)
GATED = """
import importlib, runpy, sys, time
program, module, name, calls = sys.argv[1:5]
del sys.argv[1:5]
owner = importlib.import_module(module)
*path, attr = name.split(".")
for part in path:
    owner = getattr(owner, part)
real, count = getattr(owner, attr), [0]

def gated(*args, **kwargs):
    count[0] += 1
    if count[0] == int(calls):
        print("%s", file=sys.stderr, flush=True)
        time.sleep(300)
        raise SystemExit("no signal came within 300 s")
    return real(*args, **kwargs)

setattr(owner, attr, gated)
runpy.run_module(program, run_name="__main__", alter_sys=True)
""" % GATE


# `python -c IN_GC PROGRAM MODULE NAME CALLS SIGNAL ARGS`: as GATED, but the CALLS-th call of MODULE.NAME sends SIGNAL
# to the process from inside a garbage collection (a gc callback, as JAX's own) and carries on: the handler runs,
# and raises, inside the collector.
IN_GC = """
import gc, importlib, os, runpy, signal, sys
program, module, name, calls, sig = sys.argv[1:6]
del sys.argv[1:6]
owner = importlib.import_module(module)
*path, attr = name.split(".")
for part in path:
    owner = getattr(owner, part)
real, count, sent = getattr(owner, attr), [0], []

def during_gc(phase, info):
    if phase == "start" and count[0] >= int(calls) and not sent:
        sent.append(1)
        os.kill(os.getpid(), getattr(signal, sig))

def gated(*args, **kwargs):
    count[0] += 1
    if count[0] == int(calls):
        gc.callbacks.append(during_gc)
        gc.collect()
    return real(*args, **kwargs)

setattr(owner, attr, gated)
runpy.run_module(program, run_name="__main__", alter_sys=True)
"""


def run_until_signalled(tmp_path, sig, program: str, gate: tuple, args: list) -> tuple[int, str, str]:
    """Start PROGRAM gated at `gate` (module, name, calls), send `sig` once it printed GATE; (status, stdout,
    stderr without the GATE line)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8)}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", GATED, program, *gate, *args], cwd=REPO, env=env,
                                stdout=stdout, stderr=stderr)
        try:
            deadline = time.monotonic() + 300
            while GATE not in err.read_text():
                assert proc.poll() is None, f"{program} exited before the gate: {err.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"{program} did not reach the gate in 300 s"
                time.sleep(0.05)
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    lines = [line for line in err.read_text().splitlines() if line != GATE]
    return proc.returncode, out.read_text(), "\n".join(lines)


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_evaluate_is_one_line_and_writes_nothing(tmp_path_factory, tmp_path, sig, status):
    """The signal lands after the first eval step is dispatched, while the next batch is prepared. Caught:
    without tool_main's `stopped` (what evaluate had), SIGINT printed a 30-line KeyboardInterrupt traceback (status
    -2); SIGTERM killed the process without a word (status -15)."""
    path = serving_run.exported(tmp_path_factory, "float32")
    text = serving_run.eval_text(tmp_path_factory)
    result = tmp_path / "result.json"
    code, stdout, stderr = run_until_signalled(
        tmp_path, sig, "scone_jax.serving.evaluate", ("scone_jax.runtime.prefetch", "DispatchWindow.add", "2"),
        [f"--export={path}", "--config.data.source=text", f"--config.data.eval_files={text}", f"--result={result}"])
    name = signal.Signals(sig).name
    assert code == status, stderr[-3000:]
    assert stderr == (f"scone_jax.serving.evaluate: stopped by {name}; --result={result} was not written "
                      "(evaluation writes nothing before it ends). Rerun the same command to evaluate."), stderr[-3000:]
    assert "perplexity" not in stdout and sorted(os.listdir(tmp_path)) == ["stderr", "stdout"]  # no result, no temporary


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_handled_inside_a_garbage_collection_stops_evaluate(tmp_path_factory, tmp_path, sig, status):
    """The signal is handled inside a gc callback mid-evaluation (where JAX's own callback made 5 of 7 SIGTERMs
    vanish): evaluate still stops in one line. Caught: tool_main's old handler, raising where the collector drops
    the exception ('Exception ignored in garbage collection callback ... Terminated'; evaluate ran to the end and
    wrote its result, exit 0)."""
    path = serving_run.exported(tmp_path_factory, "float32")
    text = serving_run.eval_text(tmp_path_factory)
    result = tmp_path / "result.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8)}
    name = signal.Signals(sig).name
    done = subprocess.run([sys.executable, "-c", IN_GC, "scone_jax.serving.evaluate", "scone_jax.runtime.prefetch",
                           "DispatchWindow.add", "2", name, f"--export={path}", "--config.data.source=text",
                           f"--config.data.eval_files={text}", f"--result={result}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == status, done.stderr[-3000:]
    assert done.stderr.strip() == (f"scone_jax.serving.evaluate: stopped by {name}; --result={result} was not "
                                   "written (evaluation writes nothing before it ends). Rerun the same command to "
                                   "evaluate."), done.stderr[-3000:]
    assert not result.exists()


def test_sigterm_during_export_is_one_line_and_the_rerun_resumes_to_the_same_bundle(tmp_path_factory, tmp_path):
    """The signal lands once the first 512-row batch's 8 chunks are marked done (before the 9th marker). The stopped bundle is refused by
    readers; the rerun computes only the other three batches and ends equal to an export never stopped. Caught:
    without tool_main's `stopped` (what export had), SIGTERM killed it without a word (status -15)."""
    run = serving_run.trained_run(tmp_path_factory)
    reference = serving_run.exported(tmp_path_factory, "float32")
    output = tmp_path / "export"
    code, _, stderr = run_until_signalled(
        tmp_path, signal.SIGTERM, "scone_jax.serving.export", ("scone_jax.serving.bundle", "done_key", "9"),
        [f"--workdir={run['workdir']}", f"--output={output}", "--dtype=float32", "--chunk_rows=64",
         "--batch_rows=512"])
    assert code == 143, stderr[-3000:]
    [line] = [x for x in stderr.splitlines() if "stopped" in x]
    assert line == ("scone_jax.serving.export: stopped by SIGTERM; 8 of 32 table chunks are "
                    f"written to {output} and kept; readers refuse it until it is complete. Rerun the same command "
                    "to resume: it computes only the rest."), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    with pytest.raises(bundle.BundleError, match="unfinished export"):
        serving_run.ram_table(str(output))

    figures = export.export(run["workdir"], str(output), dtype="float32", chunk_rows=64, batch_rows=512)
    assert figures["rows_computed"] == 2000 - 512
    np.testing.assert_array_equal(serving_run.ram_table(str(output)).gather(np.arange(2000)),
                                  serving_run.ram_table(reference).gather(np.arange(2000)))
    assert bundle.Bundle.open(str(output)).meta["num_fgrams"] == 2000
    assert sorted(os.listdir(output)) == sorted(os.listdir(reference))  # nothing left over from the stop
