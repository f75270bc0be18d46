"""JAX's persistent compilation cache, so a restarted job loads its compiled steps instead of
compiling them again (docs/training.md, "Restarts").

`train.compilation_cache_dir` names the directory: relative paths are inside the workdir (the
default, `compilation_cache`, so every worker of a restarted pod job finds the cache its first
run wrote), absolute paths and gs:// URLs are used as they are, '' switches the cache off. A path
that cannot be a directory (one under a regular file) is refused in one line.

JAX reads and writes its cache through the local file system. A gs:// cache is therefore copied
into a local directory when the process starts and the new entries are copied back (by process 0,
the only one JAX writes from) every minute and when the job ends, through the same kvstore as the
rest of the workdir. The local copy is a scratch directory of this process (one a killed process left
is removed by the next start). The cache is keyed by the program, the devices and the JAX/XLA
versions, so a changed config or a new JAX simply misses; JAX's keys also hold the cache's own path
(through XLA's autotuning cache inside it), so a moved local cache misses too, and a gs:// cache's
copy goes without XLA's caches, whose path would change at every start.

The cache heals itself. JAX never overwrites an entry, so one it cannot read (empty or cut short
when the disk filled up) would cost every later start a recompile: `heal` removes such entries at
start, and the temporary files of writers that died. An entry that reads but holds another program
(a hand-copied file) makes JAX fail when it loads it; `compile` (the train step's first compile goes
through it) turns that into a miss that replaces the entry.

JAX fixes its cache directory once per process, so a directory already set (JAX_COMPILATION_CACHE_DIR
in the environment, or an earlier run in the same process) is kept, and said so in the log; it is not
healed either (it is not ours: the test suite shares one between its processes).
"""
from __future__ import annotations

import contextlib
import logging as std_logging
import os
import shutil
import tempfile

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from scone_jax.runtime import parent_watch, storage
from scone_jax.runtime.errors import one_line

try:  # how JAX reads an entry back (zstandard or zlib, whichever it wrote with); private, so optional
    from jax._src.compilation_cache import decompress_executable as _decompress
except ImportError:  # then only empty and unreadable entries are found
    _decompress = None

DEFAULT = "compilation_cache"
# Programs that compile faster than this are not worth a file (JAX's default is 1 s; the f-gram
# and checksum programs of a small job compile in a fraction of that, and each adds to a restart).
_MIN_COMPILE_S = 0.2
_ENTRY, _ACCESS_TIME = "-cache", "-atime"  # JAX's entry <key>-cache and, with eviction on, <key>-atime beside it
TEMPORARY = ".tmp-"  # <name>.tmp-<pid>: a file being written, renamed to <name> when whole
_SCRATCH = "scone_jax_compile_cache"  # <tmp>/scone_jax_compile_cache-<pid>-*: local copies of gs:// caches


def resolve(setting: str, workdir: str) -> str:
    """The cache directory for `setting` (the config value) in `workdir`; '' when switched off."""
    if not setting:
        return ""
    if storage.is_remote(setting) or os.path.isabs(setting):
        return setting
    return storage.join(workdir, setting)


class CompileCache:
    """Switches JAX's persistent cache on for this process, at `directory` ('' = off), named `flag` in errors.

    JAX keeps that directory for the rest of the process. `close()` copies new entries of a gs:// cache
    back and switches that cache (its local copy is removed) off again."""

    def __init__(self, directory: str, flag: str = "train.compilation_cache_dir"):
        self.directory, self._mirror, self._copy = directory, None, None  # _copy: the local copy of a gs:// cache
        self._xla_caches = None
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
            parent_watch.remove_stale_scratch(tempfile.gettempdir(), _SCRATCH)  # copies of killed runs
            local = self._copy = tempfile.mkdtemp(prefix=parent_watch.scratch_name(_SCRATCH))
            copied = copy_in(directory, local)
            logging.info("Compilation cache: %d entries copied from %s", copied, directory)
            # JAX puts the directory of XLA's own caches, inside its cache, into every key: with the copy's path,
            # new at each start, nothing copied in would ever be found. (XLA's caches are not copied anyway.)
            self._xla_caches = jax.config.jax_persistent_cache_enable_xla_caches
            jax.config.update("jax_persistent_cache_enable_xla_caches", "")
        else:
            _create(local, flag)
        heal(local)
        if self._copy is not None and jax.process_index() == 0:  # after heal: what it removed is not "from remote"
            self._mirror = storage.DirectoryMirror(local, directory, skip_existing=True)
        _use(local, _MIN_COMPILE_S)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def close(self) -> None:
        """Copy a gs:// cache's new entries back (process 0) and remove the local copy."""
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
        if self._copy is not None:
            _use(None, _MIN_COMPILE_S)  # a later compile must not write into the removed copy
            jax.config.update("jax_persistent_cache_enable_xla_caches", self._xla_caches)
            shutil.rmtree(self._copy, ignore_errors=True)
            self._copy = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _create(directory: str, flag: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag}: the compilation cache directory {directory} cannot be created ({one_line(e)}). "
                         f"Fix: point {flag} at a directory (no part of the path may be a regular file), or set it "
                         "to '' to switch the cache off.") from None


