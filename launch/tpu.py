"""Train scone_jax on a Cloud TPU pod: create, sync, setup, run, logs, babysit, export, delete.

Every subcommand turns its flags into gcloud commands and runs them one by one,
stopping at the first failure. With --dry-run it prints them instead (one per
line, shell-quoted), so you can read or paste exactly what would happen. It
needs only Python and the gcloud CLI on your machine (`gcloud auth login` done).

From zero, one v5p-64 slice on spot capacity:

  # 0. Once per project: the TPU API, TPU quota in the zone, and a bucket near it.
  gcloud services enable tpu.googleapis.com --project=my-project
  gcloud storage buckets create gs://my-bucket --location=us-east5 --project=my-project

  ARGS="--name=scone-v5p --zone=us-east5-a --project=my-project"
  JOB="--config=configs/tiny.py --workdir=gs://my-bucket/runs/exp1"  # any config in configs/

  # 1. Ask for the slice. A queued resource waits for capacity; check it with
  #    gcloud compute tpus queued-resources describe scone-v5p --zone=us-east5-a
  #    and go on once its state is ACTIVE.
  python launch/tpu.py create $ARGS --accelerator_type=v5p-64 --spot
  # 2. Copy the checkout to every worker: the files `git ls-files` lists, as they
  #    are on disk now (so `git add` a new file first).
  python launch/tpu.py sync $ARGS
  # 3. Install scone_jax[tpu] in a Python 3.11 venv on every worker. Once per
  #    slice: the install is editable, so later syncs need no reinstall.
  python launch/tpu.py setup $ARGS
  # 4. Start training on every worker, detached from ssh. Each worker's log is
  #    copied to gs://my-bucket/runs/exp1/logs/ every minute and at exit.
  #    Flags --config.FIELD=VALUE after $JOB are passed on to scone_jax.main.
  python launch/tpu.py run $ARGS $JOB
  # 5. Read a worker's log (--worker=all for every worker, --follow to keep reading).
  python launch/tpu.py logs $ARGS --worker=0
  # 6. Leave a babysitter running: when spot capacity is taken back it deletes and
  #    recreates the slice, syncs, sets up and reruns the same workdir, so
  #    training resumes from its latest checkpoint. It stops once the run writes
  #    gs://my-bucket/runs/exp1/DONE, or after --max_restarts recreations.
  python launch/tpu.py babysit $ARGS --accelerator_type=v5p-64 --spot $JOB
  # 7. Once DONE: export the table and decoder for serving, on every worker at once
  #    (waits until it has finished; rerun it to resume an interrupted export).
  python launch/tpu.py export $ARGS --workdir=gs://my-bucket/runs/exp1 \
      --output=gs://my-bucket/exports/exp1
  # 8. Release the slice (and stop paying for it).
  python launch/tpu.py delete $ARGS

Two v5e-256 slices (multislice): the same steps with --num_slices=2 in every
command and --accelerator_type=v5e-256.

  ARGS="--name=scone-v5e --zone=us-west4-a --project=my-project --num_slices=2"
  python launch/tpu.py create $ARGS --accelerator_type=v5e-256 --reserved
  python launch/tpu.py sync $ARGS && python launch/tpu.py setup $ARGS
  python launch/tpu.py run $ARGS $JOB

The queued resource then holds the nodes scone-v5e-0 and scone-v5e-1, and every
command after create addresses every worker of both. Nothing extra is set for
the job: on a multislice queued resource the TPU runtime sets the MEGASCALE_*
variables that JAX uses to join the slices over the data-center network, and
scone_jax.main starts jax.distributed from the TPU environment as on one slice.

--workdir is the run's directory on GCS: every worker must reach it, and the
TPU VMs' service account needs write access to the bucket. With --run_id it is
a parent: --workdir=gs://my-bucket/runs --run_id=exp1 means
gs://my-bucket/runs/exp1. Running the same workdir again resumes that run.
"""
import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import time
from typing import Callable, Sequence

Command = list[str]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the checkout and its venv live on each worker ($HOME expands there).
REMOTE_CHECKOUT = "$HOME/scone_jax"
REMOTE_VENV = "$HOME/scone_jax_venv"
REMOTE_TARBALL = "/tmp/scone_jax.tar.gz"
REMOTE_LOG = "$HOME/scone_jax.log"  # written by launch/worker.sh
# jax 0.10 needs Python >= 3.11 and TPU VM images ship 3.10, so setup lets uv fetch one.
REMOTE_PYTHON = "3.11"

