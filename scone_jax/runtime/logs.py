"""Console logging for our CLIs: our INFO lines, and only warnings from the libraries.

orbax and grain log every save, restore and worker step at INFO through absl; a user
watching training or an export wants our progress lines. `--verbosity=1` shows everything on
the console; `--log_dir=DIR` (absl's flag) also writes the complete log, the libraries' INFO
lines and whole multi-line messages included, to DIR/scone_jax.<host>.<pid>.log.
"""
from __future__ import annotations

import logging as std_logging
import os
import socket
import sys

from absl import logging

# grain's worker processes hand batches over in shared memory; the few still in flight when a
# run closes its pipeline are freed by multiprocessing's resource tracker, which then warns
# "resource_tracker: There appear to be N leaked shared_memory objects to clean up at
# shutdown". Nothing is lost or leaked; the tracker process takes its warning filters from
# sys.warnoptions when it starts (before the first worker), so this keeps our CLIs' ends quiet.
_TRACKER_WARNING = "ignore:resource_tracker:UserWarning"


class _QuietLibraries(std_logging.Filter):
    """Our records as they are; the libraries' warnings and errors as one line each, and none of
    orbax's errors (a failed save makes it log a traceback per thread; the same failure reaches
    the run as an exception, which it reports in one line)."""

    def filter(self, record):
        if "/scone_jax/" in record.pathname:
            return True
        if record.levelno < std_logging.WARNING:
            return False
        if record.levelno >= std_logging.ERROR and "/orbax/checkpoint/" in record.pathname:
            return False  # a failed save or restore reaches us as an exception, reported in one line
        message = record.getMessage()
        if "/orbax/checkpoint/" in record.pathname and "Skipping merge of OCDBT checkpoints" in message:
            return False  # every single-process save says so; nothing is wrong
        if record.name == "asyncio" and "exception was never retrieved" in message and (
                "/orbax/checkpoint/" in message or message.startswith("_GatheringFuture")):
            # orbax's abandoned writes after a failed save (its tasks, and the gather that awaited
            # them, which names no orbax frame): the same failure the run reports in one line.
            return False
        first = (message.strip().splitlines() or [""])[0]
        record.msg, record.args = first[:1000], None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _drop_failed_io_echoes(unraisable) -> None:
    """After a failed checkpoint write or read, orbax abandons its event loop while tensorstore still
    completes the other operations: each completion then fails with 'Event loop is closed', and each
    abandoned read coroutine is reported when it is collected, all printed as unraisable exceptions
    (hundreds of lines, each with a whole TensorStore spec). They say nothing that the run's own
    one-line error does not. Anything else goes to the default hook."""
    value, obj = unraisable.exc_value, unraisable.object
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        return
    code = getattr(obj, "cr_code", None)
    if code is not None and "/orbax/checkpoint/" in code.co_filename:
        return
    sys.__unraisablehook__(unraisable)


def write_full_log(directory: str) -> str:
    """Every record at the logging level (absl's --verbosity) into a file in `directory`, unfiltered; returns
    its path. Installed ahead of the console's handler, so it sees each record before the console's
    filter shortens it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"scone_jax.{socket.gethostname()}.{os.getpid()}.log")
    handler = std_logging.FileHandler(path)
    handler.setFormatter(logging.PythonFormatter())
    std_logging.getLogger().handlers.insert(0, handler)
    return path


def quiet_libraries() -> None:
    """Call at the top of a CLI's main (after flag parsing)."""
    if _TRACKER_WARNING not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_WARNING)
    from absl import flags

    if flags.FLAGS.is_parsed() and flags.FLAGS["log_dir"].value:
        write_full_log(flags.FLAGS["log_dir"].value)
    if logging.get_verbosity() <= logging.INFO:
        logging.get_absl_handler().addFilter(_QuietLibraries())
        sys.unraisablehook = _drop_failed_io_echoes
