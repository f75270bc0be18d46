"""Worker processes that die with their parent, and scratch that the next run clears.

A program killed with SIGKILL cannot stop its worker processes (pool workers of f-gram extraction and
pre-tokenization, grain's data workers): they used to keep running for minutes and then write into a
rerun's output. `exit_with_parent` (a worker's initializer) starts a thread that ends the worker
within a second of its parent's death. It waits on multiprocessing's parent sentinel (a pipe the parent
holds open), so a worker whose parent died while it was still starting up exits too: reading the parent
from getppid() at that point would read the adopting process and wait forever. Processes not started by
multiprocessing fall back to noticing that getppid() changes. A signal on the parent's death (Linux
PR_SET_PDEATHSIG) is not used: it fires when the parent *thread* that started the worker exits, which for
pools started from a helper thread is long before the program ends.

Programs of this package started by another as subprocesses (tools/bench_quality.py starts the main job,
export and evaluate) get `child_environment`; `stop_with_parent_if_asked`, called first thing by
`python -m scone_jax.main` and every runtime/tool_main.py program, then sends the program SIGTERM when that
parent dies: the stop of a preempted job (the main job saves a checkpoint, releases its workdir and exits
143), instead of a run training on unseen, holding its workdir, after its study was killed.

Scratch directories are named `<prefix>-<pid>-<host>-<random>`; `remove_stale_scratch` deletes this host's
of processes that no longer run, so a killed run's scratch is removed by the next one. The host is in the
name because a process id means nothing elsewhere: a run on another machine sharing the directory (NFS), or
in another container sharing /tmp, has a pid this process cannot see, and its live scratch must stay.
Names without a host (`<prefix>-<pid>-<random>`, from older versions) are judged by their pid alone.
"""
from __future__ import annotations

import glob
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time

EXIT_ORPHANED = 70  # a worker that outlived its parent (os._exit: no cleanup of the dead parent's state)
_POLL_S = 0.5
PARENT_ENV = "SCONE_JAX_STOP_WITH_PARENT"  # the pid of the process whose death stops this program


def exit_with_parent(*_ignored) -> None:
    """In a worker process: exit as soon as the parent dies (within ~_POLL_S for a process not started by
    multiprocessing). Extra arguments are ignored, so it can serve as any pool's initializer (grain passes
    the worker's index and count)."""
    parent = multiprocessing.parent_process()  # None outside a multiprocessing child
    ppid = os.getppid()

    def watch():
        if parent is not None:
            parent.join()  # returns when the parent dies, at once if it already has
        else:
            while os.getppid() == ppid:
                time.sleep(_POLL_S)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def child_environment(env: dict) -> dict:
    """`env` for a subprocess that is to stop when this process dies (it calls stop_with_parent_if_asked)."""
    return {**env, PARENT_ENV: str(os.getpid())}


def stop_with_parent_if_asked() -> None:
    """In a program started with child_environment: SIGTERM this process within ~_POLL_S of that parent's death
    (at once if it is already dead). The variable leaves this process's environment, so that its own children
    do not watch a process that is not their parent."""
    text = os.environ.pop(PARENT_ENV, "")
    if not text.isdigit():
        return
    parent = int(text)
    direct = os.getppid() == parent  # else started through a wrapper (a shell, `timeout`): watch the pid itself

    def watch():
        while (os.getppid() == parent) if direct else process_alive(parent):
            time.sleep(_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _host() -> str:
    return (socket.gethostname() or "localhost").replace(os.sep, "_")


def scratch_name(prefix: str) -> str:
    """The stem of this process's scratch directories: `<prefix>-<pid>-<host>-` (tempfile adds the random part,
    which has no '-')."""
    return f"{prefix}-{os.getpid()}-{_host()}-"


def scratch_owner(path: str, prefix: str) -> tuple[int, str] | None:
    """(pid, host) of a scratch directory's name, host '' for an old name without one; None if not scratch."""
    pid, _, rest = os.path.basename(path)[len(prefix) + 1:].partition("-")
    return (int(pid), rest.rpartition("-")[0]) if pid.isdigit() else None


def remove_stale_scratch(directory: str, prefix: str) -> list[str]:
    """Delete `directory/<prefix>-<pid>-<host>-*` of this host's processes that no longer run; returns them."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"{prefix}-*-*")):
        owner = scratch_owner(path, prefix)
        if owner is None or owner[1] not in ("", _host()):  # not scratch, or another machine's (module docstring)
            continue
        if owner[0] != os.getpid() and not process_alive(owner[0]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
