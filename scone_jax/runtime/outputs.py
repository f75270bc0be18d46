"""The one rule for everything a program writes (a run's workdir, an export, a samples or summary file): nothing
of the user's is overwritten. Checked before the program writes a byte; a refusal is one line (OutputNotFreeError,
a ValueError: exit status 2).

- An output is never one of the program's inputs, nor inside an input directory (an export bundle, a Hugging Face
  checkpoint): writing it would destroy what the program reads. Local paths are compared as resolved real paths,
  so DIR/./file, DIR//file and a symbolic link name the same file; gs:// URLs as normalised text.
- A file an output replaces must be one a program of its kind wrote, recognised by its content (a run's
  config.json, an export's marker: serving/output_dir.py applies this to a whole export directory); anything else
  there is the user's, and is refused naming it.
"""
from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping

from scone_jax.runtime import storage


class OutputNotFreeError(ValueError):
    """An output would overwrite an input or a file its program did not write."""


def _canonical(path: str) -> str:
    if storage.is_remote(path):
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{posixpath.normpath(rest)}"
    return os.path.realpath(path)


def _within(path: str, directory: str) -> bool:
    if storage.is_remote(path) != storage.is_remote(directory):
        return False
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def refuse_inputs(output: str, flag: str, inputs: Mapping[str, str]) -> None:
    """OutputNotFreeError if `output` (passed as `flag`) is one of `inputs` (flag or key -> path; '' skipped: the
    program's inputs, or its other outputs) or lies inside one of them."""
    if not output:
        return
    mine = _canonical(output)
    for name, path in inputs.items():
        if not path:
            continue
        theirs = _canonical(path)
        if mine == theirs:
            raise OutputNotFreeError(f"{flag}={output} names the same path as {name}={path}: writing it would destroy "
                                     f"that; nothing was written. Fix: pass another path for {flag}.")
        if _within(mine, theirs):
            raise OutputNotFreeError(f"{flag}={output} lies inside {name}={path}, which this program reads: writing "
                                     f"there could destroy it; nothing was written. Fix: pass a path outside it for "
                                     f"{flag}.")


def refuse_foreign(directory: str, name: str, *, is_ours: Callable[[bytes], bool], kind: str, flag: str,
                   prefix: int | None = None) -> None:
    """OutputNotFreeError if `directory`/`name` exists and `is_ours(its bytes)` is false: a file the program would
    replace that `kind` (e.g. 'a scone_jax run') did not write. `prefix`: judge by the first bytes only (a file
    that may be large: a run's metrics.jsonl)."""
    store = storage.open_store(directory)
    try:
        found = store.read(name, byte_range=slice(0, prefix)).result()
    except ValueError:  # OUT_OF_RANGE: the file is shorter than `prefix`, so reading it whole is cheap
        found = store.read(name).result()
    if found.state != "value" or is_ours(bytes(found.value)):
        return
    raise OutputNotFreeError(f"{flag}={directory} holds a {name} that is not {kind}'s (it would be replaced); "
                             f"nothing was written. Fix: pass a new or empty directory for {flag}, or move "
                             f"{storage.join(directory, name)} away.")
