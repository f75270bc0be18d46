"""launch/tpu.py: the printed gcloud commands, bad input, the babysitter's recovery, and launch/worker.sh.

Nothing here reaches Google Cloud: commands are only printed (--dry-run) or handed to
fakes, and the shell tests put fake gcloud/curl/python first on PATH.
"""
import importlib.util
import os
import pathlib
import shlex
import stat
import subprocess
import sys
import time

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parent.parent / "launch"
_spec = importlib.util.spec_from_file_location("launch_tpu", LAUNCH / "tpu.py")
tpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tpu)

V5P = ["--name=scone-v5p", "--zone=us-east5-a", "--project=my-project"]
V5E = ["--name=scone-v5e", "--zone=us-west4-a", "--project=my-project", "--num_slices=2"]
JOB = ["--config=configs/tiny.py", "--workdir=gs://my-bucket/runs/exp1"]


def dry_run(capsys, *argv) -> list[list[str]]:
    """Runs the CLI with --dry-run and returns the printed commands, split back into argv lists."""
    assert tpu.main([*argv, "--dry-run"]) == 0
    return [shlex.split(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]


def remote(command: list[str]) -> str:
    """The shell command an ssh command runs on the workers."""
    [flag] = [arg for arg in command if arg.startswith("--command=")]
    return flag.removeprefix("--command=")


def test_v5p_64_spot_commands(capsys):
    [create] = dry_run(capsys, "create", *V5P, "--accelerator_type=v5p-64", "--spot")
    assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "scone-v5p"]
    assert {"--accelerator-type=v5p-64", "--runtime-version=v2-alpha-tpuv5", "--node-id=scone-v5p", "--spot",
            "--zone=us-east5-a", "--project=my-project"} <= set(create)

    pack, scp, unpack = dry_run(capsys, "sync", *V5P)
    assert pack[:2] == ["bash", "-c"] and "git -C" in pack[2] and "ls-files" in pack[2]
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "scone-v5p:/tmp/scone_jax.tar.gz" in scp
    [setup] = dry_run(capsys, "setup", *V5P)
    assert 'pip install --python=$HOME/scone_jax_venv/bin/python -e ".[tpu]"' in remote(setup)
    [run] = dry_run(capsys, "run", *V5P, *JOB, "--config.train.num_steps=1000")
    for command in (scp, unpack, setup, run):
        assert "--worker=all" in command and "--zone=us-east5-a" in command and "--project=my-project" in command
    assert run[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "scone-v5p"]
    assert remote(run) == (
        "cd $HOME/scone_jax && nohup bash launch/worker.sh gs://my-bucket/runs/exp1 0 "
        "$HOME/scone_jax_venv/bin/python -m scone_jax.main --config=configs/tiny.py "
        "--workdir=gs://my-bucket/runs/exp1 --config.train.num_steps=1000 > /dev/null 2>&1 < /dev/null &")

    [logs] = dry_run(capsys, "logs", *V5P, "--worker=3", "--follow")
    assert "--worker=3" in logs and remote(logs) == "tail -n 100 -F $HOME/scone_jax.log"
    [delete] = dry_run(capsys, "delete", *V5P)
    assert delete[:6] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "scone-v5p"]
    assert "--force" in delete and "--quiet" in delete


def test_export_runs_on_every_worker_of_every_slice_in_the_foreground(capsys):
    out = ["--workdir=gs://my-bucket/runs/exp1", "--output=gs://my-bucket/exports/exp1"]
    exports = dry_run(capsys, "export", *V5E, *out, "--dtype=float32")
    assert [c[5] for c in exports] == ["scone-v5e-0", "scone-v5e-1"]
    for command in exports:
        assert "--worker=all" in command
        assert remote(command) == (
            "cd $HOME/scone_jax && $HOME/scone_jax_venv/bin/python -m scone_jax.serving.export "
            "--workdir=gs://my-bucket/runs/exp1 --output=gs://my-bucket/exports/exp1 --dtype=float32")


