"""Signal handlers that stop the program by raising an exception, which nothing can swallow.

Python runs a signal's handler in the main thread between two bytecodes of whatever Python code runs there,
and some code runs where an exception cannot propagate: a garbage collector callback (JAX registers one, run at
every collection), a `__del__` method, a weakref callback. An exception raised there is printed as "Exception
ignored in ..." and dropped, and the program carries on: 5 of 7 SIGTERMs were lost so in evaluate. Python hands
every exception it drops to sys.unraisablehook. So the exception a handler here raises carries its signal
number, and the hook (installed in front of any other whenever a handler raises) takes it back: it asks a
helper thread to deliver the same signal again, and the handler raises anew, once the main thread has left the
place where it was dropped. A handler that runs inside an unraisable hook never raises there (that exception
would be dropped unseen); it asks for the signal again too. A request made before the handler last raised is
dropped, so the signal is delivered again only while its last exception is the one that was lost.
"""
from __future__ import annotations

import _thread
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable

STOP_SIGNAL = "stop_signal"  # the attribute of an exception raised by a handler here: its signal number

_requests: queue.SimpleQueue = queue.SimpleQueue()  # (signal, raises when asked): safe to put from any context
_raises = [0]  # how many times a handler here has raised
_resender: threading.Thread | None = None
_previous_hook = sys.__unraisablehook__


def install(signum: int, make: Callable[[], BaseException]):
    """Handle `signum` by raising make() in the main thread, raised again if it is swallowed; returns the previous
    handler (for signal.signal). Call from the main thread."""
    _start_resender()
    _hook_in_front()
    return signal.signal(signum, raising(make))


def raising(make: Callable[[], BaseException]):
    """A signal handler that raises make(), tagged with the signal, unless it runs inside the unraisable hook."""

    def handler(signum, frame):
        if _inside_hook(frame):
            _requests.put((signum, _raises[0]))
            return
        _hook_in_front()
        error = make()
        setattr(error, STOP_SIGNAL, signum)
        _raises[0] += 1
        raise error

    return handler


def _inside_hook(frame) -> bool:
    """Whether `frame` runs inside an unraisable hook: ours (and whatever it passes exceptions on to), or one a
    program installed after ours."""
    hooks = {_hook.__code__, getattr(sys.unraisablehook, "__code__", None)}
    while frame is not None:
        if frame.f_code in hooks:
            return True
        frame = frame.f_back
    return False


def _hook_in_front() -> None:
    """Our hook first, passing on what it does not take to whichever hook was there (a program may install its own
    after ours: runtime/logs.py does)."""
    global _previous_hook
    if sys.unraisablehook is not _hook:
        _previous_hook, sys.unraisablehook = sys.unraisablehook, _hook


def _hook(unraisable) -> None:
    signum = getattr(unraisable.exc_value, STOP_SIGNAL, None)
    if signum is None:
        _previous_hook(unraisable)
    else:  # a stop dropped where it was raised: deliver the signal again, from the resender thread
        _requests.put((signum, _raises[0]))


def _start_resender() -> None:
    global _resender
    if _resender is None or not _resender.is_alive():
        _resender = threading.Thread(target=_resend, name="stop-signal-resender", daemon=True)
        _resender.start()


def _resend() -> None:
    while True:
        signum, raises = _requests.get()
        time.sleep(0.001)  # let the main thread leave the place where the stop was dropped
        if raises == _raises[0]:  # nothing raised since: the stop is still lost (else a newer one is on its way)
            _thread.interrupt_main(signum)  # runs the handler for `signum` now installed; nothing if SIG_DFL/SIG_IGN


def stop_while_starting(program: str) -> None:
    """Ctrl-C from here until the program installs its own handlers (its imports of JAX, orbax and the rest take
    seconds; flags are parsed after them) ends it at once with one line and exit 130: nothing has been written
    yet, so there is nothing to keep, and no chained import tracebacks. Call first thing in `__main__`."""

    def handler(signum, frame):
        del signum, frame
        os.write(2, f"{program}: stopped by SIGINT while starting; nothing was written.\n".encode())
        os._exit(130)

    signal.signal(signal.SIGINT, handler)
