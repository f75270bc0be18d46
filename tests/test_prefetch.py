"""runtime/prefetch.py's DispatchWindow, counted: how many programs are in flight at each dispatch. (That the
window keeps XLA:CPU from deadlocking under load is tests/test_table.py's process test.)"""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from scone_jax.runtime.prefetch import DispatchWindow


class _Outputs:
    """What one dispatched program returns: finished once waited on (jax.block_until_ready calls this method)."""

    def __init__(self, index: int, finished: list):
        self.index, self.finished = index, finished

    def block_until_ready(self):
        self.finished.append(self.index)
        return self


@pytest.mark.parametrize("devices,limit", [(8, 1), (1, 2), (1, 3)])
def test_the_dispatch_window_never_has_more_programs_in_flight_than_its_limit(devices, limit):
    """After each add() at most limit - 1 programs are unfinished, so the next dispatch makes at most `limit`; the
    window waits on the oldest first and no more often than that. Caught: `>` for `>=` in add's loop (limit + 1
    in flight); waiting on the newest instead of the oldest; the limit of 8 CPU devices set to 2."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    window = DispatchWindow(mesh)
    assert window.limit == (1 if devices > 1 else 2)  # several CPU devices share one thread pool: one at a time
    window.limit = limit
    finished = []
    for i in range(12):
        assert i - len(finished) + 1 <= limit  # in flight once program i is dispatched
        outputs = _Outputs(i, finished)
        assert window.add(outputs) is outputs
        assert finished == list(range(max(0, i + 2 - limit)))  # the oldest, just enough to make room
