"""A jax.profiler trace of chosen training steps, for TensorBoard's profile plugin or Perfetto
(docs/training.md, "Profiles").

`train.profile_steps='START:END'` traces steps START to END (1-based, inclusive; a run resumed inside
the range traces the rest of it) into WORKDIR/profile/plugins/profile/<time>/: `<host>.xplane.pb`
(TensorBoard: `tensorboard --logdir WORKDIR/profile`, Profile tab) and `<host>.trace.json.gz`
(ui.perfetto.dev opens it). In the trace each step is a `train` step annotation and the time the
loop waited for its next batch is `input_wait`. Process 0 traces, or every process with
train.profile_all_processes. With a gs:// workdir the trace is written locally and copied there
when it ends. Tracing changes no result: the same steps run, only observed.

A range past train.num_steps is refused by config.validate. A start that trains none of the range (resumed
past END, or stopped by train.max_steps_per_run before START) says so in one warning line at start
(`unreached`); a later start inside the range traces it. On a machine without a TPU the main job keeps
libtpu out of the process (runtime/platforms.py says why); a process that loaded it anyway is refused
before training (`check_tracer`) instead of crashing in jax.profiler.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import jax
from absl import logging

from scone_jax.runtime import platforms, storage, workdir as workdir_layout


def parse_steps(text: str) -> tuple[int, int] | None:
    """(START, END) of train.profile_steps (checked by config.validate), None for ''."""
    if not text:
        return None
    start, end = text.split(":")
    return int(start), int(end)


def unreached(setting: str, first: int, last: int) -> str | None:
    """The warning for a start that trains steps `first`..`last` and none of train.profile_steps, else None."""
    span = parse_steps(setting)
    if span is None or first > last or (span[0] <= last and first <= span[1]):
        return None
    where = (f"it resumed past step {span[1]}" if first > span[1] else
             f"it stops at step {last} (train.max_steps_per_run) before step {span[0]}: a later start traces them")
    return (f"train.profile_steps={setting}: this start trains steps {first} to {last}, so it traces none of "
            f"them ({where}).")


def check_tracer(setting: str) -> None:
    """Refuse (ValueError) a profile that jax.profiler would answer with a segmentation fault: libtpu loaded
    in a process that runs on another backend (runtime/platforms.py)."""
    if setting and platforms.libtpu_loaded_off_tpu():
        raise ValueError(
            f"train.profile_steps={setting}: this process loaded libtpu (installed here) but runs on the "
            f"{jax.default_backend()}, and libtpu's profiler crashes jax.profiler outside a TPU. Fix: set "
            "JAX_PLATFORMS=cpu (or cuda) before JAX starts (python -m scone_jax.main does so itself on a machine "
            "without a TPU), or train.profile_steps=''.")


class StepProfiler:
    """Starts the trace before step START (or the first step of a run resumed inside the range) and stops
    it after step END or when the loop ends."""

    def __init__(self, setting: str, workdir: str, enabled: bool):
        self._range = parse_steps(setting) if enabled else None
        self._target = workdir_layout.path(workdir, workdir_layout.PROFILE)
        self._local = None

    def before(self, step: int) -> None:
        """Called before step `step` runs."""
        if self._range and self._local is None and self._range[0] <= step <= self._range[1]:
            self._local = (tempfile.mkdtemp(prefix="scone_jax_profile-") if storage.is_remote(self._target)
                           else self._target)
            jax.profiler.start_trace(self._local)
            logging.info("Profiling steps %d to %d into %s", step, self._range[1], self._target)

    def after(self, step: int, outputs) -> None:
        """Called once step `step` is dispatched; `outputs` are waited for before the trace stops."""
        if self._local is not None and step >= self._range[1]:
            jax.block_until_ready(outputs)
            self._stop()

    def close(self) -> None:
        if self._local is not None:
            self._stop()

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        local, self._local, self._range = self._local, None, None
        if local != self._target:
            for root, _, names in os.walk(local):
                for name in names:
                    key = os.path.relpath(os.path.join(root, name), local).replace(os.sep, "/")
                    with open(os.path.join(root, name), "rb") as f:
                        storage.write_bytes(self._target, key, f.read())
            shutil.rmtree(local, ignore_errors=True)
        logging.info("Profile written to %s (tensorboard --logdir %s, Profile tab; or the .trace.json.gz in "
                     "ui.perfetto.dev)", self._target, self._target)
