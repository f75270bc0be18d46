"""Rows served from disk (serving/disk_table.py): bit for bit the rows in RAM; a damaged block is an error naming its
rows, never wrong rows; bad input is one line or a note; readers write nothing into the bundle."""
import errno
import json
import mmap
import os
import shutil

import numpy as np
import pytest

from scone_jax.runtime import aio
from scone_jax.serving import bundle, table as table_lib, table_files
from tests import serving_run
from tests.test_table import file_rows
from scone_jax.serving.bench_bundles import write_table_bundle


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "bfloat16")


@pytest.fixture(scope="module")
def stored(bf16_export):
    return file_rows(bf16_export)


def bits(rows: np.ndarray) -> np.ndarray:
    """The rows' bytes: equality of these is bit for bit (no -0 == 0, NaN != NaN)."""
    return np.ascontiguousarray(rows).view(np.uint8)


def index_bytes(path: str) -> int:
    with open(os.path.join(path, bundle.META)) as f:
        meta = json.load(f)
    return -(-meta["num_fgrams"] // meta["block_rows"]) * 4


def snapshot(path: str) -> dict:
    """Every file under the bundle with its size, mtime and bytes' hash: what a reader must leave alone."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = (os.path.getsize(full), os.stat(full).st_mtime_ns, hash(f.read()))
    return out


HEADS = {"no head": 0, "head of 96 rows": 96 * 128}  # bf16 d = 64: 128 bytes a row; 32-row blocks


@pytest.mark.parametrize("head", HEADS.values(), ids=HEADS.keys())
def test_rows_from_disk_equal_the_rows_in_ram_bit_for_bit(bf16_export, stored, head):
    """Random ids (repeated, -1 for no match, the first and last row, the short last block: 2000 rows are 62
    blocks of 32 and one of 16) in batches of one id (decoding: plain reads), a few and thousands (kernel AIO,
    more blocks than reads in flight), through O_DIRECT; the head in RAM answers its rows without a read.
    Caught: a row's place in its block dropped (`rows % block_rows` -> 0: the block's first row everywhere);
    blocks matched to the wrong rows (np.unique's inverse unused); the head off by one (`flat >= head_rows` as
    `>`: row head_rows looked up in the head, an IndexError); the head's rows never copied out (garbage rows)."""
    ram = serving_run.ram_table(bf16_export)
    disk = table_lib.open_table(bundle.Bundle.open(bf16_export), table="disk", max_bytes=index_bytes(bf16_export) + head)
    assert not disk.in_ram and disk.direct and disk.head_rows == head // 128
    rng = np.random.default_rng(0)
    batches = [np.array([[0]]), np.array([[1999]]), np.array([-1, 5, 5, 1998]), rng.integers(-1, 2000, (3, 5000)),
               np.concatenate([np.arange(2000), np.arange(2000)[::-1], [-1, -1]]).reshape(2, -1)]
    for ids in batches:
        got = disk.gather(ids)
        assert got.shape == (*ids.shape, 64) and got.dtype == ram.dtype
        np.testing.assert_array_equal(bits(got), bits(ram.gather(ids)))
        np.testing.assert_array_equal(bits(got[ids >= 0]), bits(stored[ids[ids >= 0]]))
        assert not got[ids < 0].any()
    assert (disk.rows_from_head > 0) == (head > 0)
    reads = disk.blocks_read
    disk.gather(np.arange(disk.head_rows))
    assert disk.blocks_read == reads  # the head costs no read
    with pytest.raises(ValueError, match="F-gram id 2000 is outside the table's 2000 rows"):
        disk.gather(np.array([3, 2000]))
    disk.close()


