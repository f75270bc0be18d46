"""Checkpoints: train state + metadata, saved together by orbax.

Metadata holds the resolved config, the fingerprints of what the state depends on (tokenizer,
f-gram vocabulary) and a checksum of every array of the state (runtime/checksums.py). Restoring against
other fingerprints or array shapes is refused (CheckpointMismatchError); a checkpoint that cannot
be read or whose arrays do not match their checksums is reported as damaged
(CheckpointDamagedError), so the caller can fall back to an older one instead of training on garbage.
A save that fails (disk full, no permission, bucket gone) is reported once, as CheckpointWriteError.

Every process of a multi-process job calls save and restore (orbax coordinates them). The
input pipeline has no state to save: batch b is a pure function of b (data/pipeline.py), so a
run resumes at its step's batch, also with another process count.
"""
from __future__ import annotations

import logging
import os
import time

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from scone_jax import config_keys
from scone_jax.runtime import checksums, distributed, storage
from scone_jax.runtime.errors import one_line

_STATE, _META = "state", "meta"


class CheckpointMismatchError(ValueError):
    """The checkpoint was made with a different tokenizer, vocabulary or model shape."""


class CheckpointDamagedError(ValueError):
    """A checkpoint's files cannot be read or do not hold what was saved (truncated, corrupted)."""

    def __init__(self, directory: str, step: int, why: str):
        self.step = step
        super().__init__(f"Checkpoint {directory}/{step} is damaged: {why}.")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; the newest checkpoint before it is still complete."""


class Checkpointer:
    """Thin wrapper over orbax's CheckpointManager (async saves, keeps the last N)."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        # orbax wants absolute paths; `--workdir=workdirs/tiny` is relative to where we run.
        self.directory = directory if storage.is_remote(directory) else os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
            ),
        )
        self._pending = None  # step of a save that may still be writing

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` (async); a failure surfaces here, in `raise_if_failed` or in `wait`."""
        self.raise_if_failed()
        items = {
            _STATE: ocp.args.StandardSave(state),
            _META: ocp.args.JsonSave({**meta, "process_count": jax.process_count(),
                                      "state_checksums": checksums.tree_checksums(state)}),
        }
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - any storage failure, reported in one line
            raise self._write_error(self._pending if self._pending is not None else step, e) from e
        self._pending = step

    def raise_if_failed(self) -> None:
        """Raise CheckpointWriteError if the save in progress has failed (cheap; call every step)."""
        if self._pending is None or self.manager.is_saving_in_progress():
            return  # nothing to check, or still writing: never block the step on the save
        try:  # the save has ended: this returns at once, or raises what its background thread raised
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_error(self._pending, e) from e
        self._pending = None

    def _write_error(self, step: int, e: BaseException) -> CheckpointWriteError:
        newest = [s for s in self.manager.all_steps() if s != step]
        kept = f"checkpoint step {max(newest)} is intact" if newest else "no earlier checkpoint exists"
        return CheckpointWriteError(
            f"Saving checkpoint step {step} to {self.directory} failed: {one_line(e)}. Training stopped; "
            f"{kept}. Fix the storage (free space, permissions, bucket) and rerun the same command to resume.")

    def read_checkpoint_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, step: int, abstract_state, expect: dict | None = None, *, meta: dict | None = None):
        """Restore onto `abstract_state` (ShapeDtypeStructs with the *current* shardings, so a
        different mesh or device count works) and verify every array against its saved checksum.
        `meta`: the step's metadata if the caller has read it already. Every process calls it (a collective)."""
        try:
            meta = self.read_checkpoint_meta(step) if meta is None else meta
        except Exception as e:  # noqa: BLE001 - unreadable metadata: the step is damaged
            raise CheckpointDamagedError(self.directory, step, f"its metadata cannot be read ({one_line(e)})") from e
        check_compatible(meta, expect or {}, f"{self.directory}/{step}")
        self._check_shapes(step, abstract_state)
        items = {_STATE: ocp.args.StandardRestore(abstract_state)}
        failure = None
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - a file missing, truncated or unparsable
            failure = e
        if distributed.any_process(failure is not None):  # all processes agree before the checksum collective
            why = one_line(failure) if failure is not None else "another process could not read its part"
            raise CheckpointDamagedError(self.directory, step, f"its arrays cannot be read ({why})") from failure
        if "state_checksums" not in meta:
            raise CheckpointDamagedError(self.directory, step, "its metadata holds no array checksums")
        wrong = checksums.first_difference(meta["state_checksums"], checksums.tree_checksums(restored[_STATE]))
        if wrong is not None:
            raise CheckpointDamagedError(self.directory, step, f"array {wrong} does not match the checksum saved with it")
        logging.info("Restored checkpoint %s/%d", self.directory, step)
        return restored[_STATE], meta

    def _check_shapes(self, step: int, abstract_state) -> None:
        """Refuse, in one line, a checkpoint whose arrays have other shapes than the model built now
        (orbax would fail deep inside the restore)."""
        try:
            saved = ocp.StandardCheckpointHandler().metadata(epath.Path(f"{self.directory}/{step}/{_STATE}"))
        except Exception:  # noqa: BLE001 - no usable metadata: the restore itself reports the damage
            return
        want = {_names(p): tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(abstract_state)}
        have = {_names(p): tuple(getattr(a, "shape", ())) for p, a in jax.tree_util.tree_leaves_with_path(saved)}
        for path in sorted(set(want) | set(have)):
            if want.get(path) != have.get(path):
                optimizer = path[:1] == ("1",)  # the state is (model, optimizer): training/state.py
                fix = (config_keys.optimizer_state_fix() if optimizer  # the keys that reshape it: their declarations
                       else "the model config the checkpoint was saved with")
                raise CheckpointMismatchError(
                    f"Checkpoint {self.directory}/{step} does not fit the {'optimizer' if optimizer else 'model'} "
                    f"this config builds: {'/'.join(path)} is {have.get(path, 'absent')} there and "
                    f"{want.get(path, 'absent')} here. Fix: resume with {fix}, or use a fresh --workdir.")

    def set_aside(self, step: int) -> str:
        """Rename a damaged step directory to `damaged-<step>-<unix time>` (kept for inspection; orbax
        no longer sees it, so later saves can reuse the step number). Process 0 renames; all wait for it."""
        target = f"{self.directory}/damaged-{step}-{int(time.time())}"
        if jax.process_index() == 0:
            epath.Path(f"{self.directory}/{step}").rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"scone_jax_set_aside_{step}")
        self.manager.reload()
        return target

    def wait(self) -> None:
        """Block until an async save is fully committed; CheckpointWriteError if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_error(self._pending if self._pending is not None else -1, e) from e
        self._pending = None

    def close(self) -> None:
        self.manager.close()


def check_compatible(meta: dict, expect: dict, where: str) -> None:
    """Refuse a checkpoint whose fingerprints differ from the run's (e.g. another tokenizer)."""
    for key, want in expect.items():
        have = meta.get(key)
        if have != want:
            raise CheckpointMismatchError(
                f"Checkpoint {where} has {key}={have!r} but this run uses {want!r}. "
                "Use a fresh --workdir for a different tokenizer/vocabulary/model, or restore "
                "the matching files."
            )


def _names(path) -> tuple[str, ...]:
    """A tree path as plain names, the same for an nnx.State and orbax's metadata of it."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
