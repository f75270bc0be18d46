"""Joining a multi-process JAX job: when to call jax.distributed.initialize, and with what.

Every process of a job runs the same `python -m scone_jax.main`. The processes find each
other either from flags (--coordinator_address, --num_processes, --process_id; any cluster)
or, with no flags, from the Cloud TPU environment, which jax reads itself: TPU VM metadata,
TPU_WORKER_HOSTNAMES (GKE) and MEGASCALE_* (multislice). A process with neither runs alone.

When a peer never arrives, jax's C++ client aborts the whole process (SIGABRT, a stack
trace, no Python exception) once its own deadline passes. So a watchdog of ours, due first,
prints what went wrong and exits with status 2. jax also accepts a peer that was told
another process count (it only checks process_id < count), and such a job would hang at its
first collective: the counts are compared right after joining.

A job fails as one. A process that stops on bad input (exit_bad_input) publishes its line in the
coordination service's key-value store before it leaves (joining the job first if the error came
before it had joined), and every process watches that key from the moment it joins (a thread
polling it every WATCH_EVERY_S): each prints one line naming the failing process and its cause,
runs the cleanups registered with on_job_failure (the workdir's lease), and exits with status 2
at once, whatever its main thread waits for (a collective with the process that left would end in
gloo's DEADLINE_EXCEEDED half a minute later, and jax's shutdown barrier would hold the failing
process for minutes). Process 0 hosts the service, so before it leaves it waits up to ACK_WAIT_S
for every other process to say it has read the line, then ACK_GRACE_S for them to be gone.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import glob
import os
import sys
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from scone_jax.runtime.errors import one_line

_COUNT_KEY = "scone_jax/num_processes"
_FAILURE_KEY = "scone_jax/failure"  # "<process index>\t<its one line>" of the process that stopped the job
_READ_KEY = "scone_jax/failure_read"  # /<process index>: that process read the failure
WATCH_EVERY_S = 0.2
ACK_WAIT_S = 10
ACK_GRACE_S = 2.0
_reporting = threading.Event()  # this process is publishing its own failure: the watcher leaves it alone
_stopping = threading.Lock()  # held by whichever of the main thread and the watcher ends the process: one line
_cleanups: list = []  # run before a failure another process published ends this one (on_job_failure)
_watching = threading.Event()  # cleared at interpreter exit: the watcher leaves before jax shuts the client down
EXIT_START_FAILED = 2  # main.py's "bad input" status
# jax's own deadline is set this much later than ours, so our clear message comes first.
_JAX_DEADLINE_EXTRA_S = 60


class DistributedStartError(RuntimeError):
    """The processes of a multi-process job could not form the job (flags, peers, network)."""


@dataclasses.dataclass(frozen=True)
class JoinSpec:
    """How this process joins a job. All None: detect from the Cloud TPU environment."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = 300  # wait for peers (and for their exit) at most this long

    @property
    def explicit(self) -> bool:
        return any(v is not None for v in (self.coordinator_address, self.num_processes, self.process_id))


def on_tpu_pod() -> bool:
    """True on a Cloud TPU VM (multi-host or not: one host is a one-process job) or when the
    TPU/multislice variables are set. TPU chips appear as /dev/accel* (v2-v4) or /dev/vfio/N
    (v5e and later); jax's own detection then reads the worker list from VM metadata."""
    env = any(os.environ.get(k) for k in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS"))
    chips = glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
    return env or bool(chips)


def initialize(spec: JoinSpec) -> bool:
    """Join the job `spec` describes (see the module docstring). Returns whether
    jax.distributed was started; call before anything touches a JAX device."""
    if jax.distributed.is_initialized():
        return True
    if spec.explicit:
        _check_flags(spec)
        if spec.num_processes == 1:
            return False
        kwargs = dict(coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
                      process_id=spec.process_id, cluster_detection_method="deactivate")
        # Cross-process collectives on the CPU backend (tests, CPU clusters); TPUs have their own.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        where = f"coordinator {spec.coordinator_address} as process {spec.process_id} of {spec.num_processes}"
    elif on_tpu_pod():
        kwargs, where = {}, "the Cloud TPU environment"
    else:
        return False
    logging.info("Joining a multi-process JAX job via %s (timeout %d s)", where, spec.timeout_s)
    advice = ("Check that every process was started with the same --coordinator_address and --num_processes "
              "and distinct --process_id values, that all of them are running, and that process 0's port is "
              "reachable from the others.")
    watchdog = threading.Timer(spec.timeout_s, _give_up, args=(
        f"Not all processes joined the JAX job (via {where}) within {spec.timeout_s} s (--startup_timeout). {advice}",))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=spec.timeout_s + _JAX_DEADLINE_EXTRA_S,
                                   shutdown_timeout_seconds=spec.timeout_s)
        if spec.explicit:  # jax's TPU detection gives every process the same count
            _check_same_count(spec.num_processes, spec.process_id, spec.timeout_s)
    except DistributedStartError:
        raise
    except Exception as e:  # jax raises XlaRuntimeError / ValueError with gRPC text
        raise DistributedStartError(f"Could not join the JAX job via {where}: {one_line(e, 300)}. {advice}") from e
    finally:
        watchdog.cancel()
    _start_watching(_client(), _job()[0])
    return True


