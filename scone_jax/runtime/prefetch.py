"""Host work ahead of the device: batch i+1's f-gram rows are gathered and sent while the device runs batch i,
and no further ahead than the device's runtime allows. The dispatch policy of every loop of independent steps:
held-out evaluation in training and serving (training/evaluation.py), the export, the harness adapter."""
from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import jax


class Prefetcher:
    """Iterates `prepare(item)` over `items`, computed `depth` items ahead on a background thread.

    `prepare` does the host work and starts the device transfer (jax.device_put is asynchronous),
    so the next batch's rows travel while the device runs the current step."""

    _END = object()

    def __init__(self, items: Iterable, prepare: Callable, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iter(items), prepare), daemon=True)
        self._thread.start()

    def _fill(self, items: Iterator, prepare: Callable):
        try:
            for item in items:
                if self._stop.is_set():
                    return
                self._queue.put(("item", prepare(item)))
        except BaseException as e:  # re-raised in the consumer's thread
            self._queue.put(("error", e))
            return
        self._queue.put(("end", self._END))

    def __iter__(self):
        while True:
            kind, value = self._queue.get()
            if kind == "error":
                raise value
            if kind == "end":
                return
            yield value

    def close(self):
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass


class DispatchWindow:
    """Bounds how many independent programs (a loop's steps that do not feed each other) are dispatched and
    not yet finished.

    Two keep an accelerator busy: the host dispatches step i+1 while the device runs step i. On XLA:CPU with
    several local devices (the tests' 8 virtual ones) every device's share of a program is a task on one shared
    thread pool, and a collective waits until all of its devices' tasks reach it. With several independent
    programs in flight the pool can fill with tasks of different programs, each waiting for peers that get no
    thread: XLA logs "rendezvous ... may be stuck", then aborts the process. So one at a time there."""

    def __init__(self, mesh):
        cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
        self.limit = 1 if cpu and len(mesh.local_devices) > 1 else 2
        self._pending: collections.deque = collections.deque()

    def add(self, outputs):
        """`outputs` of a program just dispatched; returns them once fewer than `limit` programs are unfinished,
        so the next dispatch keeps at most `limit` in flight."""
        self._pending.append(outputs)
        while len(self._pending) >= self.limit:
            jax.block_until_ready(self._pending.popleft())
        return outputs
