"""Noticing SIGTERM (TPU maintenance, spot preemption) and Ctrl-C so training can checkpoint and stop.

The loop asks `reached(step)` after every step. A lone process answers from its own SIGTERM and
SIGINT handlers. In a multi-process job, jax's preemption service (started by
jax.distributed.initialize) owns SIGTERM instead: one process getting the signal makes all of
them agree on the same step to stop at, so they save one consistent checkpoint together. A
handler of ours would replace the service's, so none is installed there; a Ctrl-C there is handed
to the service as the SIGTERM it listens for. Ctrl-C costs no more than a preemption: the step in
flight is finished and saved. A second Ctrl-C stops at once (KeyboardInterrupt), keeping the
checkpoints already written.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils

from scone_jax.runtime import stop_signals


class Preempted(Exception):
    """Training stopped on SIGTERM or SIGINT (`signal_name`) after saving a checkpoint at `step`; rerunning
    resumes."""

    def __init__(self, step: int, signal_name: str = "SIGTERM"):
        super().__init__(f"Stopped by {signal_name} after saving a checkpoint at step {step}; rerun the same command "
                         "to resume.")
        self.step, self.signal_name = step, signal_name


class StartupInterrupted(Exception):
    """SIGTERM arrived between taking the workdir and the first step (tokenizer training, f-gram extraction,
    compilation): nothing was trained, so nothing is saved; the run stops and releases the workdir."""

    def __init__(self):
        super().__init__("Stopped by SIGTERM during start-up, before the first step: nothing was trained or saved, "
                         "and the workdir is free again. Rerun the same command to start.")


@contextlib.contextmanager
def stop_on_sigterm_until_training():
    """SIGTERM raises StartupInterrupted inside the block (a lone process; in a multi-process job jax's
    preemption service owns SIGTERM, and the loop's Watch makes all processes stop at one step). The
    training loop's Watch takes SIGTERM over once it starts; the previous handler is back on exit."""
    if jax.process_count() > 1:
        yield
        return

    previous = stop_signals.install(signal.SIGTERM, StartupInterrupted)  # raised again if swallowed
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Watch:
    """Watches for SIGTERM and SIGINT from creation until close() (the training loop's lifetime)."""

    def __init__(self):
        self._signalled: str | None = None  # the name of the first signal that asked the run to stop
        self._previous: dict[int, object] = {}
        self._multi_process = jax.process_count() > 1
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only (a loop run from a thread: tests)
        if not self._multi_process:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)

    def close(self) -> None:
        """Give the signals back to their previous handlers."""
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}

    @property
    def stopped_by(self) -> str:
        """The signal that stopped the run: SIGINT if a Ctrl-C asked, else SIGTERM (the preemption service's)."""
        return self._signalled or "SIGTERM"

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._signalled is None:
            self._signalled = name
            logging.warning("%s received: finishing this step, then saving a checkpoint and exiting%s.", name,
                            " (Ctrl-C again to stop at once, without that checkpoint)" if name == "SIGINT" else "")
            if self._multi_process:  # the service makes every process stop at one step; it listens for SIGTERM
                if not jax.config.jax_enable_preemption_service:  # no service to tell: stop at once
                    stop_signals.raising(KeyboardInterrupt)(signum, frame)
                os.kill(os.getpid(), signal.SIGTERM)
        elif signum == signal.SIGINT:  # a second Ctrl-C: stop now
            stop_signals.raising(KeyboardInterrupt)(signum, frame)

    def reached(self, step: int) -> bool:
        """True when training should save at `step` and stop (call once per step, every step)."""
        if self._multi_process:
            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # preemption service disabled (jax_enable_preemption_service)
                return False
        return self._signalled is not None
