"""What this package keeps on a host for its user: the block copies of compressed inputs (compressed.py)
and the CRC-32s of large input files (training-file identity, identity.py).

Both decide what a run trains on, so they live where only this user can write: `$SCONE_JAX_BLOCK_CACHE`,
else `$XDG_CACHE_HOME/scone_jax`, else `~/.cache/scone_jax`, created with mode 0700. A directory that
another user owns, or that others may write to, is refused in one line: whoever can write there chooses
the text a run trains on (the old place, a fixed name in the shared temporary directory, let any local
user create it first). Files are written under `<name>.tmp-<host>-<pid>` and renamed; those of processes
that no longer run on this host are removed when the directory is first used.

A file's CRC is read whole; for files of at least MEMO_MIN_BYTES it is kept, keyed by the path, device,
inode, size and modification and change times, so a restart does not read a large corpus again. Copying
a file over another (`cp -p`, `rsync -a` restore the modification time, never the change time) or writing
it in place changes the key. A CRC is not kept for a file changed within RACY_NS of the read: a second
change inside the same timestamp tick would leave every time unchanged.
"""
from __future__ import annotations

import hashlib
import os
import socket
import stat
import time
import zlib

from scone_jax.runtime.errors import one_line
from scone_jax.runtime.parent_watch import process_alive

ENV = "SCONE_JAX_BLOCK_CACHE"
MEMO_MIN_BYTES = 64 << 20  # smaller files are read again (about 20 ms), leaving no entry behind
RACY_NS = 2_000_000_000
_READ_BYTES = 1 << 22
_checked: set[str] = set()  # directories checked and cleaned by this process
_crcs: dict[tuple, str] = {}  # this process's CRCs, by file key


class CacheDirectoryError(ValueError):
    pass


def directory() -> str:
    """The per-user cache directory, created (0700) and checked: a one-line CacheDirectoryError if it is
    not a directory of this user's that only this user may write to."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.abspath(os.environ.get(ENV) or os.path.join(base, "scone_jax"))
    fix = f"set ${ENV} to a directory of your own"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        raise CacheDirectoryError(f"The cache directory {path} cannot be made ({one_line(e)}). Fix: {fix}.") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirectoryError(f"The cache directory {path} is not a directory. Fix: {fix}.")
    if st.st_uid != os.getuid():
        raise CacheDirectoryError(
            f"The cache directory {path} belongs to user id {st.st_uid}, not to you ({os.getuid()}): its owner "
            f"could choose the text your runs train on. Fix: {fix}, or remove {path}.")
    if st.st_mode & 0o022:
        raise CacheDirectoryError(
            f"The cache directory {path} may be written by others (mode {stat.S_IMODE(st.st_mode):o}): they could "
            f"choose the text your runs train on. Fix: chmod 700 {path}, or {fix}.")
    if path not in _checked:
        _checked.add(path)
        remove_dead_temporaries(path)
    return path


def temporary(path: str) -> str:
    """This process's name for `path` while it is written."""
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"


def remove_dead_temporaries(directory_: str) -> list[str]:
    """Delete `*.tmp-<host>-<pid>` files in `directory_` of processes that no longer run on this host (another
    host's, on a shared home directory, are left alone); returns them."""
    removed, host = [], socket.gethostname()
    for name in os.listdir(directory_):
        stem, _, tail = name.rpartition(".tmp-")
        writer, _, pid = tail.rpartition("-")
        if stem and writer == host and pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            try:
                os.unlink(os.path.join(directory_, name))
                removed.append(name)
            except FileNotFoundError:  # another process cleaned it first
                pass
    return removed


def file_id(path: str) -> tuple[int, str]:
    """(size, CRC-32 as 8 hex digits) of all of the file's bytes; read once per content (see the module)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _crcs:
        return st.st_size, _crcs[key]
    memo = None
    if st.st_size >= MEMO_MIN_BYTES:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        memo = os.path.join(directory(), f"{os.path.basename(path)}.{digest}.crc")
        try:
            with open(memo) as f:
                kept = f.read()
            if len(kept) == 8 and set(kept) <= set("0123456789abcdef"):
                _crcs[key] = kept
                return st.st_size, kept
        except (OSError, UnicodeDecodeError):  # none yet, or damaged: read the file
            pass
    crc = read_crc(path)
    after = os.stat(path)
    settled = time.time_ns() - st.st_ctime_ns > RACY_NS
    if settled and (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) == key[2:]:
        _crcs[key] = crc
        if memo:
            _write_memo(memo, crc)
    return st.st_size, crc


def read_crc(path: str) -> str:
    """CRC-32 of all of the file's bytes, as 8 hex digits."""
    crc, buffer = 0, bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
    return f"{crc:08x}"


def _write_memo(memo: str, crc: str) -> None:
    """Keep a CRC for the next process; one that cannot be written (a full disk) is only not kept."""
    scratch = temporary(memo)
    try:
        with open(scratch, "w") as f:
            f.write(crc)
        os.replace(scratch, memo)
    except OSError:
        try:
            os.unlink(scratch)
        except OSError:
            pass
