"""Host table in RAM: gathers equal the exported rows, a table larger than the budget is refused in RAM; the
prefetcher keeps order and errors; the dispatch window keeps XLA:CPU from deadlocking. (Rows from disk:
tests/test_disk_table.py.)"""
import json
import os
import shutil
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from scone_jax.runtime.prefetch import DispatchWindow, Prefetcher
from scone_jax.serving import bundle, table as table_lib
from tests import serving_run
from tests.common import REPO, xla_flags


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "bfloat16")


def file_rows(path: str) -> np.ndarray:
    """The table's rows read straight from its files with numpy, by the layout bundle.py documents (rows from
    byte 0 of each file, then its block index): the reference the readers are held to."""
    with open(os.path.join(path, bundle.META)) as f:
        meta = json.load(f)
    width, dtype = meta["d_model"], bundle.numpy_dtype(meta["dtype"])
    parts = []
    for c, start in enumerate(range(0, meta["num_fgrams"], meta["chunk_rows"])):
        rows = min(meta["chunk_rows"], meta["num_fgrams"] - start)
        parts.append(np.fromfile(os.path.join(path, "table", f"{c:09d}"), dtype, rows * width).reshape(rows, width))
    return np.concatenate(parts) if parts else np.zeros((0, width), dtype)


@pytest.fixture(scope="module")
def stored(bf16_export):
    return file_rows(bf16_export)


@pytest.mark.parametrize("shape", [(3, 50_000), (2, 300), (4, 1), (1, 1), (0,)])  # threaded, single take, few ids
def test_in_ram_gather_equals_numpy_and_zeroes_unmatched(bf16_export, stored, shape):
    table = serving_run.ram_table(bf16_export)
    assert table.in_ram and str(table.dtype) == "bfloat16"
    ids = np.random.default_rng(0).integers(-1, 2000, shape)
    if ids.size > 1:
        ids.flat[:2] = [-1, 1999]
    out = table.gather(ids)
    assert out.shape == (*shape, 64) and out.dtype == table.dtype
    np.testing.assert_array_equal(out[ids >= 0], stored[ids[ids >= 0]])
    assert not out[ids < 0].any()
    for bad in (np.array([2000]), np.full(100, 2000)):
        with pytest.raises(ValueError, match="F-gram id 2000 is outside the table's 2000 rows"):
            table.gather(bad)


def test_a_table_over_the_budget_is_served_from_disk_or_refused_in_ram(bf16_export, stored):
    """auto: RAM when the table fits --max_table_bytes, disk when not; --table=ram over the budget is one line
    naming both sizes and the fix (caught: auto ignoring the budget, a table loaded whole past it)."""
    nbytes = stored.nbytes  # 2000 x 64 bf16
    assert table_lib.open_table(bundle.Bundle.open(bf16_export), max_bytes=nbytes).in_ram
    assert table_lib.open_table(bundle.Bundle.open(bf16_export), max_bytes=0).in_ram  # 0: no limit
    over = table_lib.open_table(bundle.Bundle.open(bf16_export), max_bytes=nbytes - 1)
    assert not over.in_ram
    np.testing.assert_array_equal(over.gather(np.arange(2000)), stored)
    over.close()
    with pytest.raises(ValueError, match=f"--table=ram: the table of {bf16_export} is {nbytes:,} bytes, more than "
                                         f"--max_table_bytes={nbytes - 1:,}. Fix: --table=disk"):
        table_lib.open_table(bundle.Bundle.open(bf16_export), table="ram", max_bytes=nbytes - 1)


def test_table_of_the_wrong_fingerprint_or_file_count_is_refused(bf16_export, tmp_path):
    """A COMPLETE that records one table file fewer than the table has is a BundleError saying so (caught: the count
    not compared, an IndexError reading the 32nd file's CRC)."""
    with pytest.raises(bundle.BundleError, match="tokenizer_fingerprint"):
        serving_run.ram_table(bf16_export, {"tokenizer_fingerprint": "0123456789abcdef"})
    path = str(tmp_path / "altered")
    shutil.copytree(bf16_export, path)
    with open(os.path.join(path, "COMPLETE")) as f:
        record = json.load(f)
    record["table"], record["table_index"] = record["table"][:-1], record["table_index"][:-1]
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        json.dump(record, f)
    with pytest.raises(bundle.BundleError, match="COMPLETE records 31 table files, the table has 32"):
        serving_run.ram_table(path)


