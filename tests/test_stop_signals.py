"""A signal stops the program wherever Python is when it arrives (runtime/stop_signals.py), inside a garbage
collector callback above all: JAX registers one, and a stop raised there used to be printed as "Exception ignored
in garbage collection callback" and dropped (5 of 7 SIGTERMs lost in evaluate). Each test runs a small program
in its own process whose gc callback sends the signal to the process itself, so the handler runs, and raises,
inside the collector."""
import os
import signal
import subprocess
import sys
import time

import pytest

from scone_jax.runtime import stop_signals, tool_main
from tests.common import REPO

pytestmark = pytest.mark.slow  # every test here starts a process

# A tool_main program whose body makes cycles for up to 60 s (the collector runs many times a second); its gc
# callback sends SIGNAL at the first collection and then spends a while in Python at every collection, so
# a signal delivered again lands inside a callback again as often as not.
TOOL = """
import gc, os, signal, sys, time
from scone_jax.runtime import tool_main

def body():
    fired = []

    def during_gc(phase, info):
        if phase == "start" and not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.{sig})  # the handler runs here, inside the collector's callback
        sum(range(3000))

    gc.callbacks.append(during_gc)
    deadline = time.time() + 60
    while time.time() < deadline:
        cycle = []
        cycle.append(cycle)
    print("ran to the end", fired)

tool_main.run(body, program="probe", stopped=lambda: "nothing to keep")
"""


def test_the_hook_sends_a_dropped_stop_again_and_passes_on_anything_else(monkeypatch):
    """In this process: the handler's exception carries its signal and puts our hook in front; the hook asks for the
    signal again for that exception, with the count of raises so far, and hands any other to the hook it replaced.
    Caught: the exception raised untagged (the hook passed it on, printed and lost); the hook passing every
    exception on (nothing sent again)."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # put back after the test
    sent, passed = [], []
    monkeypatch.setattr(stop_signals, "_requests", type("Requests", (), {"put": staticmethod(sent.append)}))
    with pytest.raises(tool_main.Terminated) as raised:
        stop_signals.raising(tool_main.Terminated)(signal.SIGTERM, None)
    assert getattr(raised.value, stop_signals.STOP_SIGNAL) == signal.SIGTERM
    assert sys.unraisablehook is stop_signals._hook
    monkeypatch.setattr(stop_signals, "_previous_hook", passed.append)
    dropped = type("Unraisable", (), {"exc_value": raised.value, "object": None})
    other = type("Unraisable", (), {"exc_value": RuntimeError("something else"), "object": None})
    stop_signals._hook(dropped)
    stop_signals._hook(other)
    assert sent == [(signal.SIGTERM, stop_signals._raises[0])] and passed == [other]


def run(code: str, timeout: float = 120) -> tuple[int, str, str, float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    return result.returncode, result.stdout, result.stderr, time.monotonic() - start


@pytest.mark.parametrize("sig,status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_handled_inside_a_gc_callback_stops_a_tool_in_one_line(sig, status):
    """Caught: the handler raising as before, without the unraisable hook taking the dropped stop back ("Exception
    ignored in garbage collection callback ... Terminated", then the loop ran its 60 s to the end, exit 0); the
    hook's request not re-sent (same); the handler raising inside the hook itself (the stop lost there)."""
    code, stdout, stderr, seconds = run(TOOL.format(sig=sig))
    assert code == status, stderr[-3000:]
    assert stderr.strip() == f"probe: stopped by {sig}; nothing to keep", stderr[-3000:]
    assert "ran to the end" not in stdout and seconds < 50


def test_sigterm_inside_a_gc_callback_stops_the_training_start_up():
    """The training job's start-up handler (preemption.stop_on_sigterm_until_training) raises StartupInterrupted
    the same way. Caught: its own handler, raising where the collector drops it (the block ran to its end)."""
    code, stdout, stderr, _ = run("""
import gc, os, signal, time
from scone_jax.training import preemption

def during_gc(phase, info):
    if phase == "start" and armed and not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGTERM)

armed, fired = [], []
gc.callbacks.append(during_gc)
try:
    with preemption.stop_on_sigterm_until_training():
        armed.append(1)  # (a collection while JAX starts, before the handler is installed, would kill the process)
        deadline = time.time() + 60
        while time.time() < deadline:
            cycle = []
            cycle.append(cycle)
    print("ran to the end")
except preemption.StartupInterrupted:
    print("stopped")
""")
    assert code == 0 and stdout.strip() == "stopped", stderr[-3000:]
    assert "Exception ignored" not in stderr, stderr[-3000:]


def test_a_signal_handled_inside_an_unraisable_hook_stops_the_tool():
    """The handler runs inside a hook the program installed (Python runs it for an exception a __del__ dropped): a
    stop raised there would be dropped unseen ('Exception ignored in sys.unraisablehook'), so the handler asks for
    the signal again instead. Caught: the handler raising inside any hook but our own (the loop ran to its end)."""
    code, stdout, stderr, _ = run("""
import os, signal, sys, time
from scone_jax.runtime import tool_main

class Dropped:
    def __del__(self):
        raise RuntimeError("dropped")

def hook(unraisable):
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside this hook

def body():
    sys.unraisablehook = hook
    Dropped()
    deadline = time.time() + 60
    while time.time() < deadline:
        pass
    print("ran to the end")

tool_main.run(body, program="probe", stopped=lambda: "nothing to keep")
""")
    assert code == 143 and stderr.strip() == "probe: stopped by SIGTERM; nothing to keep", stderr[-3000:]


def test_a_program_without_a_note_stops_in_one_line_too():
    """A tool that passes no `stopped` (pretokenize, generate, ...): one line and 143, not a silent kill (-15) or a
    KeyboardInterrupt traceback."""
    code, _, stderr, _ = run(TOOL.replace(', stopped=lambda: "nothing to keep"', "").format(sig="SIGTERM"))
    assert code == 143 and stderr.strip() == "probe: stopped by SIGTERM.", stderr[-3000:]