def test_two_v5e_256_slices(capsys):
    [create] = dry_run(capsys, "create", *V5E, "--accelerator_type=v5e-256", "--reserved")
    assert {"--accelerator-type=v5litepod-256", "--runtime-version=v2-alpha-tpuv5-lite", "--node-count=2",
            "--node-prefix=scone-v5e", "--reserved"} <= set(create)
    assert not any(arg.startswith("--node-id") for arg in create)

    sync = dry_run(capsys, "sync", *V5E)
    assert [c[6] if c[4] == "scp" else c[5] for c in sync[1:]] == [
        "scone-v5e-0:/tmp/scone_jax.tar.gz", "scone-v5e-0", "scone-v5e-1:/tmp/scone_jax.tar.gz", "scone-v5e-1"]
    setup = dry_run(capsys, "setup", *V5E)
    assert [c[5] for c in setup] == ["scone-v5e-0", "scone-v5e-1"]
    run = dry_run(capsys, "run", *V5E, *JOB)
    assert [c[5] for c in run] == ["scone-v5e-0", "scone-v5e-1"]
    assert all("--worker=all" in c for c in sync[1:] + setup + run)
    # The same training command on both slices; only the slice index given to worker.sh differs.
    assert remote(run[1]) == remote(run[0]).replace("runs/exp1 0 ", "runs/exp1 1 ", 1)


def test_cli_runs_as_a_script_and_executes_nothing_when_dry(tmp_path):
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path}/gcloud-ran\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, str(LAUNCH / "tpu.py"), "babysit", *V5P, *JOB, "--accelerator_type=v5p-64", "--dry-run"],
        capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert "queued-resources describe scone-v5p '--format=value(state.state)'" in result.stdout
    assert "gcloud storage ls gs://my-bucket/runs/exp1/DONE" in result.stdout
    assert not (tmp_path / "gcloud-ran").exists()


