"""One writer per workdir: a run owns its workdir through a lease recorded in <workdir>/OWNER.

Two runs on one workdir would interleave their checkpoints, config.json and metrics.jsonl, or delete
each other's files mid-save. So train.run takes ownership before it writes anything else there, and a
second run on the same workdir stops at once (exit status 2) with a line naming the owner.

- OWNER is a small JSON record: host, process id, start time, last renewal (Unix time), lease length
  and a random token. It is created with a conditional write that succeeds only if no OWNER exists
  (tensorstore's kvstore `if_equal`: on GCS an upload with ifGenerationMatch=0; on local disk
  tensorstore's locked write-then-rename), then read back to check that the token is this run's.
  Of two runs starting together exactly one gets it.
- A daemon thread renews the record every lease / 6 seconds, again conditionally, on the generation it
  wrote last. If the record has meanwhile been replaced by another run's (this process stalled for
  longer than the lease, or the hosts' clocks disagree), `lost()` turns true and `check()` raises
  OwnershipLost: the training loop stops at its next step without writing more.
- A record not renewed within its lease (judged by the clock of the host reading it) was left by a
  run that died without cleaning up (kill -9, a lost VM). The next run takes it over, conditionally
  on the generation it read, and logs a warning naming the old owner.
- The owner deletes OWNER when the run ends, however it ends (done, error, SIGTERM).
- In a multi-process job only process 0 takes ownership; it tells the others the outcome through
  jax's distributed key-value store, so all of them stop with the same message if it failed.

The lease lasts SCONE_JAX_LEASE_S seconds (default 120). If a run that is gone still blocks the
workdir, wait until its lease runs out, or delete <workdir>/OWNER once sure that no run uses it.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import threading
import time
import uuid

import jax
from absl import logging

from scone_jax.runtime import distributed, storage, workdir as workdir_layout
from scone_jax.runtime.errors import one_line
from scone_jax.runtime.write_probe import WorkdirError

OWNER_FILE = workdir_layout.OWNER
LEASE_ENV = "SCONE_JAX_LEASE_S"
DEFAULT_LEASE_S = 120.0
RENEWALS_PER_LEASE = 6
_ATTEMPTS = 3  # reads and conditional writes before giving up on an OWNER that keeps changing
_CHIEF_WAIT_S = 600  # how long processes > 0 wait for process 0's outcome
_FIELDS = ("host", "pid", "started", "renewed_unix", "lease_s", "token")
_job_keys = itertools.count()


class WorkdirBusy(WorkdirError):
    """Another run holds a live lease on the workdir."""


class OwnershipLost(WorkdirError):
    """Another run took over the workdir while this run held it."""


def lease_seconds() -> float:
    """The lease length: SCONE_JAX_LEASE_S, else DEFAULT_LEASE_S."""
    text = os.environ.get(LEASE_ENV, "").strip()
    if not text:
        return DEFAULT_LEASE_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{LEASE_ENV}={text!r} must be a positive number of seconds.")
    return value


class Ownership:
    """This process's lease on `workdir`, renewed by a background thread until release()."""

    def __init__(self, workdir: str, record: dict, generation: bytes):
        self.workdir, self.record, self.lease_s = workdir, record, record["lease_s"]
        self._store = storage.open_store(workdir)
        self._generation = generation
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="workdir-lease", daemon=True)
        self._thread.start()

    def lost(self) -> bool:
        """True once another run has taken the workdir over."""
        return self._lost is not None

    def check(self) -> None:
        """Raise OwnershipLost if another run has taken the workdir over (call before writing)."""
        if self._lost is not None:
            raise OwnershipLost(self._lost)

    def release(self) -> None:
        """Stop renewing and delete OWNER if it is still this run's (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._lost is not None:
            return
        try:
            if not self._store.write(OWNER_FILE, None, if_equal=self._generation).result().generation:
                logging.warning("Left %s in place: it changed after this run's last renewal.",
                                _owner_path(self.workdir))
        except Exception as e:  # storage errors vary by driver; the lease then runs out on its own
            logging.warning("Could not delete %s (%s); the next run can take the workdir over once its lease of "
                            "%.0f s runs out.", _owner_path(self.workdir), one_line(e, 300), self.lease_s)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / RENEWALS_PER_LEASE):
            try:
                self._renew()
            except Exception as e:  # a storage hiccup: the next renewal tries again, well within the lease
                logging.warning("Could not renew the lease on %s: %s", _owner_path(self.workdir), one_line(e, 300))
            if self._lost is not None:
                logging.error("%s", self._lost)
                return

    def _renew(self) -> None:
        now = time.time()
        record = {**self.record, "renewed": _utc(now), "renewed_unix": now}
        stamp = self._store.write(OWNER_FILE, _encode(record), if_equal=self._generation).result()
        if stamp.generation:
            self.record, self._generation = record, stamp.generation
            return
        current = self._store.read(OWNER_FILE).result()  # OWNER changed since this run's last write
        holder = _decode(current.value) if current.state == "value" else None
        if holder is not None and holder["token"] == self.record["token"]:
            self._generation = current.stamp.generation  # this run's own write, answered late (a retried request)
        elif current.state == "missing":  # deleted by hand while this run held it: claim it again
            stamp = self._store.write(OWNER_FILE, _encode(record), if_equal=current.stamp.generation).result()
            if stamp.generation:
                self.record, self._generation = record, stamp.generation
                logging.warning("%s was deleted while this run owned the workdir; written again.",
                                _owner_path(self.workdir))
        else:
            self._lost = (f"--workdir={self.workdir} was taken over by another run ({_describe(holder)}) while this "
                          "run owned it, so this run stopped writing there. Its lease was not renewed in time (a "
                          f"stall longer than {_seconds(self.lease_s)} s, or host clocks that disagree); make sure "
                          "only one run uses the workdir.")


class _Bystander:
    """Processes > 0 of a job: process 0 holds the lease for all of them."""

    def lost(self) -> bool:
        return False

    def check(self) -> None:
        pass

    def release(self) -> None:
        pass


def acquire(workdir: str, lease_s: float | None = None) -> Ownership:
    """Take ownership of `workdir` for this process, or raise WorkdirBusy naming its owner."""
    lease_s = lease_seconds() if lease_s is None else lease_s
    store = storage.open_store(workdir)
    started = time.time()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": _utc(started), "started_unix": started,
              "lease_s": lease_s, "token": uuid.uuid4().hex}
    for _ in range(_ATTEMPTS):
        current = store.read(OWNER_FILE).result()
        holder = None
        if current.state == "value":
            holder = _decode(current.value)
            if holder is None or time.time() <= holder["renewed_unix"] + holder["lease_s"]:
                raise WorkdirBusy(_busy_message(workdir, holder))
        now = time.time()
        record.update(renewed=_utc(now), renewed_unix=now)
        if not store.write(OWNER_FILE, _encode(record), if_equal=current.stamp.generation).result().generation:
            continue  # another run wrote OWNER since the read: look again
        written = store.read(OWNER_FILE).result()
        if written.state != "value" or (_decode(written.value) or {}).get("token") != record["token"]:
            continue
        if holder is not None:
            logging.warning("Took over --workdir=%s from a run that stopped renewing its lease (%s; last renewed %s s "
                            "ago, lease %s s): presumed dead (killed, or its machine lost).", workdir,
                            _describe(holder), _seconds(now - holder["renewed_unix"]), _seconds(holder["lease_s"]))
        return Ownership(workdir, record, written.stamp.generation)
    raise WorkdirBusy(f"--workdir={workdir}: could not take ownership in {_ATTEMPTS} attempts, other runs keep "
                      f"changing {_owner_path(workdir)}. Make sure only one run uses the workdir.")


@contextlib.contextmanager
def hold(workdir: str):
    """The workdir is this job's inside the block (process 0 holds the lease); released on any exit."""
    owner = None
    try:
        with _signals_deferred():  # a Ctrl-C or SIGTERM meanwhile lands once `owner` is set, so OWNER is released
            owner = _acquire_for_job(workdir)
        with distributed.on_job_failure(owner.release):  # another process's failure ends this one from a thread
            yield owner
    finally:
        if owner is not None:
            owner.release()


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM held back inside the block and raised again at its end, for their own handlers: taking
    the lease and keeping the object that releases it happen together. (Blocking the signals in the main thread
    would not do: the kernel hands a process's signal to any thread, and Python runs its handler at once.)"""
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        # In a multi-process job jax's preemption service owns SIGTERM through a C handler: setting and restoring
        # a Python handler here would put SIG_DFL in its place (seen: a SIGTERM then killed the process outright).
        yield
        return
    pending = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)


