"""Small files on local disk or GCS through one API (tensorstore's kvstore).

The run directory, the export bundle and the tokenizer may all live at gs:// URLs on a pod. The
objects written here are small (JSON, a tokenizer, markers, metric logs); arrays go through
tensorstore's array drivers and checkpoints through orbax. A kvstore write of one key replaces
the whole object at once, so readers never see a half-written file.
"""
from __future__ import annotations

import os
import threading

import tensorstore as ts
from absl import logging


def is_remote(path: str) -> bool:
    """True for URLs (gs://... and any other tensorstore kvstore URL); False for local paths."""
    return "://" in path


def resolved(path: str) -> str:
    """`path` as the programs pass it on: URLs as they are, local paths absolute and normalised, resolved once
    where a program takes them (tensorstore's file driver, under orbax too, refuses a path holding '..')."""
    return path if is_remote(path) or not path else os.path.abspath(path)


def join(path: str, *names: str) -> str:
    """Path join that keeps URLs (gs://bucket/...) intact."""
    return "/".join([path.rstrip("/"), *names])


def kvstore_url(path: str) -> str:
    """A tensorstore kvstore URL for a directory: URLs pass through, local paths become file://."""
    if is_remote(path):
        return path.rstrip("/") + "/"
    return "file://" + os.path.abspath(path) + "/"


def open_store(path: str) -> ts.KvStore:
    return ts.KvStore.open(kvstore_url(path)).result()


def read_bytes(path: str, key: str) -> bytes | None:
    """The object `key` under directory `path`, or None if there is none."""
    raw = open_store(path).read(key).result()
    return bytes(raw.value) if raw.state == "value" else None


def write_bytes(path: str, key: str, data: bytes) -> None:
    open_store(path).write(key, data).result()


def delete(path: str, key: str) -> None:
    """Remove the object `key` under directory `path` (nothing happens if there is none)."""
    open_store(path).write(key, None).result()


def read_file(path: str) -> bytes | None:
    """A whole file given by its own path or URL, or None if it does not exist."""
    directory, _, name = path.rstrip("/").rpartition("/")
    return read_bytes(directory or ".", name)


def write_file(path: str, data: bytes) -> None:
    directory, _, name = path.rstrip("/").rpartition("/")
    write_bytes(directory or ".", name, data)


class DirectoryMirror:
    """Copies the files of a local directory to `remote` every `every_s` seconds and at close.

    For append-style files (metric logs, TensorBoard events) that a run writes to a gs:// workdir:
    object stores cannot append, so the files grow on local disk and are uploaded whole when they
    changed. A failed upload is logged and retried at the next round; training never waits on it.
    """

    def __init__(self, local: str, remote: str, every_s: float = 60.0, skip_existing: bool = False):
        """`skip_existing`: the files already in `local` came from `remote`; upload only later changes."""
        self.local, self.remote, self.every_s = local, remote, every_s
        self._uploaded: dict[str, tuple[int, int]] = dict(self._versions()) if skip_existing else {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="directory-mirror", daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.wait(self.every_s):
            self.sync()

    def sync(self) -> bool:
        """Upload every file that changed since its last upload; True if all are up to date.
        Called by the mirror's thread, and once more by close() after that thread has ended."""
        complete = True
        for key, version in self._versions():
            if self._uploaded.get(key) == version or version[0] == 0:
                continue  # unchanged, or nothing in it yet
            try:
                with open(os.path.join(self.local, key), "rb") as f:
                    write_bytes(self.remote, key, f.read())
                self._uploaded[key] = version
            except Exception as e:  # storage errors vary by driver; retried next round
                logging.warning("Could not copy %s to %s (retrying later): %s", key, self.remote, e)
                complete = False
        return complete

    def _versions(self):
        """(key, (size, mtime)) of every file under the local directory."""
        for root, _, names in os.walk(self.local):
            for name in names:
                path = os.path.join(root, name)
                stat = os.stat(path)
                yield os.path.relpath(path, self.local).replace(os.sep, "/"), (stat.st_size, stat.st_mtime_ns)

    def close(self, upload: bool = True) -> bool:
        """Stop the thread and (unless `upload` is False) upload what changed; True if the remote
        copy is complete."""
        self._stop.set()
        self._thread.join()
        return self.sync() if upload else False
