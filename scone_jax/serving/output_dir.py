"""Where an exporter may write: a directory it can fill without destroying anything of the user's.

An export (any format) writes only into a missing or empty directory, or into one that holds nothing but what
an export of its kind writes, including the file that says which export it is (its claim: export.json for
a bundle). Such a directory is an unfinished or finished export, which the exporter then compares with its
own run (resume, repair, or refuse a different one). Anything else there, a user's file, another program's
output, a training workdir, or an export's pieces without their claim, is refused in one line before a
byte is written: exporting would replace or delete it. Local paths and gs:// URLs alike.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from scone_jax.runtime import outputs, storage, write_probe
from scone_jax.serving import bundle_files


# The rule every program's outputs follow (runtime/outputs.py), applied here to a whole export directory.
OutputNotFreeError = outputs.OutputNotFreeError


def entries(path: str) -> list[str] | None:
    """The names directly under the directory `path` (for gs://: the first component of every object key under
    it); None if there is nothing at `path`. OutputNotFreeError if a local `path` is a file."""
    if storage.is_remote(path):
        keys = storage.open_store(path).list().result()
        names = sorted({k.decode().split("/", 1)[0] for k in keys})
        return names or None
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        raise OutputNotFreeError(f"--output={path} is a file, not a directory; nothing was written. Fix: pass a new "
                                 "or empty directory for the export.")
    return sorted(os.listdir(path))


def claim(path: str, *, names: Iterable[str], prefixes: Iterable[str] = (), marker: str,
          is_ours: Callable[[bytes], bool], kind: str, flag: str = "--output") -> bool:
    """Whether `path` may receive an export of `kind` (e.g. 'a scone_jax export'): False if it is missing or
    empty (a fresh export), True if it holds an export of that kind (entries among `names`, or starting with one
    of `prefixes`, and `marker`, whose bytes `is_ours` recognises; the caller compares it with its own run).
    OutputNotFreeError, one line, for anything else. Reads only."""
    # A probe file (runtime/write_probe.py) is not content: another process of the same job may be probing this
    # directory right now, or a killed probe left it.
    present = [n for n in entries(path) or () if not n.startswith(write_probe.PROBE_PREFIX)]
    if not present:
        return False
    names, prefixes = set(names), tuple(prefixes)
    foreign = [n for n in present if n not in names and not n.startswith(prefixes)]
    fix = (f"Fix: pass a new or empty directory for {flag}, or remove what is there (an export writes only into "
           "one of those, or into an unfinished export of the same run, which it resumes).")
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputNotFreeError(f"{flag}={path} holds {shown}, which {kind} does not write; nothing was written "
                                 f"there. {fix}")
    raw = bundle_files.read_bytes(path, marker) if marker in present else None
    if raw is None or not is_ours(raw):
        what = f"no {marker}" if raw is None else f"the {marker} there is not {kind}'s"
        raise OutputNotFreeError(f"{flag}={path} holds {', '.join(present)} but {what}: not {kind} this program "
                                 f"wrote, so it would be overwritten; nothing was written there. {fix}")
    return True