def _acquire_for_job(workdir: str):
    if jax.process_count() == 1:
        return acquire(workdir)
    client = distributed._client()
    key = f"scone_jax/ownership/{next(_job_keys)}"  # every process counts its run() calls alike
    if jax.process_index() == 0:
        try:
            owner = acquire(workdir)
        except Exception as e:
            client.key_value_set(key, "error:" + one_line(e, 300))
            raise
        client.key_value_set(key, "ok")
        return owner
    try:
        outcome = client.blocking_key_value_get(key, _CHIEF_WAIT_S * 1000)
    except Exception as e:  # process 0 died, or never got there
        raise WorkdirError(f"Process 0 did not say within {_CHIEF_WAIT_S} s whether it owns --workdir={workdir}: "
                           f"{one_line(e, 300)}") from e
    if outcome != "ok":
        raise WorkdirBusy(outcome.removeprefix("error:"))
    return _Bystander()


def live_owner(workdir: str) -> str | None:
    """Who holds a live lease on `workdir` ("host H, process P, started T"), or None: for readers of a run's
    files (export) to say that a file that vanished under them may have been removed by that run."""
    raw = storage.read_bytes(workdir, OWNER_FILE)
    holder = _decode(raw) if raw is not None else None
    if holder is None or time.time() > holder["renewed_unix"] + holder["lease_s"]:
        return None
    return _describe(holder)


