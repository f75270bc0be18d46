"""The state of tools/bench_quality.py's runs on disk: whether a run finished, and whether one is in use.

A run is WORKDIR/<arm>/lr<rate>/, a workdir of `python -m scone_jax.main`, started by `run_cli` (which
also starts export and evaluate). The study exports, scores and records a run only once it has finished: a
job stopped early exits 0 too (train.max_steps_per_run), and a run recorded as finished is never trained
again.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

from scone_jax.runtime import ownership, parent_watch, workdir as workdir_layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def last_step(workdir: str) -> int:
    """The step of the last training record in the run's metrics.jsonl (0 if it has none)."""
    last = 0
    path = os.path.join(workdir, workdir_layout.METRICS)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line) if line.endswith("\n") else {}  # a last line being written: skipped
                if record.get("split") == "step":
                    last = record["step"]
    return last


def done_step(workdir: str) -> int | None:
    """The step the run's DONE marker names (training/train.py writes it at train.num_steps), None without one."""
    try:
        with open(os.path.join(workdir, workdir_layout.DONE)) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError):
        return -1  # not a marker the run wrote: not finished


def unfinished(workdir: str, num_steps: int) -> str | None:
    """Why the run in `workdir` has not finished its `num_steps` steps, None if it has: its last step and its
    DONE marker must both be num_steps."""
    last, done = last_step(workdir), done_step(workdir)
    if last != num_steps:
        return f"its last step is {last} of {num_steps}"
    if done != num_steps:
        return f"it trained {num_steps} steps but has no DONE marker for step {num_steps}"
    return None


def runs_in_use(root: str, arms: list[str]) -> list[str]:
    """"<arm>/lr<rate> (owner)" of every run of `arms` under `root` that a live process holds (its workdir lease,
    runtime/ownership.py: a training job, or an export)."""
    busy = []
    for arm in arms:
        for run in sorted(glob.glob(os.path.join(glob.escape(root), glob.escape(arm), "lr*"))):
            owner = ownership.live_owner(run) if os.path.exists(os.path.join(run, workdir_layout.OWNER)) else None
            if owner:
                busy.append(f"{arm}/{os.path.basename(run)} ({owner})")
    return busy


def forget_unfinished_runs(study: "Study") -> None:
    """Drop the records of this invocation's runs whose workdir holds an unfinished run (recorded by a
    bench_quality that took a job's exit 0 for the end of training), so that they resume; say so per run."""
    for key, record in sorted(study.results["runs"].items()):
        if record["arm"] not in study.arms:
            continue
        workdir = study.run_dir(record["arm"], key.split("/lr", 1)[1])
        saved = read_json(os.path.join(workdir, workdir_layout.CONFIG))
        if saved is None:  # results without their runs (copied elsewhere): nothing to resume
            continue
        why = unfinished(workdir, saved["train"]["num_steps"])
        if why:
            del study.results["runs"][key]
            print(f"[{key}] recorded, but its run did not finish ({why}): it resumes", flush=True)


def read_json(path: str):
    """The JSON value in the local file `path`, None if there is no such file."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


# A program's one-line error ("scone_jax: error: ...", runtime/tool_main.py's): lower case, after a program name or
# at the start, so libraries' lines that merely contain "Error:" (libtpu's warnings on a CPU) are not taken for it.
_ONE_LINE_ERROR = re.compile(r"(^|: )error: ")


def run_cli(args: list[str], log_path: str, show) -> tuple[int, str]:
    """Run a program of this package, its output appended to log_path; `show(line)` sees each line. Returns
    its exit status and the line that says why it stopped: its last one-line error, else its last line (this
    invocation's only: the log holds every earlier attempt too)."""
    # The program stops (SIGTERM) if this process dies: no run trains on, holding its workdir, after a killed study.
    path = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = parent_watch.child_environment({**os.environ, "PYTHONPATH": path})
    last, error = "(no output)", None
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            show(line.rstrip("\n"))
            if line.strip():
                last = line.strip()
                error = last if _ONE_LINE_ERROR.search(last) else error
        return proc.wait(), (error or last)[:500]
