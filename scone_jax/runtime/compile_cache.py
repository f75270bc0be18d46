"""JAX's persistent compilation cache, so a restarted job loads its compiled steps instead of
compiling them again (docs/training.md, "Restarts").

`train.compilation_cache_dir` names the directory: relative paths are inside the workdir (the
default, `compilation_cache`, so every worker of a restarted pod job finds the cache its first
run wrote), absolute paths and gs:// URLs are used as they are, '' switches the cache off.

JAX reads and writes its cache through the local file system. A gs:// cache is therefore copied
into a local directory when the process starts and the new entries are copied back (by process 0,
the only one JAX writes from) every minute and when the job ends, through the same kvstore as the
rest of the workdir. The cache is keyed by the program, the devices and the JAX/XLA versions, so a
changed config or a new JAX simply misses; a cache entry that cannot be read is recompiled.

JAX fixes its cache directory once per process, so a directory already set (JAX_COMPILATION_CACHE_DIR
in the environment, or an earlier run in the same process) is kept, and said so in the log.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import jax
from absl import logging

from scone_jax.runtime import storage

DEFAULT = "compilation_cache"
# Programs that compile faster than this are not worth a file (JAX's default is 1 s; the f-gram
# and checksum programs of a small job compile in a fraction of that, and each adds to a restart).
_MIN_COMPILE_S = 0.2


def resolve(setting: str, workdir: str) -> str:
    """The cache directory for `setting` (the config value) in `workdir`; '' when switched off."""
    if not setting:
        return ""
    if storage.is_remote(setting) or os.path.isabs(setting):
        return setting
    return storage.join(workdir, setting)


class CompileCache:
    """Switches JAX's persistent cache on for this process, at `directory` ('' = off).

    JAX opens the cache at the first compilation after a directory is set and keeps that directory for
    the rest of the process. `close()` copies new entries of a gs:// cache back."""

    def __init__(self, directory: str):
        self.directory, self._mirror, self._copy = directory, None, None  # _copy: the local copy of a gs:// cache
        if not directory:
            return
        already = jax.config.jax_compilation_cache_dir
        if already:
            if already != directory:
                logging.info("Compilation cache: this process already uses %s (kept; %s is not used)", already, directory)
            self.directory = already
            return
        local = directory
        if storage.is_remote(directory):
            local = self._copy = tempfile.mkdtemp(prefix="scone_jax_compile_cache-")
            copied = copy_in(directory, local)
            logging.info("Compilation cache: %d entries copied from %s", copied, directory)
            if jax.process_index() == 0:
                self._mirror = storage.DirectoryMirror(local, directory, skip_existing=True)
        else:
            os.makedirs(local, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", local)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_S)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def close(self) -> None:
        """Copy a gs:// cache's new entries back (process 0) and remove the local copy."""
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
        if self._copy is not None:
            shutil.rmtree(self._copy, ignore_errors=True)
            self._copy = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def copy_in(remote: str, local: str) -> int:
    """Copy every entry of the remote cache into `local`; an unreadable one is skipped (recompiled)."""
    store = storage.open_store(remote)
    copied = 0
    for key in store.list().result():
        name = key.decode()
        if "/" in name:
            continue
        try:
            raw = store.read(key).result()
        except Exception as e:  # noqa: BLE001 - a cache miss, not an error
            logging.warning("Compilation cache entry %s unreadable (it will be recompiled): %s", name, e)
            continue
        if raw.state == "value":
            with open(os.path.join(local, name), "wb") as f:
                f.write(bytes(raw.value))
            copied += 1
    return copied