def _busy_message(workdir: str, holder: dict | None) -> str:
    path = _owner_path(workdir)
    if holder is None:
        return (f"--workdir={workdir} holds {path}, which is not a run's ownership record. If no run uses this "
                f"workdir, delete {path} and start again.")
    age = time.time() - holder["renewed_unix"]
    left = max(holder["lease_s"] - age, 0.0)
    return (f"--workdir={workdir} is in use by another run: {_describe(holder)}, lease renewed {_seconds(age)} s "
            f"ago. Use another --workdir, or stop that run first; if it is gone (killed, machine lost), rerun after "
            f"its lease runs out (in {_seconds(left)} s) or delete {path} once sure that no run uses this workdir.")


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "unknown owner"
    return f"host {holder['host']}, process {holder['pid']}, started {holder['started']}"


def _seconds(s: float) -> str:
    return f"{max(s, 0.0):.0f}" if abs(s) >= 10 else f"{max(s, 0.0):.1f}"


def _owner_path(workdir: str) -> str:
    return storage.join(workdir, OWNER_FILE)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _encode(record: dict) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode()


def _decode(raw: bytes) -> dict | None:
    """The record in OWNER, or None if it is not one (any other content blocks, but is never taken over)."""
    try:
        record = json.loads(bytes(raw))
        if isinstance(record, dict) and all(k in record for k in _FIELDS):
            return {**record, "renewed_unix": float(record["renewed_unix"]), "lease_s": float(record["lease_s"])}
    except (ValueError, TypeError):
        pass
    return None