def test_prefetcher_prepares_ahead_on_its_thread_while_the_consumer_holds_an_item():
    """While the consumer holds item 0 and asks for nothing, items 1..depth get prepared, on another
    thread, and the run-ahead is bounded (item depth+2 waits: the queue holds depth items and one more
    waits to enter it). Catches a synchronous Prefetcher (prepare called in __iter__ on demand; it
    passes the order and error test below; tried: item 1 is never prepared while item 0 is held) and
    an unbounded one (tried: a queue without maxsize; item 4 was prepared).
    The waits are on events: a correct Prefetcher sets them in milliseconds; only a broken one waits
    out the timeout. The bound's check waits 0.3 s for something that a correct one never does."""
    depth = 2
    started = [threading.Event() for _ in range(8)]
    threads = set()

    def prepare(i):
        threads.add(threading.get_ident())
        started[i].set()
        return i * 10

    items = Prefetcher(range(8), prepare, depth=depth)
    try:
        consumer = iter(items)
        assert next(consumer) == 0
        for i in range(1, depth + 1):
            assert started[i].wait(timeout=20), f"item {i} was not prepared while item 0 was held"
        assert not started[depth + 2].wait(timeout=0.3), "ran ahead past its queue"
        assert threading.get_ident() not in threads
        assert list(consumer) == [10 * i for i in range(1, 8)]
    finally:
        items.close()


def test_prefetcher_keeps_order_and_reraises():
    prepared = []

    def prepare(i):
        prepared.append(i)
        return i * 10

    items = Prefetcher(range(6), prepare, depth=2)
    first = next(iter(items))
    assert first == 0
    out = [first] + list(items)
    assert out == [0, 10, 20, 30, 40, 50] and prepared == list(range(6))

    def broken(i):
        if i == 2:
            raise RuntimeError("bad batch 2")
        return i

    with pytest.raises(RuntimeError, match="bad batch 2"):
        list(Prefetcher(range(5), broken))


_MANY_PROGRAMS = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from scone_jax.runtime.prefetch import DispatchWindow
mesh = Mesh(np.array(jax.devices()), ("data",))
w = jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P()))
xs = [jax.device_put(np.full((64, 256), i / 8, np.float32), NamedSharding(mesh, P("data"))) for i in range(8)]
f = jax.jit(lambda w, x: jnp.sum(jnp.tanh(x @ w)), out_shardings=NamedSharding(mesh, P()))  # an all-reduce
window = DispatchWindow(mesh)
outs = [window.add(f(w, xs[i % 8])) for i in range(int(sys.argv[1]))]
print(window.limit, float(sum(outs)))
"""


@pytest.mark.slow  # a fresh process with 8 virtual CPU devices
def test_dispatch_window_keeps_xla_cpu_from_deadlocking_on_collectives():
    """Thousands of independent programs with an all-reduce, dispatched through DispatchWindow on 8 virtual
    CPU devices (the serving loops' pattern), all finish. Caught: dispatching without the window (what
    serving.evaluate did): XLA:CPU's pool fills with tasks of different programs waiting for each other, logs
    "rendezvous ... may be stuck" and aborts the process after about a minute (3 of 3 runs of this program,
    and a crash of the test suite)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8)}
    result = subprocess.run([sys.executable, "-c", _MANY_PROGRAMS, "3000"], env=env, capture_output=True, text=True,
                            timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    limit, total = result.stdout.split()
    expected = sum(np.float32(np.tanh(np.float32(256 * (i % 8) / 8))) * 64 * 256 for i in range(3000))
    assert limit == "1" and float(total) == pytest.approx(expected, rel=1e-4)
    one_device = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert DispatchWindow(one_device).limit == 2  # no pool shared between devices: keep the next step queued
