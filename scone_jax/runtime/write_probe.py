"""A startup probe of the workdir, so a bad bucket fails in seconds instead of at the first save.

Without it, a gs:// workdir with no credentials or no such bucket surfaces only when orbax
first writes, after startup and compilation, and the storage client's retries take about a
minute and print pages of tracebacks. The probe writes and deletes one small file through
etils.epath (what orbax uses), within a deadline.
"""
from __future__ import annotations

import logging
import threading
import uuid

from etils import epath

from scone_jax.runtime.errors import one_line

# Storage clients log each failed retry with a traceback; the probe reports one line instead.
_NOISY_LOGGERS = ("gcsfs", "google", "fsspec")
# The probe file's name starts so: readers of a directory that may be probed at the same time (every process of a
# job probes the same one) skip such names.
PROBE_PREFIX = ".write_probe-"


class WorkdirError(OSError):
    """The workdir cannot be created or written within the deadline."""


def check_writable(workdir: str, timeout_s: float, flag: str = "--workdir") -> None:
    """Create `workdir` if needed and write, then delete, a probe file in it; raise
    WorkdirError naming the cause (or the deadline), and `flag`, otherwise."""
    outcome: list[BaseException | None] = []

    def probe():
        try:
            path = epath.Path(workdir)
            path.mkdir(parents=True, exist_ok=True)
            marker = path / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
            marker.write_text("ok")
            marker.unlink()
            outcome.append(None)
        except BaseException as e:  # reported to the caller's thread
            outcome.append(e)

    levels = {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        thread = threading.Thread(target=probe, name="workdir-probe", daemon=True)
        thread.start()
        thread.join(timeout_s)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    if not outcome:
        raise WorkdirError(
            f"{flag}={workdir} did not answer within {timeout_s:.0f} s. Check the bucket name, "
            "network access to it, and credentials (on a TPU VM: the VM service account's access to the bucket)."
        )
    if outcome[0] is not None:
        e = outcome[0]
        first = one_line(e, 300)
        raise WorkdirError(
            f"Cannot write to {flag}={workdir}: {type(e).__name__}: {first}. Check that it exists or can be "
            "created, and that this machine has write access (for gs://: credentials and bucket permissions)."
        )