def _use(directory: str | None, min_compile_s: float) -> None:
    """Point JAX's persistent cache at `directory` (None: off), effective for the next compile."""
    jax_cache.reset_cache()  # JAX opens its cache once; a directory set later would otherwise be ignored
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)


def temporary_path(path: str) -> str:
    """Where to write `path` before renaming it there: `heal` removes it if this process dies first."""
    return f"{path}{TEMPORARY}{os.getpid()}"


def heal(directory: str) -> list[str]:
    """Remove the entries of the local cache `directory` that JAX cannot read (empty, cut short, unreadable)
    and the temporary files of processes that no longer run (on this host); returns their names. Another
    process healing or writing the same directory at once costs at most a recompile."""
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or not (_dead_temporary(name) or (name.endswith(_ENTRY) and not _readable(path))):
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            continue  # removed by another process
        except OSError as e:
            logging.warning("Compilation cache: could not remove the unusable %s: %s", path, one_line(e))
            continue
        removed.append(name)
    if removed:
        logging.warning("Compilation cache: removed %d unusable files from %s (empty or damaged entries, which JAX "
                        "would recompile at every start, or temporary files of dead processes): %s",
                        len(removed), directory, ", ".join(removed))
    return removed


def _dead_temporary(name: str) -> bool:
    pid = name.rpartition(TEMPORARY)[2] if TEMPORARY in name else ""
    return pid.isdigit() and int(pid) != os.getpid() and not parent_watch.process_alive(int(pid))


def _readable(path: str) -> bool:
    """Whether JAX can read the entry at `path` back (its executable is checked when it is loaded)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if _decompress is not None:
            _decompress(raw)
    except Exception:  # noqa: BLE001 - any failure to read or decompress: JAX would fail alike
        return False
    return len(raw) > 0


def compile(lowered):  # noqa: A001 - the lowered program's compile, with the cache's failure healed
    """`lowered.compile()`, where a cache entry under the program's key that holds another program (JAX loads
    it and fails, e.g. `AssertionError: (63, 68)`) is a miss: the entry is removed and the program compiled
    afresh, which writes the right one (process 0; JAX writes from no other)."""
    with _keys_loaded() as keys:
        try:
            return lowered.compile()
        except Exception as e:  # noqa: BLE001 - raised as it is unless it came from a cache entry
            failure = e
    directory = jax.config.jax_compilation_cache_dir
    if not keys or not directory or storage.is_remote(directory):
        raise failure
    logging.warning("Compilation cache: the program loaded from %s fails (%s: %s); removing its entry and "
                    "compiling it again", directory, type(failure).__name__, one_line(failure, 200))
    for key in keys:
        for suffix in (_ENTRY, _ACCESS_TIME):
            try:
                os.remove(os.path.join(directory, key + suffix))
            except FileNotFoundError:
                pass
    jax.clear_caches()  # JAX keeps the executable it loaded in memory too
    return lowered.compile()


@contextlib.contextmanager
def _keys_loaded():
    """The keys of the entries JAX loads meanwhile (a list): JAX's compiler logs each hit at debug level with
    its key. Its debug records are let through to the log only if they were shown before."""
    logger = std_logging.getLogger("jax._src.compiler")
    shown, level, keys = logger.getEffectiveLevel(), logger.level, []

    def note(record) -> bool:
        if str(record.msg).startswith("Persistent compilation cache hit") and record.args:
            keys.append(str(record.args[-1]))
        return record.levelno >= shown

    logger.addFilter(note)
    logger.setLevel(std_logging.DEBUG)
    try:
        yield keys
    finally:
        logger.setLevel(level)
        logger.removeFilter(note)


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
