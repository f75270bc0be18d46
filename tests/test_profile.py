"""train.profile_steps (training/profile.py): a trace of the chosen steps appears in the workdir, with
the step and input-wait annotations, and training is the same with and without it."""
import gzip
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from scone_jax import config as config_lib
from scone_jax.training import profile
from tests.common import REPO, run_main, small_config, step_records, xla_flags


@pytest.mark.parametrize("value", ["5", "0:3", "4:2", "a:b", "3:"])
def test_a_malformed_profile_range_is_named_before_anything_runs(value):
    config = small_config()
    config.train.profile_steps = value
    with pytest.raises(ValueError, match=r"train.profile_steps=.* is not START:END"):
        config_lib.validate(config)


@pytest.mark.parametrize("value,reached", [("6:6", True), ("5:7", False), ("9:12", False)])
def test_a_profile_range_past_the_last_step_is_refused(value, reached):
    """small_config trains 6 steps: a range ending after step 6 is never (wholly) reached, refused before anything
    runs. Caught: comparing START instead of END with train.num_steps (5:7 accepted)."""
    config = small_config()
    config.train.profile_steps = value
    if reached:
        config_lib.validate(config)
        return
    with pytest.raises(ValueError, match=rf"profile_steps='{value}' ends after train.num_steps=6: the run never "
                                         rf"reaches step {value.split(':')[1]}\. Fix: a range within 1:6"):
        config_lib.validate(config)


def test_a_start_that_trains_none_of_the_range_is_named():
    """The warning line train.run logs at start (training/profile.py's `unreached`): a resume past END, a stop
    (max_steps_per_run) before START; nothing for a start that overlaps the range or trains nothing. Caught: the
    overlap test written `span[0] < last` (a start whose last step is START warned, and it does trace)."""
    assert profile.unreached("10:15", 16, 20) == ("train.profile_steps=10:15: this start trains steps 16 to 20, so "
                                                  "it traces none of them (it resumed past step 15).")
    assert profile.unreached("10:15", 1, 9) == (
        "train.profile_steps=10:15: this start trains steps 1 to 9, so it traces none of them (it stops at step 9 "
        "(train.max_steps_per_run) before step 10: a later start traces them).")
    for first, last in ((1, 10), (15, 20), (11, 12), (1, 30)):
        assert profile.unreached("10:15", first, last) is None, (first, last)
    assert profile.unreached("10:15", 21, 20) is None  # a finished run started again: no step to trace
    assert profile.unreached("", 1, 9) is None


@pytest.mark.slow
def test_profiled_steps_leave_a_trace_and_the_same_losses(tmp_path, tokenizer_path, monkeypatch):
    """Through the CLI, in a process of its own, as a user profiles a job: with JAX_PLATFORMS unset on this CPU
    machine, where the [test] extra installed libtpu (runtime/platforms.py). Caught: main.py not calling
    platforms.skip_absent_tpu (libtpu loaded, its profiler registered: exit 139 in jax.profiler.start_trace,
    "Unexpected PLUGIN_Profiler_Api size"). The plain run (also with JAX_PLATFORMS unset) keeps libtpu's
    warnings off the console (issue 62); caught: main skipping the TPU backend only when it profiles (libtpu's
    TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES lines)."""
    def run(workdir, profile, platforms):
        done = run_main(workdir, "--config.train.num_steps=4", "--config.train.eval_every=0",
                        "--config.train.log_every=1", f"--config.train.profile_steps={profile}",
                        config=f"tests/small_config.py:{tokenizer_path}", platforms=platforms)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "TPU_" not in done.stderr, done.stderr[-3000:]
        return step_records(str(workdir))

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the [test] extra installs it): the condition this test needs")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu starts (and warns) while another holds its lock
    profiled = run(tmp_path / "profiled", "2:3", None)
    plain = run(tmp_path / "plain", "", None)
    np.testing.assert_array_equal([profiled[s]["loss"] for s in range(1, 5)], [plain[s]["loss"] for s in range(1, 5)])
    assert not os.path.exists(tmp_path / "plain" / "profile")
    runs = os.listdir(tmp_path / "profiled" / "profile" / "plugins" / "profile")
    assert len(runs) == 1
    files = os.listdir(tmp_path / "profiled" / "profile" / "plugins" / "profile" / runs[0])
    assert any(f.endswith(".xplane.pb") for f in files)
    trace = next(f for f in files if f.endswith(".trace.json.gz"))
    with gzip.open(tmp_path / "profiled" / "profile" / "plugins" / "profile" / runs[0] / trace) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    assert "input_wait" in names
    steps = {e.get("args", {}).get("step_num") for e in events if e.get("name") == "train"}
    assert steps == {"2", "3"}, steps  # steps 2 and 3 only


@pytest.mark.slow
def test_profiling_where_libtpu_is_loaded_off_a_tpu_is_refused_before_training(tmp_path, tokenizer_path):
    """train.run called from Python after JAX started with JAX_PLATFORMS unset (libtpu loaded, so main.py's skip
    cannot act): one ValueError naming the fix, before the workdir is touched, instead of a segmentation fault at
    the first profiled step. Caught: train.run without profile.check_tracer (the process died with -11)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the [test] extra installs it): the condition this test needs")
    workdir = tmp_path / "w"
    script = "\n".join([
        "import jax",
        "jax.devices()",
        "from scone_jax.training import train",
        "from tests.common import small_config",
        "config = small_config()",
        f"config.data.tokenizer_path = {tokenizer_path!r}",
        "config.train.profile_steps = '1:1'",
        "try:",
        f"    train.run(config, {str(workdir)!r})",
        "except ValueError as e:",
        "    print('refused:', e)",
    ])
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**env, "PYTHONPATH": REPO, "XLA_FLAGS": xla_flags(1)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("refused: train.profile_steps=1:1: this process loaded libtpu (installed here) but runs on the cpu, and "
            "libtpu's profiler crashes jax.profiler outside a TPU. Fix: set JAX_PLATFORMS=cpu") in result.stdout
    assert not workdir.exists()
