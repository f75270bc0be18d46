"""Many reads in flight from one thread: Linux kernel AIO (io_setup / io_submit / io_getevents) through ctypes.

With O_DIRECT the kernel queues every submitted read on the device at once, so one Python thread keeps
the disk's queue full without a thread per read, and the reads cost no GIL: the request blocks are
filled with numpy (one structured array per batch), and one system call submits or collects tens of
them. Without O_DIRECT the kernel serves these reads synchronously; callers use threads then.
Only x86_64 and aarch64 Linux (the syscall numbers below); `available()` says whether it works here.
"""
from __future__ import annotations

import ctypes
import os
from errno import EINTR
import platform
import sys

import numpy as np

# (io_setup, io_destroy, io_getevents, io_submit): asm-generic numbers on aarch64, the x86_64 table otherwise.
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                  ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                  ("flags", "<u4"), ("resfd", "<u4")])  # struct iocb, linux/aio_abi.h (little-endian)
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])  # struct io_event
_PREAD = 0  # IOCB_CMD_PREAD
_WAKE_EVERY = 8  # completions collected per wake-up (fewer system calls and Python rounds; the queue stays deep)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


class AsyncReads:
    """A kernel AIO context with room for `depth` reads in flight."""

    def __init__(self, depth: int = 64):
        numbers = _SYSCALLS.get(platform.machine())
        if not sys.platform.startswith("linux") or numbers is None:
            raise OSError(f"kernel AIO is not wired up on {sys.platform}/{platform.machine()}")
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._libc = _libc()
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        self._call(self._setup, ctypes.c_long(depth), ctypes.byref(self._ctx))
        self._events = np.zeros(depth, _EVENT)

    def _call(self, number: int, *args) -> int:
        while True:
            result = self._libc.syscall(ctypes.c_long(number), *args)
            if result >= 0:
                return result
            errno = ctypes.get_errno()
            if errno != EINTR:  # a signal: Python raises its exception, if any, at the next bytecode
                raise OSError(errno, f"kernel AIO: {os.strerror(errno)}")

    def _collect(self, least: int) -> np.ndarray:
        got = self._call(self._getevents, self._ctx, ctypes.c_long(least), ctypes.c_long(self.depth),
                         ctypes.c_void_p(self._events.ctypes.data), None)
        return self._events[:got].copy()

    def read(self, fds: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray, done) -> None:
        """Read span i (lengths[i] bytes of fds[i] at offsets[i]) to memory at addresses[i], at most `depth` in
        flight; done(indices, results) is called as reads complete (results: bytes read, or -errno), after the
        queue has been refilled, so the caller's work on them overlaps the reads still in flight."""
        n = len(offsets)
        iocbs = np.zeros(n, _IOCB)
        iocbs["data"] = np.arange(n)
        iocbs["opcode"], iocbs["fildes"], iocbs["buf"] = _PREAD, fds, addresses
        iocbs["nbytes"], iocbs["offset"] = lengths, offsets
        pointers = iocbs.ctypes.data + np.arange(n, dtype=np.uint64) * _IOCB.itemsize
        submitted = finished = 0

        def submit():
            nonlocal submitted
            room = min(self.depth - (submitted - finished), n - submitted)
            if room > 0:
                submitted += self._call(self._submit, self._ctx, ctypes.c_long(room),  # struct iocb **
                                        ctypes.c_void_p(pointers.ctypes.data + 8 * submitted))

        try:
            while finished < n:
                submit()
                events = self._collect(min(_WAKE_EVERY, submitted - finished))
                finished += len(events)
                submit()  # refill before the caller's work on what completed
                done(events["data"].astype(np.int64), events["res"])
        finally:  # never leave reads in flight into memory the caller may reuse (an error, an interrupt)
            while submitted > finished:
                finished += len(self._collect(submitted - finished))

    def close(self):
        if self._ctx.value:
            self._call(self._destroy, self._ctx)
            self._ctx = ctypes.c_ulong(0)


def available() -> bool:
    try:
        AsyncReads(1).close()
        return True
    except OSError:
        return False
