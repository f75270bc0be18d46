"""Every way a disk-served table reads rows checks them (serving/disk_table.py, table_files.py): O_DIRECT reads (a few
blocks read one by one, many through kernel AIO), the buffered reads where O_DIRECT is refused, ranged reads from
gs://, and the head read into RAM at open each refuse a block whose CRC does not match its block index; and the
head holds what the budget leaves after the block index, in whole blocks."""
import errno
import os
import shutil

import numpy as np
import pytest

from scone_jax.runtime import storage
from scone_jax.serving import bundle, export, table as table_lib, table_files
from tests import serving_run
from tests.test_table import file_rows

ROWS, ROW_BYTES, BLOCK_ROWS = 2000, 128, 32  # the bf16 export: d = 64, blocks of 32 rows, files of 64
INDEX_BYTES = -(-ROWS // BLOCK_ROWS) * 4  # 63 blocks
DAMAGED = r"table/000000010 \(table rows 640\.\.703\) is damaged: table rows 672\.\.703 hash to [0-9a-f]{8}, its " \
          r"block index records [0-9a-f]{8}"
MANY = np.arange(0, ROWS, 25)  # 80 rows in 63 blocks, row 700 among them: more blocks than read one by one


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "bfloat16")


@pytest.fixture
def damaged(bf16_export, tmp_path):
    """A copy of the export with one byte of row 700 flipped (file 10 holds rows 640..703)."""
    path = str(tmp_path / "bundle")
    shutil.copytree(bf16_export, path)
    with open(os.path.join(path, "table", "000000010"), "r+b") as f:
        f.seek((700 - 640) * ROW_BYTES + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return path


def refuses_row_700(table, stored):
    """The damaged block is refused alone and among many; rows of the other blocks are still served right."""
    for ids in (np.array([[700]]), MANY, np.array([3, 700, 1500])):
        with pytest.raises(bundle.BundleError, match=DAMAGED):
            table.gather(ids)
    others = np.array([3, 671, 704, 1500, 1999])
    np.testing.assert_array_equal(table.gather(others), stored[others])


def test_o_direct_reads_refuse_a_damaged_block_one_by_one_and_through_kernel_aio(damaged, bf16_export):
    """Caught: the CRC check of LocalFiles.read_blocks' O_DIRECT reads skipped (row 700 served flipped, one block
    read alone and 63 through kernel AIO alike)."""
    table = table_lib.open_table(bundle.Bundle.open(damaged), table="disk")
    assert table.direct and table.head_rows == 0
    refuses_row_700(table, file_rows(bf16_export))
    table.close()


def test_buffered_reads_refuse_a_damaged_block_where_o_direct_is_refused(damaged, bf16_export, monkeypatch):
    """A filesystem that refuses O_DIRECT: rows are read with buffered preads from threads, and checked the same.
    Caught: the CRC check of the threads' reads skipped (row 700 served flipped)."""
    real_open = os.open

    def no_direct(name, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", name)
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(table_files.os, "open", no_direct)
    table = table_lib.open_table(bundle.Bundle.open(damaged), table="disk")
    assert not table.direct
    refuses_row_700(table, file_rows(bf16_export))
    table.close()


def test_the_head_read_at_open_refuses_a_damaged_block(damaged):
    """A budget whose head covers row 700 (the index and 704 rows): the damaged block is refused at open, in one line,
    with no table left open; a head that stops short of it opens. Caught: the head's blocks not checked against
    the index (row 700 served from RAM flipped)."""
    for rows in (704, 2000):
        with pytest.raises(bundle.BundleError, match=DAMAGED):
            table_lib.open_table(bundle.Bundle.open(damaged), table="disk", max_bytes=INDEX_BYTES + rows * ROW_BYTES)
    short = table_lib.open_table(bundle.Bundle.open(damaged), table="disk", max_bytes=INDEX_BYTES + 672 * ROW_BYTES)
    assert short.head_rows == 672
    short.close()


@pytest.mark.parametrize("budget_rows,head", [
    (0, 0),  # the index alone
    (31, 0),  # less than a block
    (63, 32),  # a block and most of another
    (64 * 5 + 17, 320),
    (10_000, ROWS),  # more than the table: all of it
])
def test_the_head_holds_what_the_budget_leaves_after_the_index_in_whole_blocks(bf16_export, budget_rows, head):
    """--max_table_bytes = the block index + budget_rows rows (plus 3 bytes, less than a row): the head is that many
    rows rounded down to whole blocks, capped at the table, worked out here from the layout alone. Its rows cost no
    read; the next row does. Caught: the index left out of the sum (a budget of the index + 31 rows gave a head of
    32); the head not rounded to whole blocks."""
    table = table_lib.open_table(bundle.Bundle.open(bf16_export), table="disk",
                                 max_bytes=INDEX_BYTES + budget_rows * ROW_BYTES + 3)
    want = min(ROWS, (budget_rows // BLOCK_ROWS) * BLOCK_ROWS)
    assert want == head and table.head_rows == head
    if head:
        table.gather(np.arange(head))
        assert table.blocks_read == 0
    if head < ROWS:
        table.gather(np.array([head]))
        assert table.blocks_read == 1
    table.close()


@pytest.mark.slow
def test_ranged_reads_from_gcs_and_the_remote_head_refuse_a_damaged_block(tmp_path_factory, bf16_export, bucket):
    """The same damage in a gs:// bundle (the emulator): ranged block reads and the head read at open refuse it.
    Caught: RemoteFiles.read_blocks without its CRC check (row 700 served flipped)."""
    run = serving_run.trained_run(tmp_path_factory)
    output = f"{bucket}/exports/damaged_bf16"
    export.export(run["workdir"], output, dtype="bfloat16", chunk_rows=64, batch_rows=512)
    store = storage.open_store(output)
    data = bytearray(store.read(bundle.chunk_key(10)).result().value)
    data[(700 - 640) * ROW_BYTES + 17] ^= 0x10
    store.write(bundle.chunk_key(10), bytes(data)).result()
    table = table_lib.open_table(bundle.Bundle.open(output), table="disk")
    refuses_row_700(table, file_rows(bf16_export))
    table.close()
    with pytest.raises(bundle.BundleError, match=DAMAGED):
        table_lib.open_table(bundle.Bundle.open(output), table="disk", max_bytes=INDEX_BYTES + 704 * ROW_BYTES)


@pytest.mark.parametrize("mode", ["auto", "disk", "ram"])
def test_a_negative_budget_is_refused_in_one_line(bf16_export, mode):
    """--max_table_bytes=-1 names itself and what it takes, whatever --table says. Caught: no check of its own (auto
    and disk then blame the block index, 'less than the 252 bytes the block index ... must keep in RAM'; ram says
    the table is 'more than --max_table_bytes=-1')."""
    with pytest.raises(ValueError, match=r"^--max_table_bytes=-1 is negative\. Fix: the host RAM the table may take, in "
                                         r"bytes, or 0 for no limit\.$"):
        table_lib.open_table(bundle.Bundle.open(bf16_export), table=mode, max_bytes=-1)


def test_a_table_the_host_cannot_allocate_is_one_line_naming_the_disk(bf16_export, monkeypatch):
    """A table larger than the host can allocate, loaded into RAM (no budget given): one line naming --table=disk,
    not a MemoryError traceback. (numpy's allocation is made to fail for the table's array only.) Caught: the
    allocation unguarded (MemoryError escaped)."""
    real_empty = np.empty

    def short_of_memory(shape, *args, **kwargs):
        if shape == (ROWS, 64):
            raise MemoryError("Unable to allocate")
        return real_empty(shape, *args, **kwargs)

    monkeypatch.setattr(np, "empty", short_of_memory)
    with pytest.raises(ValueError, match=f"^The table of {bf16_export} is 256,000 bytes, more than this host can "
                                         r"allocate\. Fix: --table=disk \(or auto with --max_table_bytes\) to serve it "
                                         r"from disk\.$"):
        table_lib.open_table(bundle.Bundle.open(bf16_export), table="ram")
