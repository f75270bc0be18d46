"""The entry point every program but the training job shares (tools/ scripts and the serving programs):
absl flags, no positional arguments, and bad input (ValueError, OSError: a wrong flag value, missing or
unreadable files; a job that could not start) as one line on stderr with exit status 2, the same contract as
`python -m scone_jax.main`. SIGINT (Ctrl-C) and SIGTERM end every such program with one line, saying what the
stop left and how to go on where the program passes `stopped`, and exit status 130 / 143 (128 + the signal, as
the training job and a process killed by the signal report), whatever Python runs when the signal arrives
(runtime/stop_signals.py: a stop raised inside a garbage collector callback is raised again after it). In a
multi-process job (joined) the bad-input line names the process and is published first, so every process of the job
stops with it (runtime/distributed.py exit_bad_input)."""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable

from absl import app, flags

from scone_jax.runtime import parent_watch, stop_signals
from scone_jax.runtime.errors import one_line

EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 130, 143
BAD_INPUT = (ValueError, OSError)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: `finally` blocks run on the way out,
    and no `except Exception` takes it for an error."""


def main_of(run: Callable[[], None], program: str = "", errors: tuple[type[BaseException], ...] = BAD_INPUT,
            stopped: Callable[[], str] | None = None) -> Callable[[list[str]], None]:
    """An absl `main` that calls `run()` and turns `errors` into `[program: ]error: <one line>`, exit 2. SIGINT and
    SIGTERM end it with `[program: ]stopped by SIGINT|SIGTERM; <stopped()>` (`stopped`: asked once the work has
    unwound, what the stop left and how to go on; without it the line ends at the signal's name), exit 130|143.
    The handlers before it are back when `run()` returns. (In a multi-process job jax's preemption service takes
    SIGTERM over when jax.distributed starts.)"""
    prefix = f"{program}: " if program else ""

    def main(argv: list[str]) -> None:
        parent_watch.stop_with_parent_if_asked()  # started by tools/bench_quality.py: stop when it dies
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {signal.SIGTERM: stop_signals.install(signal.SIGTERM, Terminated),
                        signal.SIGINT: stop_signals.install(signal.SIGINT, KeyboardInterrupt)}
        try:
            run()
        except errors as e:
            if _in_joined_job():  # every process of the job stops with this line (runtime/distributed.py)
                from scone_jax.runtime import distributed

                distributed.exit_bad_input(program or "scone_jax", one_line(e, limit=4000))
            print(f"{prefix}error: {one_line(e, limit=4000)}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        except (KeyboardInterrupt, Terminated) as e:
            for s in (signal.SIGINT, signal.SIGTERM):  # a second signal now ends the process at once
                signal.signal(s, signal.SIG_DFL)
            previous.clear()
            name, status = ("SIGTERM", EXIT_TERMINATED) if isinstance(e, Terminated) else ("SIGINT", EXIT_INTERRUPTED)
            print(f"{prefix}stopped by {name}" + (f"; {stopped()}" if stopped is not None else "."), file=sys.stderr)
            sys.exit(status)
        finally:
            for s, handler in previous.items():
                if handler is not None:  # (None: a handler not installed from Python; nothing to put back)
                    signal.signal(s, handler)

    return main


def _in_joined_job() -> bool:
    """Whether this program has joined a multi-process JAX job (without importing JAX if it has not)."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def require(**flag_values) -> None:
    """ValueError naming every flag among `flag_values` (name -> parsed value) that was not passed."""
    missing = [name for name, value in flag_values.items() if not value]
    if missing:
        raise ValueError("pass " + " and ".join(f"--{name}" for name in missing))


def run(body: Callable[[], None], program: str = "", errors: tuple[type[BaseException], ...] = BAD_INPUT,
        stopped: Callable[[], str] | None = None, flag_error: Callable[[list[str]], str | None] | None = None) -> None:
    """app.run(main_of(body, program, errors, stopped)), with a flag that does not parse (an unknown flag, a value
    outside an enum) also one line and exit 2 instead of absl's usage dump and exit 1. `flag_error(argv)` says
    why in the program's own words where it can (a --config.KEY=VALUE that config_flags refuses with a
    traceback or in its own terms)."""
    prefix = f"{program}: error: " if program else "error: "

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except Exception as e:  # noqa: BLE001 - config_flags raises AttributeError for an unknown --config.KEY
            explained = flag_error(argv) if flag_error else None
            if explained:
                print(prefix + explained, file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            if not isinstance(e, flags.Error):
                raise
            print(prefix + one_line(e, limit=4000) + " (--help lists the flags)", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)

    app.run(main_of(body, program, errors, stopped), flags_parser=parse)


def check_result_path(path: str, flag: str) -> None:
    """Fail now, before the work, if the local file `path` (a --result/--output JSON) cannot be written."""
    if os.path.isdir(path):
        raise OSError(f"{flag}={path} cannot be written ({path} is a directory). Fix: pass a file path, or '' "
                      "for none.")
    try:
        probe_directory(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise OSError(f"{flag}={path} cannot be written ({one_line(e)}). Fix: pass a path in a directory you can "
                      "write to, or '' for none.") from None


def probe_directory(directory: str) -> None:
    """Create the local `directory` and write and remove a file there: raises the OSError a real write would."""
    os.makedirs(directory, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-")
    os.close(fd)
    os.unlink(probe)


def write_result(path: str, result, **json_args) -> None:
    """`result` as JSON at `path`, replaced atomically (a reader never sees half a file; a write stopped midway,
    by a full disk or a signal, leaves no temporary file either)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".result-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1, **json_args)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
