"""Host table: gathers equal numpy's, the bounded cache stays bounded, the prefetcher keeps order and errors, the
dispatch window keeps XLA:CPU from deadlocking."""
import os
import shutil
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh

from scone_jax.serving import bundle
from scone_jax.serving.prefetch import DispatchWindow, Prefetcher
from scone_jax.serving.table import HostTable
from tests import serving_run


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "bfloat16")


@pytest.fixture(scope="module")
def stored(bf16_export):
    return ts.open(bundle.table_spec(bf16_export), open=True).result().read().result()


@pytest.mark.parametrize("shape", [(3, 50_000), (2, 300), (4, 1), (1, 1), (0,)])  # threaded, single take, few ids
def test_in_ram_gather_equals_numpy_and_zeroes_unmatched(bf16_export, stored, shape):
    table = HostTable.open(bf16_export)
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


def test_bounded_cache_serves_the_same_rows_within_its_budget(bf16_export, stored):
    chunk_bytes = 64 * 64 * 2
    table = HostTable.open(bf16_export, max_bytes=3 * chunk_bytes)
    assert not table.in_ram
    rng = np.random.default_rng(1)
    for _ in range(5):
        ids = rng.integers(-1, 2000, (8, 32))  # ~32 chunks per batch: served in rounds of 3
        np.testing.assert_array_equal(table.gather(ids)[ids >= 0], stored[ids[ids >= 0]])
        assert table._cache.nbytes <= 3 * chunk_bytes
    reads = table._cache.reads
    table.gather(np.array([5, 6, 7]))
    table.gather(np.array([8, 9]))  # same chunk again: a cache hit
    assert table._cache.reads <= reads + 1


def test_table_of_the_wrong_dtype_or_fingerprint_is_refused(bf16_export, tmp_path):
    with pytest.raises(bundle.BundleError, match="tokenizer_fingerprint"):
        HostTable.open(bf16_export, expect={"tokenizer_fingerprint": "0123456789abcdef"})
    path = str(tmp_path / "altered")
    shutil.copytree(bf16_export, path)
    ts.open(bundle.create_table_spec(path, 2000, 64, "float32", 64), create=True, delete_existing=True).result()
    with pytest.raises(bundle.BundleError, match="float32 \\[2000, 64\\] but export.json says bfloat16"):
        HostTable.open(path)
    ts.open(bundle.create_table_spec(path, 2000, 32, "bfloat16", 64), create=True, delete_existing=True).result()
    with pytest.raises(bundle.BundleError, match="\\[2000, 32\\]"):
        HostTable.open(path)
    assert os.path.exists(os.path.join(path, "COMPLETE"))


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
from scone_jax.serving.prefetch import DispatchWindow
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
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, "-c", _MANY_PROGRAMS, "3000"], env=env, capture_output=True, text=True,
                            timeout=240, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-3000:]
    limit, total = result.stdout.split()
    expected = sum(np.float32(np.tanh(np.float32(256 * (i % 8) / 8))) * 64 * 256 for i in range(3000))
    assert limit == "1" and float(total) == pytest.approx(expected, rel=1e-4)
    one_device = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert DispatchWindow(one_device).limit == 2  # no pool shared between devices: keep the next step queued
