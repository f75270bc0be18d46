"""train.profile_steps (training/profile.py): a trace of the chosen steps appears in the workdir, with
the step and input-wait annotations, and training is the same with and without it."""
import gzip
import json
import os

import numpy as np
import pytest

from scone_jax import config as config_lib
from tests.common import run_main, small_config, step_records


@pytest.mark.parametrize("value", ["5", "0:3", "4:2", "a:b", "3:"])
def test_a_malformed_profile_range_is_named_before_anything_runs(value):
    config = small_config()
    config.train.profile_steps = value
    with pytest.raises(ValueError, match=r"train.profile_steps=.* is not START:END"):
        config_lib.validate(config)


@pytest.mark.slow
def test_profiled_steps_leave_a_trace_and_the_same_losses(tmp_path, tokenizer_path):
    """Through the CLI, in a process of its own, as a user profiles a job (and safe from libtpu: a process
    that has loaded it crashes in jax.profiler.start_trace on a CPU host)."""
    def run(workdir, profile):
        done = run_main(workdir, "--config.train.num_steps=4", "--config.train.eval_every=0",
                        "--config.train.log_every=1", f"--config.train.profile_steps={profile}",
                        config=f"tests/small_config.py:{tokenizer_path}")
        assert done.returncode == 0, done.stderr[-3000:]
        return step_records(str(workdir))

    profiled = run(tmp_path / "profiled", "2:3")
    plain = run(tmp_path / "plain", "")
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
