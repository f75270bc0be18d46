"""A real SIGTERM to a training process: it saves where it stopped, exits 143, and a restart
finishes with the parameters and batches of a run that was never interrupted."""
import pytest
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from scone_jax import sharding
from scone_jax.training import checkpoint, state as state_lib, train
from tests.common import REPO, free_port, main_process_argv as cli, small_config, step_records, xla_flags

pytestmark = pytest.mark.slow  # every test here starts processes or runs whole jobs

NUM_STEPS = 8
SIGNAL_AT = 3  # the gated run waits after this step for its SIGTERM
OVERRIDES = {"num_steps": NUM_STEPS, "log_every": 1, "checkpoint_every": 100}

# `python -c GATED_MAIN ARGS` = `python -m scone_jax.main ARGS`, except that after step
# $SCONE_TEST_GATE_STEP the loop waits, through the public Watch.reached, until its SIGTERM handler
# has seen the test's signal, having first created $SCONE_TEST_GATE_FILE to say it is there. So the
# signal lands at that step however fast the steps run or however late the test sends it: no race
# with the end of the run (one that ends first exits 0, or dies of the signal in shutdown) and no
# range of accepted steps.
GATED_MAIN = """
import os, runpy, time
from scone_jax.training import preemption
gate_step, gate_file = int(os.environ["SCONE_TEST_GATE_STEP"]), os.environ["SCONE_TEST_GATE_FILE"]
reached = preemption.Watch.reached

def gated(self, step):
    if step != gate_step:
        return reached(self, step)
    open(gate_file, "w").close()
    deadline = time.monotonic() + 300
    while not reached(self, step):
        if time.monotonic() > deadline:
            raise SystemExit("no SIGTERM came within 300 s")
        time.sleep(0.01)
    return True

preemption.Watch.reached = gated
runpy.run_module("scone_jax.main", run_name="__main__")
"""


def start_cli(tokenizer_path, workdir, gate_file=None):
    """`python -m scone_jax.main` on the small config; with gate_file, gated at SIGNAL_AT (GATED_MAIN)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    args = [f"--config.train.{k}={v}" for k, v in OVERRIDES.items()]
    program = ["-m", "scone_jax.main"]
    if gate_file is not None:
        env.update(SCONE_TEST_GATE_STEP=str(SIGNAL_AT), SCONE_TEST_GATE_FILE=gate_file)
        program = ["-c", GATED_MAIN]
    return subprocess.Popen(
        [sys.executable, *program, f"--config=tests/small_config.py:{tokenizer_path}",
         f"--workdir={workdir}", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_until(proc, done, what, timeout=300):
    """Poll `done()` while `proc` runs; the timeout only bounds a hung run, never judges a healthy one."""
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"training exited early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"training did not get to {what} in {timeout} s"
        time.sleep(0.05)


def wait_for_steps(proc, workdir, count, timeout=300):
    wait_until(proc, lambda: len(step_records(workdir)) >= count, f"step {count}", timeout)


def latest_params(config, workdir):
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    step = ckpt.latest_step()
    state, _ = ckpt.restore(step, state_lib.abstract_with_shardings(spec))
    ckpt.close()
    return step, jax.device_get(jax.tree.leaves(state[0]))


def test_sigterm_saves_exits_143_and_the_restart_matches_an_uninterrupted_run(tokenizer_path, tmp_path):
    """The signal reaches the run while it waits after step SIGNAL_AT (GATED_MAIN), so exactly that step
    is saved. Before the gate, the signal went out once 2 of 24 fast steps were logged, racing the end
    of the run (tried: a 3 s delay before the signal; the old test failed, the run had finished its 24
    steps and died of the signal in shutdown, returncode -15; the gated test passes)."""
    config = small_config()
    config.data.tokenizer_path = tokenizer_path
    config.train.update(OVERRIDES)
    interrupted, straight = str(tmp_path / "interrupted"), str(tmp_path / "straight")
    gate = str(tmp_path / "at_gate")

    proc = start_cli(tokenizer_path, interrupted, gate_file=gate)
    try:
        wait_until(proc, lambda: os.path.exists(gate), f"step {SIGNAL_AT}")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert max(step_records(interrupted)) == SIGNAL_AT
    assert f"saving a checkpoint at step {SIGNAL_AT}" in stderr
    saved_step, _ = latest_params(config, interrupted)
    assert saved_step == SIGNAL_AT

    proc = start_cli(tokenizer_path, interrupted)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"Resumed from step {SIGNAL_AT}" in stderr

    train.run(config, straight)
    a, b = step_records(straight), step_records(interrupted)
    assert sorted(a) == sorted(b) == list(range(1, NUM_STEPS + 1))
    assert [a[s]["batch_crc"] for s in a] == [b[s]["batch_crc"] for s in a]
    (step_a, params_a), (step_b, params_b) = latest_params(config, straight), latest_params(config, interrupted)
    assert step_a == step_b == NUM_STEPS
    for x, y in zip(params_a, params_b):  # the same steps on the same devices: bit for bit
        np.testing.assert_array_equal(x, y)


def test_sigterm_to_one_of_two_processes_stops_both_at_one_checkpointed_step(tokenizer_path, tmp_path):
    """jax's preemption service (not our handler) owns SIGTERM in a multi-process job: the
    signalled process tells the other, both save the same step and exit 143."""

    workdir, port = str(tmp_path / "two"), free_port()
    args = [f"--workdir={workdir}", "--config.train.num_steps=1000", "--config.train.log_every=1",
            "--config.train.checkpoint_every=1000", "--startup_timeout=60"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(cli(tokenizer_path, port, i, 2, *args), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        wait_for_steps(procs[0], workdir, 2)
        procs[1].send_signal(signal.SIGTERM)
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for e in errors]
    stopped_at = max(step_records(workdir))
    assert all(f"saving a checkpoint at step {stopped_at}" in e for e in errors)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == stopped_at < 1000
    ckpt.close()
