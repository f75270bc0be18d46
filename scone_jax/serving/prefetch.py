"""Host work ahead of the device: batch i+1's f-gram rows are gathered and sent while the device runs batch i."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator


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