def test_rows_that_do_not_tile_a_page_are_read_whole(tmp_path):
    """d = 48 fp32: 192-byte rows, 16-row blocks of 3,072 bytes at offsets that are not page multiples (an
    O_DIRECT read takes the pages around a block), 96-row files, 5,000 rows (the last block and file short),
    313 blocks: more than the 64 reads in flight. Caught: a block taken from the start of its pages instead of
    its offset within them (`slots[pick, 0:block_bytes]`)."""
    rows = np.random.default_rng(1).standard_normal((5000, 48)).astype(np.float32)
    path = str(tmp_path / "odd")
    meta = write_table_bundle(path, lambda lo, hi: rows[lo:hi], 5000, 48, "float32", 96)
    assert (meta["block_rows"], meta["chunk_rows"]) == (16, 96)
    disk = table_lib.open_table(bundle.Bundle.open(path), table="disk")
    assert disk.direct
    ids = np.random.default_rng(2).permutation(5000)
    np.testing.assert_array_equal(bits(disk.gather(ids)), bits(rows[ids]))
    np.testing.assert_array_equal(bits(disk.gather(np.array([4999]))), bits(rows[[4999]]))
    assert disk.blocks_read == 313 + 1
    disk.close()


def test_a_flipped_byte_names_its_rows_and_no_wrong_row_is_served(bf16_export, stored, tmp_path):
    """One byte flipped in row 700 (file 10 holds rows 640..703; its block of rows 672..703): from disk, a
    batch with that row is a BundleError naming rows 672..703 and the repair, while rows of other blocks are
    still served right; loaded into RAM, the same rows are named. A flipped byte in a file's block index is
    named at open. Caught: the blocks' CRC check skipped (the flipped row was served, no error); the RAM load
    naming the file but not the rows (its block index unused)."""
    path = str(tmp_path / "bundle")
    shutil.copytree(bf16_export, path)
    name = os.path.join(path, "table", "000000010")
    with open(name, "r+b") as f:
        f.seek((700 - 640) * 128 + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    disk = table_lib.open_table(bundle.Bundle.open(path), table="disk")
    where = rf"{name} \(table rows 640\.\.703\) is damaged: table rows 672\.\.703 hash to [0-9a-f]{{8}}, its block " \
            r"index records [0-9a-f]{8}\. Fix: delete the done marker of each bad file \(" + f"{path}/done/000000010"
    with pytest.raises(bundle.BundleError, match=where):
        disk.gather(np.array([[3, 700, 1500]]))
    with pytest.raises(bundle.BundleError, match=where):
        disk.gather(np.array([[700]]))
    others = np.array([3, 671, 704, 1500])
    np.testing.assert_array_equal(bits(disk.gather(others)), bits(stored[others]))
    disk.close()
    with pytest.raises(bundle.BundleError, match=rf"{name} \(table rows 640\.\.703\) is damaged: table rows 672\.\.703 "
                                                 r"hash to [0-9a-f]{8}, its block index records"):
        serving_run.ram_table(path)

    with open(name, "r+b") as f:  # restore the row; damage the block index (after the 64 rows of 128 bytes)
        f.seek((700 - 640) * 128 + 17)
        f.write(byte)
        f.seek(64 * 128 + 1)
        index_byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([index_byte[0] ^ 0x01]))
    with pytest.raises(bundle.BundleError, match=rf"{name} \(table rows 640\.\.703\) has a damaged block index: it "
                                                 r"hashes to [0-9a-f]{8}, COMPLETE records"):
        table_lib.open_table(bundle.Bundle.open(path), table="disk")
    assert serving_run.ram_table(path).gather(np.array([700])).shape == (1, 64)  # rows intact


def test_missing_or_short_file_is_one_line_and_a_reader_writes_nothing(bf16_export, tmp_path):
    """A missing file and a truncated one are named with their rows at open, from disk and into RAM, in one line with
    the repair; nothing in the bundle changes (caught: the files opened without looking for missing ones: a bare
    FileNotFoundError, no rows, no fix)."""
    path = str(tmp_path / "bundle")
    shutil.copytree(bf16_export, path)
    os.remove(os.path.join(path, "table", "000000005"))
    with open(os.path.join(path, "table", "000000007"), "r+b") as f:
        f.truncate(1000)
    before = snapshot(path)
    for mode in ("disk", "ram"):
        with pytest.raises(bundle.BundleError) as error:
            table_lib.open_table(bundle.Bundle.open(path), table=mode)
        assert str(error.value).startswith(
            f"{path}/table/000000005 (table rows 320..383) is missing; 1 more table files are bad. Fix: delete the done "
            f"marker of each bad file ({path}/done/000000005, {path}/done/000000007), then re-run `python -m "
            f"scone_jax.serving.export --workdir=RUN --output={path}`")
        assert "\n" not in str(error.value)
    assert snapshot(path) == before
    shutil.copy(os.path.join(bf16_export, "table", "000000005"), os.path.join(path, "table", "000000005"))
    before = snapshot(path)
    with pytest.raises(bundle.BundleError, match=r"table/000000007 \(table rows 448\.\.511\) is 1000 bytes, not the "
                                                 r"8200 its rows and block index take \(truncated or replaced\)"):
        table_lib.open_table(bundle.Bundle.open(path), table="disk")
    assert snapshot(path) == before


