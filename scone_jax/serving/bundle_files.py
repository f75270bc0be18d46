"""A local bundle's files read as what they claim to be: regular files inside the bundle.

A bundle is a directory that may have been copied, unpacked or handed over. Its readers hash and report what
they read, so a symbolic link from inside it to any file the user can read would have that file's CRC-32
printed (or its bytes parsed), and reading a FIFO in a table file's place blocks forever. So every file a
reader opens is first resolved: a link that leads out of the bundle, a link to a directory, and anything that
is not a regular file (FIFO, socket, device) is refused in one line naming it. A link to a regular file inside
the bundle is followed (a copy made with links stays readable). Files are opened with O_NONBLOCK (a FIFO
swapped in after the check does not block the open) and checked again on the open descriptor.
gs:// objects are always plain objects: nothing to check there.
"""
from __future__ import annotations

import errno
import os
import stat

from scone_jax.runtime import storage

_FIX = "Fix: put the file itself there (a copy, not a link), or export again into a fresh --output."


class UnsafeBundleFile(ValueError):
    """A bundle path that is a link out of the bundle or not a regular file; `what` says which, after the path."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path} {what}. {_FIX}")
        self.what = what


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def resolve(root: str, key: str, want_dir: bool = False) -> str | None:
    """The real path of `key` (e.g. 'table/000000003') under the local bundle `root`; None if nothing is there.
    UnsafeBundleFile if it leads out of the bundle or is not a regular file (a directory, with `want_dir`)."""
    path = os.path.join(root, key)
    if not os.path.lexists(path):
        return None
    base, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([base, real]) != base:
        raise UnsafeBundleFile(path, "is a symbolic link that leads out of the bundle (a bundle's files are read only "
                                     "inside it)")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:  # a dangling link
        return None
    if want_dir and stat.S_ISDIR(mode):
        if os.path.islink(path):
            raise UnsafeBundleFile(path, "is a symbolic link to a directory (a bundle's directories are read only as "
                                         "real directories)")
        return real
    if not stat.S_ISREG(mode):
        raise UnsafeBundleFile(path, f"is {_kind(mode)}, not a regular file")
    return real


def open_regular(root: str, key: str) -> tuple[int, str] | None:
    """(a read-only descriptor, the real path) of the regular file `key` inside the local bundle `root` (resolve's
    rules); None if it is missing. The caller closes the descriptor."""
    real = resolve(root, key)
    if real is None:
        return None
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # replaced by a link since it was resolved
            raise UnsafeBundleFile(os.path.join(root, key), "became a symbolic link while it was opened") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeBundleFile(os.path.join(root, key), f"is {_kind(mode)}, not a regular file")
    return fd, real


def read_bytes(root: str, key: str) -> bytes | None:
    """The whole file `key` of the bundle at `root` (local or gs://), or None if there is none."""
    if storage.is_remote(root):
        return storage.read_bytes(root, key)
    opened = open_regular(root, key)
    if opened is None:
        return None
    fd = opened[0]
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def check_tree(root: str, directory: str) -> None:
    """Every entry under `directory` of the local bundle `root` is a real directory or a regular file inside the
    bundle (resolve's rules); gs:// has nothing to check. For pieces that libraries read by path (orbax's
    decoder, the vocabulary's zarr arrays): they would follow any link and block on any FIFO."""
    if storage.is_remote(root) or resolve(root, directory, want_dir=True) is None:
        return
    for parent, dirs, files in os.walk(os.path.join(root, directory)):
        for name in dirs + files:
            resolve(root, os.path.relpath(os.path.join(parent, name), root), want_dir=name in dirs)
