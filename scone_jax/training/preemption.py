"""Noticing SIGTERM (TPU maintenance, spot preemption) so training can checkpoint and stop.

The loop asks `reached(step)` after every step. A lone process answers from its own SIGTERM
handler. In a multi-process job, jax's preemption service (started by
jax.distributed.initialize) owns SIGTERM instead: one process getting the signal makes all of
them agree on the same step to stop at, so they save one consistent checkpoint together. A
handler of ours would replace the service's, so none is installed there.
"""
from __future__ import annotations

import contextlib
import signal

import jax
from absl import logging
from jax.experimental import multihost_utils

from scone_jax.runtime import stop_signals


class Preempted(Exception):
    """Training stopped on SIGTERM after saving a checkpoint at `step`; rerunning resumes."""

    def __init__(self, step: int):
        super().__init__(f"Stopped by SIGTERM after saving a checkpoint at step {step}; rerun to resume.")
        self.step = step


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
    """Watches for SIGTERM from creation until close() (the training loop's lifetime)."""

    def __init__(self):
        self._signalled = False
        self._previous = None
        self._multi_process = jax.process_count() > 1
        if not self._multi_process:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def close(self) -> None:
        """Give SIGTERM back to its previous handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        del signum, frame
        logging.warning("SIGTERM received: finishing this step, then saving a checkpoint and exiting.")
        self._signalled = True

    def reached(self, step: int) -> bool:
        """True when training should save at `step` and stop (call once per step, every step)."""
        if self._multi_process:
            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # preemption service disabled (jax_enable_preemption_service)
                return False
        return self._signalled
