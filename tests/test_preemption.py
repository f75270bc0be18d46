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
    second = os.environ.get("SCONE_TEST_SECOND_GATE_FILE")
    if second:  # wait here, after the first signal, for a second one (it must stop the run at once)
        open(second, "w").close()
        time.sleep(300)
        raise SystemExit("no second signal came within 300 s")
    return True

preemption.Watch.reached = gated
runpy.run_module("scone_jax.main", run_name="__main__")
"""


def start_cli(tokenizer_path, workdir, gate_file=None, second_gate_file=None, **overrides):
    """`python -m scone_jax.main` on the small config; with gate_file, gated at SIGNAL_AT (GATED_MAIN), and with
    second_gate_file waiting after the first signal for a second."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    args = [f"--config.train.{k}={v}" for k, v in {**OVERRIDES, **overrides}.items()]
    program = ["-m", "scone_jax.main"]
    if gate_file is not None:
        env.update(SCONE_TEST_GATE_STEP=str(SIGNAL_AT), SCONE_TEST_GATE_FILE=gate_file)
        program = ["-c", GATED_MAIN]
    if second_gate_file is not None:
        env["SCONE_TEST_SECOND_GATE_FILE"] = second_gate_file
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


def signal_one_of_two_processes(tokenizer_path, workdir: str, signum) -> tuple[list[int], list[str], int]:
    """Two processes train on loopback; once step 2 is logged, process 1 gets `signum`. (exit statuses, stderrs,
    the step both stopped at), the latest checkpoint checked to be that step."""
    port = free_port()
    args = [f"--workdir={workdir}", "--config.train.num_steps=1000", "--config.train.log_every=1",
            "--config.train.checkpoint_every=1000", "--startup_timeout=60"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(cli(tokenizer_path, port, i, 2, *args), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        wait_for_steps(procs[0], workdir, 2)
        procs[1].send_signal(signum)
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    stopped_at = max(step_records(workdir))
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == stopped_at < 1000, [e[-2000:] for e in errors]
    ckpt.close()
    return [p.returncode for p in procs], errors, stopped_at


def test_sigterm_to_one_of_two_processes_stops_both_at_one_checkpointed_step(tokenizer_path, tmp_path):
    """jax's preemption service (not our handler) owns SIGTERM in a multi-process job: the
    signalled process tells the other, both save the same step and exit 143."""
    codes, errors, stopped_at = signal_one_of_two_processes(tokenizer_path, str(tmp_path / "two"), signal.SIGTERM)
    assert codes == [143, 143], [e[-2000:] for e in errors]
    assert all(f"saving a checkpoint at step {stopped_at}" in e for e in errors)


def test_ctrl_c_saves_the_step_reached_and_exits_130(tokenizer_path, tmp_path):
    """A Ctrl-C costs no more than a preemption (issue 62): the run finishes the step, saves it and exits 130.
    Caught: the old SIGINT path, KeyboardInterrupt at once with no checkpoint (exit 130, 0 checkpoints; the
    20 steps of the tiny config since its last save lost)."""
    workdir, gate = str(tmp_path / "run"), str(tmp_path / "at_gate")
    proc = start_cli(tokenizer_path, workdir, gate_file=gate)
    try:
        wait_until(proc, lambda: os.path.exists(gate), f"step {SIGNAL_AT}")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert f"Stopped by SIGINT after saving a checkpoint at step {SIGNAL_AT}" in stderr, stderr[-3000:]
    assert "Ctrl-C again to stop at once" in stderr, stderr[-3000:]  # the way out it names (a mutate_diff survivor)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == SIGNAL_AT
    ckpt.close()


def test_a_second_ctrl_c_stops_at_once_and_names_the_checkpoint_kept(tokenizer_path, tmp_path):
    """After the first Ctrl-C the run waits (GATED_MAIN's second gate) where it would finish its step; a second
    Ctrl-C ends it there at once, exit 130, in one line naming the checkpoint kept (step 2, saved by
    checkpoint_every=2), and step 3 is not saved. Caught: a handler that ignored every Ctrl-C after the first
    (the run waited out the gate's 300 s)."""
    workdir, gate, second = str(tmp_path / "run"), str(tmp_path / "at_gate"), str(tmp_path / "second")
    proc = start_cli(tokenizer_path, workdir, gate_file=gate, second_gate_file=second, checkpoint_every=2)
    try:
        wait_until(proc, lambda: os.path.exists(gate), f"step {SIGNAL_AT}")
        proc.send_signal(signal.SIGINT)
        wait_until(proc, lambda: os.path.exists(second), "the second gate")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("scone_jax:")]
    assert lines == ["scone_jax: stopped by SIGINT at once; the checkpoint of step 2 is kept and the workdir is free "
                     "again. Rerun the same command to resume."], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == 2
    ckpt.close()


@pytest.mark.parametrize("program,name", [(["-m", "scone_jax.main", "--config=configs/tiny.py"], "scone_jax"),
                                          (["tools/import_hf.py", "--hf_dir=/nonexistent"], "import_hf")])
def test_ctrl_c_in_the_first_second_stops_in_one_line(tmp_path, program, name):
    """Ctrl-C while `scone_jax.main` or `tools/import_hf.py` still imports its modules (issue 64): one line, exit
    130, no traceback. Caught: the default handler there (two chained tracebacks through the imports, exit 1)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, *program, f"--workdir={tmp_path / 'run'}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # inside the imports (JAX alone takes seconds)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(f"{name}: stopped by SIGINT"), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not os.path.exists(tmp_path / "run")


def test_ctrl_c_to_one_of_two_processes_stops_both_at_one_checkpointed_step(tokenizer_path, tmp_path):
    """In a multi-process job a Ctrl-C is handed to jax's preemption service as SIGTERM: both processes save the
    same step; the interrupted one exits 130, the other 143. Caught: the old KeyboardInterrupt in the one
    process only (the other died on its next collective, nothing saved)."""
    codes, errors, stopped_at = signal_one_of_two_processes(tokenizer_path, str(tmp_path / "two"), signal.SIGINT)
    assert codes == [143, 130], [e[-2000:] for e in errors]
    assert all(f"saving a checkpoint at step {stopped_at}" in e for e in errors)
