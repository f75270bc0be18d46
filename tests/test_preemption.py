"""A real SIGTERM to a training process: it saves where it stopped, exits 143, and a restart
finishes with the parameters and batches of a run that was never interrupted."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from scone_jax import checkpoint, sharding, state as state_lib, train
from scone_jax.data import tokenizer as tokenizer_lib
from tests.common import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 24  # enough that the signal lands mid-run: it is sent once two steps are logged
OVERRIDES = {"num_steps": NUM_STEPS, "log_every": 1, "checkpoint_every": 100}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("tok"))
    tokenizer_lib.ensure_tokenizer(small_config().data, workdir)
    return os.path.join(workdir, "tokenizer.model")


def start_cli(tokenizer_path, workdir):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    args = [f"--config.train.{k}={v}" for k, v in OVERRIDES.items()]
    return subprocess.Popen(
        [sys.executable, "-m", "scone_jax.main", f"--config=tests/small_config.py:{tokenizer_path}",
         f"--workdir={workdir}", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def step_records(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return {r["step"]: r for r in rows if r["split"] == "step"}


def wait_for_steps(proc, workdir, count, timeout=180):
    deadline = time.monotonic() + timeout
    while len(step_records(workdir)) < count:
        assert proc.poll() is None, f"training exited early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "training logged no steps in time"
        time.sleep(0.05)


def latest_params(config, workdir):
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    step = ckpt.latest_step()
    state, _ = ckpt.restore(step, state_lib.abstract_with_shardings(spec))
    ckpt.close()
    return step, jax.device_get(jax.tree.leaves(state[0]))


def test_sigterm_saves_exits_143_and_the_restart_matches_an_uninterrupted_run(tokenizer_path, tmp_path):
    config = small_config()
    config.data.tokenizer_path = tokenizer_path
    config.train.update(OVERRIDES)
    interrupted, straight = str(tmp_path / "interrupted"), str(tmp_path / "straight")

    proc = start_cli(tokenizer_path, interrupted)
    try:
        wait_for_steps(proc, interrupted, 2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    stopped_at = max(step_records(interrupted))
    assert 2 <= stopped_at < NUM_STEPS
    assert f"saving a checkpoint at step {stopped_at}" in stderr
    saved_step, _ = latest_params(config, interrupted)
    assert saved_step == stopped_at

    proc = start_cli(tokenizer_path, interrupted)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"Resumed from step {stopped_at}" in stderr

    train.run(config, straight)
    a, b = step_records(straight), step_records(interrupted)
    assert sorted(a) == sorted(b) == list(range(1, NUM_STEPS + 1))
    assert [a[s]["batch_crc"] for s in a] == [b[s]["batch_crc"] for s in a]
    (step_a, params_a), (step_b, params_b) = latest_params(config, straight), latest_params(config, interrupted)
    assert step_a == step_b == NUM_STEPS
    for x, y in zip(params_a, params_b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_sigterm_to_one_of_two_processes_stops_both_at_one_checkpointed_step(tokenizer_path, tmp_path):
    """jax's preemption service (not our handler) owns SIGTERM in a multi-process job: the
    signalled process tells the other, both save the same step and exit 143."""
    from tests.test_multihost import cli, free_port  # the two-process launch helpers

    workdir, port = str(tmp_path / "two"), free_port()
    args = [f"--workdir={workdir}", "--config.train.num_steps=1000", "--config.train.log_every=1",
            "--config.train.checkpoint_every=1000", "--startup_timeout=60"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
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