@pytest.mark.parametrize("argv, message", [
    (["create", *V5P, "--accelerator_type=v3-8"], "unknown accelerator type 'v3-8'; valid types are v4-N"),
    (["create", *V5P, "--accelerator_type=v5e-512"], "v5e-N (N chips: 1, 4, 8, 16, 32, 64, 128 or 256)"),
    (["create", *V5P, "--accelerator_type=v5p-64", "--spot", "--reserved"], "not allowed with argument --spot"),
    (["run", *V5P, "--config=configs/tiny.py"], "the following arguments are required: --workdir"),
    (["run", *V5P, "--config=c", "--workdir=/tmp/run"], "--workdir: must be on GCS (gs://BUCKET/...)"),
    (["sync", *V5P, "--config.train.num_steps=1"], "unrecognized arguments: --config.train.num_steps=1"),
    (["run", *V5P, *JOB, "--workers=all"], "unrecognized arguments: --workers=all"),
    (["export", *V5P, "--workdir=gs://b/run", "--output=exports/run"], "--output: must be on GCS"),
])
def test_bad_input_is_a_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        tpu.main([*argv, "--dry-run"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_run_id_names_a_directory_under_workdir(capsys):
    [run] = dry_run(capsys, "run", *V5P, "--config=c", "--workdir=gs://my-bucket/runs/", "--run_id=exp2")
    assert "--workdir=gs://my-bucket/runs/exp2" in remote(run)


class FakeCloud:
    """Plays the queued resource's state, one per poll; 'DONE' means the run wrote its marker."""

    def __init__(self, states, fail_first_ssh=False):
        self.states, self.polls, self.executed, self.slept = list(states), 0, [], []
        self.fail_first_ssh = fail_first_ssh

    def run_done(self):
        return self.states[self.polls] == "DONE"

    def state_of(self):
        self.polls += 1
        return self.states[self.polls - 1]

    def execute(self, commands):
        for command in commands:
            if self.fail_first_ssh and "ssh" in command:
                self.fail_first_ssh = False
                raise tpu.LaunchError("ssh: connection refused")
            self.executed.append(command)

    def babysit(self, **overrides):
        settings = tpu.Settings(name="scone-v5p", zone="us-east5-a", accelerator_type="v5p-64", capacity="spot",
                                config="configs/tiny.py", workdir="gs://my-bucket/runs/exp1", **overrides)
        return tpu.babysit(settings, self.execute, self.state_of, self.run_done, self.slept.append, lambda _: None)

    def verbs(self):
        """create, delete, scp, ssh for gcloud commands; the program's name for the others."""
        return [c[4] if c[0] == "gcloud" else c[0] for c in self.executed]


def test_babysit_recreates_a_preempted_slice_once_and_resumes_the_same_run():
    cloud = FakeCloud(["ACTIVE", "ACTIVE", "PREEMPTED", "ACTIVE", "DONE"])
    assert cloud.babysit() == 1
    assert cloud.verbs() == ["delete", "create", "bash", "scp", "ssh", "ssh", "ssh"]
    rerun = remote(cloud.executed[-1])
    assert "--workdir=gs://my-bucket/runs/exp1" in rerun and "worker.sh gs://my-bucket/runs/exp1 0" in rerun
    assert cloud.slept == [60] * 4


def test_babysit_waits_for_active_and_retries_a_failed_relaunch():
    cloud = FakeCloud(["SUSPENDED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE", "ACTIVE", "ACTIVE", "DONE"],
                      fail_first_ssh=True)
    assert cloud.babysit(poll_seconds=30) == 1
    # The first relaunch failed at its first ssh; the next poll ran the whole relaunch again, and only once.
    assert cloud.verbs() == ["delete", "create", "bash", "scp", "bash", "scp", "ssh", "ssh", "ssh"]
    assert cloud.slept == [30] * 6


def test_babysit_gives_up_after_max_restarts():
    cloud = FakeCloud(["SUSPENDED", "ACTIVE", "FAILED", "ACTIVE", "SUSPENDED"])
    with pytest.raises(tpu.LaunchError, match="SUSPENDED again after 2 restarts"):
        cloud.babysit(max_restarts=2)
    assert cloud.verbs().count("create") == 2


def test_babysit_creates_a_missing_slice_without_deleting_it():
    cloud = FakeCloud([tpu.NOT_FOUND, "ACTIVE", "DONE"])
    assert cloud.babysit() == 1
    assert cloud.verbs()[:2] == ["create", "bash"]


@pytest.fixture
def worker_vm(tmp_path):
    """A fake TPU VM home: the checkout's launch/ dir, fake curl/gcloud/python, and a local dir as the bucket."""
    home, bucket, bin_ = tmp_path / "home", tmp_path / "bucket", tmp_path / "bin"
    (home / "scone_jax").mkdir(parents=True)
    (home / "scone_jax" / "launch").symlink_to(LAUNCH)
    fakes = {
        "curl": "echo \"$FAKE_WORKER\"",
        # gcloud storage cp SRC|- gs://PATH  ->  $FAKE_BUCKET/PATH
        "gcloud": 'dest="$FAKE_BUCKET/${4#gs://}"; mkdir -p "$(dirname "$dest")"; '
                  'if [ "$3" = - ]; then cat > "$dest"; else cp "$3" "$dest"; fi',
        "python": 'echo "python $*"; exit "$FAKE_STATUS"',
    }
    for name, body in fakes.items():
        path = bin_ / name if name != "python" else home / "scone_jax_venv" / "bin" / "python"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    env = {"HOME": str(home), "PATH": f"{bin_}:/usr/bin:/bin", "FAKE_BUCKET": str(bucket),
           "FAKE_WORKER": "0", "FAKE_STATUS": "0"}
    return env, bucket / "my-bucket" / "runs" / "exp1"


def test_run_command_starts_worker_sh_detached_and_uploads_the_log(capsys, worker_vm):
    env, workdir = worker_vm
    [run] = dry_run(capsys, "run", *V5P, *JOB)
    started = time.monotonic()
    subprocess.run(["bash", "-c", remote(run)], env=env, check=True, timeout=10)  # as ssh would run it
    log = workdir / "logs" / "slice-0-worker-0.log"
    while not log.exists() and time.monotonic() - started < 60:  # a hang's bound, not a speed test
        time.sleep(0.05)
    assert log.read_text() == "python -m scone_jax.main --config=configs/tiny.py --workdir=gs://my-bucket/runs/exp1\n"


@pytest.mark.parametrize("worker, slice_, status", [("0", "0", 0), ("0", "0", 3), ("2", "0", 0), ("0", "1", 0)])
def test_worker_sh_never_writes_done_the_run_does(worker_vm, worker, slice_, status):
    """Exit status 0 is not 'finished': a run stopped by train.max_steps_per_run exits 0 too, and babysit
    then stopped an unfinished run (the defect). DONE is the training program's (test_train.py)."""
    env, workdir = worker_vm
    env.update(FAKE_WORKER=worker, FAKE_STATUS=str(status))
    result = subprocess.run(["bash", str(LAUNCH / "worker.sh"), "gs://my-bucket/runs/exp1", slice_, "python", "step"],
                            env={**env, "PATH": f"{env['HOME']}/scone_jax_venv/bin:{env['PATH']}"}, timeout=10)
    assert result.returncode == status
    assert (workdir / "logs" / f"slice-{slice_}-worker-{worker}.log").read_text() == "python step\n"
    assert not (workdir / "DONE").exists()