def _start_watching(client, me: int) -> None:
    """Start the watcher thread, and stop it (joined) when the interpreter exits.

    A daemon thread still inside a jaxlib call when Python finalizes is killed by a forced unwind
    through C++ frames, which aborts the process ("FATAL: exception not rethrown", status -6) after
    its work succeeded. atexit runs handlers last-registered first, so this one runs before jax's
    own clean-up (registered when jax was imported) shuts the client down."""
    _watching.set()
    watcher = threading.Thread(target=_watch_for_failure, args=(client, me), name="job-failure-watch", daemon=True)
    watcher.start()

    def stop():
        _watching.clear()
        watcher.join(timeout=10 * WATCH_EVERY_S + 5)

    atexit.register(stop)


def _give_up(message: str) -> None:
    """Runs on the watchdog thread: the main thread is stuck inside jax's C++ client."""
    if not _reporting.is_set():  # (joining only to report its own failure, which it has printed already)
        print(f"scone_jax: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_START_FAILED)


def exit_bad_input(program: str, message: str, spec: JoinSpec | None = None, *, joinable: bool = True):
    """End this process for bad input: `program: error: message` and exit status 2. In a multi-process job (joined,
    or `spec` names one and `joinable`: the error came before joining, and joining can still work) the line names
    this process and is published to the others first (module docstring), so the whole job stops with it."""
    multi = jax.distributed.is_initialized() or (
        joinable and spec is not None and spec.explicit and (spec.num_processes or 1) > 1)
    if not multi:
        print(f"{program}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_START_FAILED)
    if not _stopping.acquire(blocking=False):  # the watcher is ending the process with another's line
        threading.Event().wait()
    _reporting.set()
    me = _job()[0] if jax.distributed.is_initialized() else spec.process_id
    print(f"{program}: error: process {me}: {message}", file=sys.stderr, flush=True)
    try:
        if not jax.distributed.is_initialized():
            initialize(spec)  # to tell the others (its watchdog ends this process if they never come)
        _publish(me, message)
    except Exception as e:  # noqa: BLE001 - the others then fail on their own; this process's line is out
        logging.warning("Could not tell the other processes why process %s stopped: %s", me, one_line(e, 300))
    sys.stderr.flush()
    os._exit(EXIT_START_FAILED)  # not sys.exit: jax's shutdown barrier would wait for the others for minutes


def _publish(me: int, message: str) -> None:
    client = _client()
    try:
        client.key_value_set(_FAILURE_KEY, f"{me}\t{message}")
        failing = me
    except Exception:  # noqa: BLE001 - another process published first: the others stop with its line
        failing = None
    _leave(client, me, failing)


def _leave(client, me: int, failing: int | None) -> None:
    """Before this process exits on a published failure: process 0, which hosts the coordination service, waits
    up to ACK_WAIT_S until every other process but `failing` has read the line, then ACK_GRACE_S for them to be
    gone (once the service is, jax ends a process still connected to it with SIGABRT and a C++ stack); the
    others say they have read it."""
    if me != 0:
        try:
            client.key_value_set(f"{_READ_KEY}/{me}", "1")
        except Exception:  # noqa: BLE001 - process 0 gone already
            pass
        return
    deadline = time.monotonic() + ACK_WAIT_S
    for peer in range(1, _job()[1]):
        if peer == failing:
            continue
        try:
            client.blocking_key_value_get(f"{_READ_KEY}/{peer}", int(max(deadline - time.monotonic(), 0.001) * 1000))
        except Exception:  # noqa: BLE001 - that process is gone, or slow: it fails on its own
            pass
    time.sleep(ACK_GRACE_S)


@contextlib.contextmanager
def on_job_failure(cleanup):
    """Inside the block, `cleanup()` runs before a failure another process published ends this one (the block's
    own `finally` would not run: the process exits from the watcher thread)."""
    _cleanups.append(cleanup)
    try:
        yield
    finally:
        _cleanups.remove(cleanup)


def _watch_for_failure(client, me: int) -> None:
    """The watcher thread (module docstring): returns when the interpreter exits or the client is gone."""
    while True:
        time.sleep(WATCH_EVERY_S)
        if not _watching.is_set():
            return
        try:
            value = client.key_value_try_get(_FAILURE_KEY)
        except Exception as e:  # noqa: BLE001 - NOT_FOUND: nobody failed; anything else: the client is gone
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                continue
            return
        if _reporting.is_set() or not _stopping.acquire(blocking=False):  # this process's own failure
            return
        peer, _, message = value.partition("\t")
        print(f"scone_jax: error: process {peer} of the job stopped: {message} (process {me} stops with it)",
              file=sys.stderr, flush=True)
        for cleanup in list(_cleanups):
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - best effort: the process is leaving
                logging.warning("While stopping: %s", one_line(e, 300))
        _leave(client, me, int(peer) if peer.isdigit() else None)
        sys.stderr.flush()
        os._exit(EXIT_START_FAILED)


def _check_flags(spec: JoinSpec) -> None:
    missing = [n for n in ("coordinator_address", "num_processes", "process_id") if getattr(spec, n) is None]
    if missing and spec.num_processes != 1:
        raise DistributedStartError(
            f"Multi-process flags are incomplete: --{', --'.join(missing)} not given. Pass all three "
            "(--coordinator_address=HOST:PORT --num_processes=N --process_id=I), or none on a Cloud TPU VM."
        )
    if spec.num_processes is not None and spec.num_processes < 1:
        raise DistributedStartError(f"--num_processes={spec.num_processes} must be at least 1.")
    if spec.process_id is not None and not 0 <= spec.process_id < (spec.num_processes or 1):
        raise DistributedStartError(
            f"--process_id={spec.process_id} is not in [0, --num_processes={spec.num_processes})."
        )


def _check_same_count(num_processes: int, me: int, timeout_s: int) -> None:
    """Process 0 publishes its process count; every other process compares its own and
    publishes it back, so both sides of a mismatch stop with the same message. Runs before
    the backend starts, which would wait for peers that were never going to come."""
    client = _client()
    if me == 0:
        client.key_value_set(_COUNT_KEY, str(num_processes))
        for peer in range(1, num_processes):
            theirs = int(client.blocking_key_value_get(f"{_COUNT_KEY}/{peer}", timeout_s * 1000))
            if theirs != num_processes:
                raise DistributedStartError(_mismatch(num_processes, peer, theirs))
    else:
        client.key_value_set(f"{_COUNT_KEY}/{me}", str(num_processes))
        theirs = int(client.blocking_key_value_get(_COUNT_KEY, timeout_s * 1000))
        if theirs != num_processes:
            raise DistributedStartError(_mismatch(theirs, me, num_processes))


def _mismatch(chief_count: int, peer: int, peer_count: int) -> str:
    return (f"Mismatched process counts: process 0 was started with --num_processes={chief_count} but "
            f"process {peer} with --num_processes={peer_count}. Start every process with the same value.")


def _job() -> tuple[int, int]:
    """(this process's index, the process count) of the joined job, read without starting a backend (which
    jax.process_index() would: on CPU that waits for every process's backend)."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.process_id, jax_distributed.global_state.num_processes


def _client():
    from orbax.checkpoint import multihost  # the public accessor of jax's distributed client

    return multihost.get_jax_distributed_client()


def barrier(name: str, timeout_s: int = 600) -> None:
    """Wait until every process reaches `name` (a no-op alone); fails after timeout_s instead
    of hanging when a peer died before getting there."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(f"scone_jax/{name}", timeout_s * 1000)


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is true on any of them (a collective: all must call it; no
    communication in a one-process job)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def chief_first(name: str, make):
    """`make()` on process 0, then on the others once it is done: for files that process 0
    writes into the shared workdir on first use (tokenizer, f-gram vocabulary) and the
    others then read."""
    if jax.process_index() == 0:
        result = make()
        barrier(name)
        return result
    barrier(name)
    return make()