# Queued-resource states after which the slice is gone and must be recreated. A
# preempted spot slice shows SUSPENDING then SUSPENDED; PREEMPTED is the node-level
# word for the same event.
DEAD_STATES = frozenset({"FAILED", "SUSPENDING", "SUSPENDED", "PREEMPTED"})
NOT_FOUND = "NOT_FOUND"  # what the babysitter calls a queued resource that describe cannot find


class LaunchError(Exception):
    """A gcloud command failed or the babysitter gave up; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Generation:
    gcloud_prefix: str  # the accelerator-type prefix gcloud expects
    runtime_version: str  # the default TPU VM image for this generation
    sizes: str  # what N counts and which values are valid, for error messages
    valid_size: Callable[[int], bool]


_CORE_SIZES = "TensorCores, a multiple of 8", lambda n: n >= 8 and n % 8 == 0  # 2 per chip, 4 chips per host
_CHIP_SIZES = "chips: 1, 4, 8, 16, 32, 64, 128 or 256", lambda n: n in (1, 4, 8, 16, 32, 64, 128, 256)
GENERATIONS = {
    "v4": Generation("v4", "tpu-ubuntu2204-base", *_CORE_SIZES),
    "v5e": Generation("v5litepod", "v2-alpha-tpuv5-lite", *_CHIP_SIZES),
    "v5p": Generation("v5p", "v2-alpha-tpuv5", *_CORE_SIZES),
    "v6e": Generation("v6e", "v2-alpha-tpuv6e", *_CHIP_SIZES),
}


def parse_accelerator(text: str) -> tuple[Generation, int]:
    """Splits 'v5e-256' (or gcloud's 'v5litepod-256') into its generation and size, or says what is valid."""
    name, _, size = text.lower().partition("-")
    if name == "v5litepod":
        name = "v5e"
    generation = GENERATIONS.get(name)
    if generation is None or not size.isdigit() or not generation.valid_size(int(size)):
        valid = ", ".join(f"{n}-N (N {g.sizes})" for n, g in GENERATIONS.items())
        raise ValueError(f"unknown accelerator type {text!r}; valid types are {valid}. "
                         "For example v5p-64 or v5e-256 (gcloud's v5litepod-256).")
    return generation, int(size)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the commands depend on; each subcommand uses the fields it needs."""
    name: str
    zone: str | None = None  # None: gcloud's configured default
    project: str | None = None
    num_slices: int = 1
    accelerator_type: str | None = None  # as the user wrote it, e.g. v5e-256
    capacity: str = "on-demand"  # or "spot", "reserved"
    runtime_version: str | None = None  # None: the generation's default
    workdir: str | None = None  # the run's directory, gs://...
    config: str | None = None
    output: str | None = None  # for export: the bundle's directory, gs://...
    dtype: str = "bfloat16"  # for export: the table's dtype
    overrides: tuple[str, ...] = ()  # --config.FIELD=VALUE flags passed on to scone_jax.main
    worker: str = "0"  # for logs: a worker index or "all"
    follow: bool = False
    max_restarts: int = 10
    poll_seconds: int = 60

    @property
    def nodes(self) -> list[str]:
        """TPU VM node names: gcloud names multislice nodes PREFIX-0, PREFIX-1, ..."""
        if self.num_slices == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(self.num_slices)]


def _gcloud(s: Settings, *args: str) -> Command:
    """A gcloud command with the zone and project flags that every TPU command takes."""
    location = [f"--{k}={v}" for k, v in (("zone", s.zone), ("project", s.project)) if v]
    return ["gcloud", *args, *location]


def _ssh(s: Settings, node: str, command: str, worker: str = "all") -> Command:
    return _gcloud(s, "compute", "tpus", "tpu-vm", "ssh", node, f"--worker={worker}") + [f"--command={command}"]


def create_commands(s: Settings) -> list[Command]:
    """Requests the slice(s) as one queued resource, so multislice capacity arrives all at once."""
    generation, size = parse_accelerator(s.accelerator_type)
    command = _gcloud(
        s, "compute", "tpus", "queued-resources", "create", s.name,
        f"--accelerator-type={generation.gcloud_prefix}-{size}",
        f"--runtime-version={s.runtime_version or generation.runtime_version}")
    if s.num_slices == 1:
        command.append(f"--node-id={s.name}")
    else:
        command += [f"--node-count={s.num_slices}", f"--node-prefix={s.name}"]
    if s.capacity != "on-demand":
        command.append(f"--{s.capacity}")
    return [command]


def sync_commands(s: Settings) -> list[Command]:
    """Copies the tracked files only (`git ls-files`), so no local venv, data or checkpoints travel.

    The old checkout is replaced rather than merged, so files deleted here disappear there too.
    """
    tarball = f"/tmp/scone_jax-{s.name}.tar.gz"
    root = shlex.quote(REPO_ROOT)
    commands = [["bash", "-c", f"git -C {root} ls-files -z | tar -czf {shlex.quote(tarball)} -C {root} --null -T -"]]
    checkout = REMOTE_CHECKOUT
    unpack = f"rm -rf {checkout} && mkdir -p {checkout} && tar -xzf {REMOTE_TARBALL} -C {checkout}"
    for node in s.nodes:
        commands.append(
            _gcloud(s, "compute", "tpus", "tpu-vm", "scp", tarball, f"{node}:{REMOTE_TARBALL}", "--worker=all"))
        commands.append(_ssh(s, node, unpack))
    return commands


def setup_commands(s: Settings) -> list[Command]:
    """Installs the synced checkout, editable, into a venv on every worker of every slice."""
    # PIP_BREAK_SYSTEM_PACKAGES lets a --user install through on images whose pip guards the system Python.
    uv = "$HOME/.local/bin/uv"
    install = (
        "PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --user --quiet uv"
        f" && {uv} venv --allow-existing --python={REMOTE_PYTHON} {REMOTE_VENV}"
        f" && cd {REMOTE_CHECKOUT} && {uv} pip install --python={REMOTE_VENV}/bin/python -e \".[tpu]\"")
    return [_ssh(s, node, install) for node in s.nodes]


def run_commands(s: Settings) -> list[Command]:
    """Starts the same training command on every worker of every slice, detached from ssh.

    launch/worker.sh wraps it: the log goes to the workdir on GCS, and a finished run writes DONE.
    """
    train = f"{REMOTE_VENV}/bin/python -m scone_jax.main " + shlex.join(
        [f"--config={s.config}", f"--workdir={s.workdir}", *s.overrides])
    return [
        _ssh(s, node, f"cd {REMOTE_CHECKOUT} && nohup bash launch/worker.sh {shlex.quote(s.workdir)} {i} {train}"
                      " > /dev/null 2>&1 < /dev/null &")
        for i, node in enumerate(s.nodes)]


def export_commands(s: Settings) -> list[Command]:
    """Runs scone_jax.serving.export on every worker of every slice in the foreground: each process joins
    the job from the TPU environment, computes rows on its chips and writes its own chunks."""
    export = f"{REMOTE_VENV}/bin/python -m scone_jax.serving.export " + shlex.join(
        [f"--workdir={s.workdir}", f"--output={s.output}", f"--dtype={s.dtype}"])
    return [_ssh(s, node, f"cd {REMOTE_CHECKOUT} && {export}") for node in s.nodes]


def logs_commands(s: Settings) -> list[Command]:
    """Tails the local log of one worker (or all) on every slice; the GCS copy lags by up to a minute."""
    tail = f"tail -n 100 {'-F ' if s.follow else ''}{REMOTE_LOG}"
    return [_ssh(s, node, tail, worker=s.worker) for node in s.nodes]


def delete_commands(s: Settings) -> list[Command]:
    """Deletes the queued resource together with its nodes, without asking."""
    return [_gcloud(s, "compute", "tpus", "queued-resources", "delete", s.name, "--force", "--quiet")]


def state_command(s: Settings) -> Command:
    return _gcloud(s, "compute", "tpus", "queued-resources", "describe", s.name, "--format=value(state.state)")


def done_command(s: Settings) -> Command:
    return ["gcloud", "storage", "ls", f"{s.workdir}/DONE"]


def babysit(s: Settings, execute: Callable[[list[Command]], None], state_of: Callable[[], str],
            run_done: Callable[[], bool], sleep: Callable[[float], None],
            log: Callable[[str], None]) -> int:
    """Keeps the run alive until it writes DONE; returns how many times the slice was recreated.

    Once per poll: a dead or missing slice is requested again; when the new one
    is ACTIVE the code is synced, installed and the same run is started again
    (same workdir, so training resumes from its latest checkpoint). A failed
    command is retried at the next poll. Recreations and failures are each
    bounded by --max_restarts, so a slice that keeps dying or a command that
    keeps failing ends the babysitter instead of looping forever. It watches the
    slice, not the process: a run that crashes on a healthy slice is for `logs`.
    """
    restarts = failures = 0

    def attempt(commands: list[Command]) -> bool:
        nonlocal failures
        try:
            execute(commands)
            return True
        except LaunchError as error:
            failures += 1
            if failures > s.max_restarts:
                raise
            log(f"{error}; trying again after the next poll")
            return False

    relaunch_pending = False
    while not run_done():
        state = state_of()
        if state in DEAD_STATES or state == NOT_FOUND:
            if restarts == s.max_restarts:
                raise LaunchError(f"{s.name} is {state} again after {restarts} restarts (--max_restarts); giving up")
            restarts += 1
            log(f"{s.name} is {state}: requesting it again (restart {restarts} of at most {s.max_restarts})")
            delete = delete_commands(s) if state != NOT_FOUND else []
            relaunch_pending = attempt(delete + create_commands(s)) or relaunch_pending
        elif state == "ACTIVE" and relaunch_pending:
            log(f"{s.name} is ACTIVE again: syncing, installing and resuming {s.workdir}")
            relaunch_pending = not attempt(sync_commands(s) + setup_commands(s) + run_commands(s))
        else:
            log(f"{s.name} is {state}")
        sleep(s.poll_seconds)
    log(f"{s.workdir}/DONE exists: the run has finished. Release the slice with `delete`.")
    return restarts


def execute(commands: Sequence[Command], dry_run: bool) -> None:
    """Prints the commands (dry run) or runs them in order, stopping at the first that fails."""
    for argv in commands:
        if dry_run:
            print(shlex.join(argv))
            continue
        print(f"+ {shlex.join(argv)}", file=sys.stderr, flush=True)
        try:
            status = subprocess.run(argv, check=False).returncode
        except FileNotFoundError as error:
            raise LaunchError(f"{argv[0]} is not on PATH ({error}); install the Google Cloud CLI") from error
        if status != 0:
            raise LaunchError(f"this command failed with exit status {status}: {shlex.join(argv)}")


def _query(argv: Command) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def _run_babysit(s: Settings, dry_run: bool) -> None:
    if dry_run:  # There is no state to watch: show what one cycle would run.
        print(f"# every {s.poll_seconds} s, until the second command succeeds:")
        execute([state_command(s), done_command(s)], dry_run=True)
        print(f"# when the state is {' or '.join(sorted(DEAD_STATES))} ({NOT_FOUND}: the same without delete):")
        execute(delete_commands(s) + create_commands(s), dry_run=True)
        print("# then, once the state is ACTIVE:")
        execute(sync_commands(s) + setup_commands(s) + run_commands(s), dry_run=True)
        return

    def state_of() -> str:
        result = _query(state_command(s))
        if result.returncode == 0:
            return result.stdout.strip()
        return NOT_FOUND if NOT_FOUND in result.stderr else f"UNKNOWN ({result.stderr.strip()})"

    def log(message: str) -> None:
        print(time.strftime("%Y-%m-%d %H:%M:%S"), message, file=sys.stderr, flush=True)

    babysit(s, lambda commands: execute(commands, dry_run=False), state_of,
            lambda: _query(done_command(s)).returncode == 0, time.sleep, log)


def _checked(convert: Callable[[str], object], ok: Callable, message: str) -> Callable[[str], object]:
    """An argparse type that converts a flag's text and rejects values failing `ok` with `message`."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{message}, got {text!r}")
        return value
    return parse


def _accelerator_type(text: str) -> str:
    try:
        parse_accelerator(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", required=True, help="queued resource name (and node prefix for multislice)")
    common.add_argument("--zone", help="default: gcloud's compute/zone setting")
    common.add_argument("--project", help="default: gcloud's core/project setting")
    common.add_argument("--num_slices", type=_checked(int, lambda n: n >= 1, "must be at least 1"), default=1,
                        help="slices in the queued resource (multislice if > 1)")
    common.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                        help="print the commands instead of running them")

    slice_ = argparse.ArgumentParser(add_help=False)
    slice_.add_argument("--accelerator_type", required=True, type=_accelerator_type,
                        help="GENERATION-SIZE: v4-N, v5e-N (v5litepod-N), v5p-N or v6e-N, e.g. v5p-64, v5e-256")
    slice_.add_argument("--runtime_version", help="TPU VM image; default: the generation's")
    capacity = slice_.add_mutually_exclusive_group()
    capacity.add_argument("--spot", dest="capacity", action="store_const", const="spot", default="on-demand",
                          help="spot capacity: cheaper, can be taken back at any time (see babysit)")
    capacity.add_argument("--reserved", dest="capacity", action="store_const", const="reserved",
                          help="capacity from the project's reservation")

    job = argparse.ArgumentParser(add_help=False)
    on_gcs = _checked(str, lambda path: path.startswith("gs://"), "must be on GCS (gs://BUCKET/...) for every worker")
    job.add_argument("--workdir", required=True, type=on_gcs, help="the run's directory, gs://BUCKET/runs/RUN_ID")
    job.add_argument("--run_id", help="if given, the run's directory is WORKDIR/RUN_ID")
    job.add_argument("--config", required=True, help="config file and variant, e.g. configs/tiny.py")

    parser = argparse.ArgumentParser(
        prog="launch/tpu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("create", parents=[common, slice_], help="request the slice(s) as a queued resource")
    commands.add_parser("sync", parents=[common], help="copy the tracked files to every worker")
    commands.add_parser("setup", parents=[common], help="install scone_jax[tpu] on every worker")
    commands.add_parser("run", parents=[common, job], help="start training on every worker")
    logs = commands.add_parser("logs", parents=[common], help="tail a worker's log")
    logs.add_argument("--worker", default="0", help="worker index within each slice, or 'all'")
    logs.add_argument("--follow", action="store_true", help="keep printing as the log grows")
    babysit_ = commands.add_parser("babysit", parents=[common, slice_, job],
                                   help="recreate a preempted slice and resume the run until it is DONE")
    babysit_.add_argument("--max_restarts", type=_checked(int, lambda n: n >= 0, "must be 0 or more"), default=10,
                          help="give up after this many recreations (or this many failed commands)")
    babysit_.add_argument("--poll_seconds", type=_checked(int, lambda n: 10 <= n <= 600, "must be 10 to 600"),
                          default=60, help="seconds between state checks")
    export = commands.add_parser("export", parents=[common],
                                 help="export a finished run's f-gram table and decoder on every worker")
    export.add_argument("--workdir", required=True, type=on_gcs, help="the run's directory, gs://BUCKET/runs/RUN_ID")
    export.add_argument("--output", required=True, type=on_gcs, help="the bundle's directory, gs://BUCKET/exports/...")
    export.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the table's dtype")
    commands.add_parser("delete", parents=[common], help="delete the queued resource and its nodes")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # Unknown flags are --config.FIELD=VALUE overrides for scone_jax.main; anything else is a typo.
    args, overrides = parser.parse_known_args(argv)
    passed_on = args.command in ("run", "babysit") and all(o.startswith("--config.") for o in overrides)
    if overrides and not passed_on:
        parser.error(f"unrecognized arguments: {' '.join(overrides)} "
                     "(only run and babysit take --config.FIELD=VALUE, for scone_jax.main)")
    if getattr(args, "run_id", None):
        args.workdir = f"{args.workdir.rstrip('/')}/{args.run_id}"
    fields = {f.name for f in dataclasses.fields(Settings)}
    settings = Settings(**{k: v for k, v in vars(args).items() if k in fields}, overrides=tuple(overrides))

    builders = {"create": create_commands, "sync": sync_commands, "setup": setup_commands,
                "run": run_commands, "logs": logs_commands, "export": export_commands, "delete": delete_commands}
    try:
        if args.command == "babysit":
            _run_babysit(settings, args.dry_run)
        else:
            execute(builders[args.command](settings), args.dry_run)
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