def test_bad_input_is_one_line_or_a_note(bf16_export, tmp_path, monkeypatch, caplog):
    """A budget below the block index that must stay in RAM (exit 2, the size it needs); an old-format bundle (the
    re-export command); --table=disk on a decoder-only bundle (a note, then served); a filesystem without
    O_DIRECT (a note, then buffered reads from threads, rows still exact); nothing written into the bundle.
    Caught: the budget check missing (the table opened with a budget it exceeds); the O_DIRECT probe skipped
    (EINVAL escaped from open as an OSError)."""
    need = index_bytes(bf16_export)
    before = snapshot(bf16_export)
    with pytest.raises(ValueError, match=f"--max_table_bytes={need - 1:,} is less than the {need:,} bytes the block "
                                         f"index of {bf16_export}'s table \\(63 blocks\\) must keep in RAM to serve "
                                         f"rows from disk. Fix: raise --max_table_bytes to at least {need:,}"):
        table_lib.open_table(bundle.Bundle.open(bf16_export), table="disk", max_bytes=need - 1)

    old = str(tmp_path / "old")
    shutil.copytree(bf16_export, old)
    with open(os.path.join(old, "export.json")) as f:
        meta = json.load(f)
    with open(os.path.join(old, "export.json"), "w") as f:
        json.dump(meta | {"version": 1}, f)
    with pytest.raises(bundle.BundleError, match=r"is format 'scone_export' v1, its table in zarr chunks that cannot "
                                                 r"be read a row at a time; this code reads 'scone_export' v2\. Fix: "
                                                 r"export the run again with this version: `python -m "
                                                 r"scone_jax\.serving\.export --workdir=RUN --output=NEW_PATH`"):
        table_lib.open_table(bundle.Bundle.open(old), table="disk")

    empty = str(tmp_path / "decoder_only")
    write_table_bundle(empty, lambda lo, hi: np.zeros((hi - lo, 64), np.float32), 0, 64, "float32", 64)
    caplog.set_level("WARNING")
    served = table_lib.open_table(bundle.Bundle.open(empty), table="disk")
    assert "Note: --table=disk, but the export at" in caplog.text and "no f-gram table" in caplog.text
    assert served.gather(np.full((2, 3), -1)).shape == (2, 3, 64)

    real_open = os.open

    def no_direct(name, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(table_files.os, "open", no_direct)
    caplog.clear()
    disk = table_lib.open_table(bundle.Bundle.open(bf16_export), table="disk")
    assert not disk.direct
    assert "cannot be read with O_DIRECT and kernel AIO (Invalid argument); table rows are read through the page " \
           "cache instead" in caplog.text
    ids = np.random.default_rng(3).integers(-1, 2000, (4, 700))
    np.testing.assert_array_equal(bits(disk.gather(ids)), bits(table_lib.open_table(bundle.Bundle.open(bf16_export)).gather(ids)))
    disk.close()
    assert snapshot(bf16_export) == before


def test_kernel_aio_reads_land_where_asked_and_an_error_leaves_nothing_in_flight(tmp_path):
    """300 spans through 8 reads in flight land at their own addresses (caught: iocb data not set, every result
    counted for span 0: the others' checks never ran); an exception in the caller's callback drains the
    reads still in flight before it propagates, so the next batch's results are its own."""
    if not aio.available():
        pytest.skip("no kernel AIO here")
    data = np.random.default_rng(4).integers(0, 256, 300 * 4096, np.uint8)
    path = tmp_path / "data"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = np.frombuffer(mmap.mmap(-1, 300 * 4096), np.uint8)
    order = np.random.default_rng(5).permutation(300)
    reader = aio.AsyncReads(8)
    seen = []

    def done(indices, results):
        assert (results == 4096).all()
        seen.extend(indices.tolist())

    try:
        reader.read(np.full(300, fd), order * 4096, np.full(300, 4096), buffer.ctypes.data + np.arange(300) * 4096, done)
        assert sorted(seen) == list(range(300))
        np.testing.assert_array_equal(buffer.reshape(300, 4096), data.reshape(300, 4096)[order])

        def fail(indices, results):
            raise RuntimeError("stop")

        with pytest.raises(RuntimeError, match="stop"):
            reader.read(np.full(300, fd), order * 4096, np.full(300, 4096), buffer.ctypes.data + np.arange(300) * 4096,
                        fail)
        seen.clear()
        buffer[:] = 0
        reader.read(np.full(10, fd), np.arange(10) * 4096, np.full(10, 4096), buffer.ctypes.data + np.arange(10) * 4096,
                    done)
        assert sorted(seen) == list(range(10))
        np.testing.assert_array_equal(buffer[:10 * 4096], data[:10 * 4096])
    finally:
        reader.close()
        os.close(fd)


def test_the_open_file_limit_makes_room_for_what_the_table_needs_and_no_more(tmp_path, monkeypatch):
    """A 1B-row table at d = 2048 is 15,259 files. Here 600 files, with 40 descriptors already open: 641 needed (one
    more while start_direct swaps a file's descriptor). A hard limit below that is one line with the fix; a soft
    limit below it is raised (with 256 to spare, up to the hard limit); one above it is left alone; and a table of
    no files (a decoder-only bundle) asks for nothing under `ulimit -n 64`. Caught: files + 256 asked for, whatever
    was open (what the issue saw: a decoder-only bundle refused under `ulimit -n 64`); the descriptors already
    open left out (601 asked for, not 641: the table allowed where it does not fit)."""
    path = str(tmp_path / "many")
    write_table_bundle(path, lambda lo, hi: np.ones((hi - lo, 4), np.float32), 600 * 16, 4, "float32", 16)
    empty = str(tmp_path / "decoder_only")
    write_table_bundle(empty, lambda lo, hi: np.zeros((hi - lo, 4), np.float32), 0, 4, "float32", 16)
    real = table_files.resource.getrlimit
    limits = {"soft": 300, "hard": 640}
    monkeypatch.setattr(table_files.resource, "getrlimit", lambda which: (
        (limits["soft"], limits["hard"]) if which == table_files.resource.RLIMIT_NOFILE else real(which)))
    raised = []
    monkeypatch.setattr(table_files.resource, "setrlimit", lambda which, value: raised.append(value))
    monkeypatch.setattr(table_files, "_open_descriptors", lambda: 40)
    with pytest.raises(OSError, match=f"the table at {path} needs 600 open files, and with the 40 this process has "
                                      r"open that is more than it may open \(hard limit 640\)\. Fix: raise the limit "
                                      r"\(`ulimit -Hn`, limits\.conf\), or export with a larger --chunk_rows \(fewer, "
                                      r"larger files\)\.$"):
        table_lib.open_table(bundle.Bundle.open(path), table="disk")
    assert raised == []
    limits["hard"] = 700
    disk = table_lib.open_table(bundle.Bundle.open(path), table="disk")
    assert disk.direct and (disk.files.fds < 0).all()  # one descriptor a file once reading with O_DIRECT
    disk.close()
    assert raised == [(700, 700)]  # 641 needed, 256 to spare: capped at the hard limit
    limits.update(soft=641, hard=4096)
    table_lib.open_table(bundle.Bundle.open(path), table="disk").close()
    assert raised == [(700, 700)]  # enough already
    limits.update(soft=64, hard=64)
    for mode in ("disk", "ram"):
        assert table_lib.open_table(bundle.Bundle.open(empty), table=mode).gather(np.array([-1])).shape == (1, 4)
    assert raised == [(700, 700)]
