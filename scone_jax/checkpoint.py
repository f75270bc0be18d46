"""Checkpoints: train state + data-iterator state + metadata, saved together by orbax.

Metadata holds the resolved config and the fingerprints of what the state depends on
(tokenizer, f-gram vocabulary); restoring against different ones is refused, never silent.

Every process of a multi-process job calls save and restore (orbax coordinates them). The
data-iterator state is per process (each reads its own documents), so a checkpoint restored
with a different process count restores the train state only: the data iterators start
from the beginning of the data, with a warning. Refusing would strand a run whose slice
came back with another size; re-reading data is the lesser harm.
"""
from __future__ import annotations

import logging
import os

import grain
import jax
import orbax.checkpoint as ocp

from scone_jax import storage

_STATE, _DATA, _META = "state", "data", "meta"


class CheckpointMismatchError(ValueError):
    """The checkpoint was made with a different tokenizer, vocabulary or model shape."""


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

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_iterator, meta: dict) -> None:
        items = {
            _STATE: ocp.args.StandardSave(state),
            _META: ocp.args.JsonSave({**meta, "process_count": jax.process_count()}),
        }
        if data_iterator is not None:
            items[_DATA] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]

    def restore(self, step: int, abstract_state, data_iterator=None, expect: dict | None = None):
        """Restore onto `abstract_state` (ShapeDtypeStructs with the *current* shardings, so a
        different mesh or device count works) and, if given, rewind `data_iterator` in place."""
        meta = self.read_meta(step)
        check_compatible(meta, expect or {}, f"{self.directory}/{step}")
        items = {_STATE: ocp.args.StandardRestore(abstract_state)}
        saved_by = meta.get("process_count", jax.process_count())
        if data_iterator is not None and saved_by != jax.process_count():
            logging.warning(
                "Checkpoint %s/%d was saved by %d processes and this run has %d: restoring the train "
                "state only; the data iterators start from the beginning of the data.",
                self.directory, step, saved_by, jax.process_count())
            data_iterator = None
        if data_iterator is not None:
            items[_DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        logging.info("Restored checkpoint %s/%d", self.directory, step)
        return restored[_STATE], meta

    def wait(self) -> None:
        """Block until an async save is fully committed."""
        self.manager.wait_until_finished()

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
