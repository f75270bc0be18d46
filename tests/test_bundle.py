"""An opened bundle owns what the export records: export.json and COMPLETE are read once, by Bundle.open, and
the table, tokenizer, vocabulary and decoder are read from it; a table holds rows only; a refused load leaves
no table open. (Damaged pieces: tests/test_bundle_integrity.py.)"""
import os

import numpy as np
import pytest

from scone_jax import saved_config
from scone_jax.runtime import storage
from scone_jax.serving import bundle, bundle_files, inference, table as table_lib
from tests import serving_run
from tests.test_table import file_rows


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def half(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "bfloat16")


@pytest.fixture
def bundle_copy(original, tmp_path):
    return serving_run.copy_of(original, tmp_path)


def test_open_holds_export_json_and_completes_checksums(half):
    """Bundle.open holds export.json as written and COMPLETE's CRCs, the table's layout and the run's config.
    Catches (tried): the layout built with a fixed float32 dtype instead of export.json's bfloat16 (row_bytes
    256, not 128)."""
    opened = bundle.Bundle.open(half)
    assert opened.path == half and opened.meta == serving_run.read_json(half, bundle.META)
    record = serving_run.read_json(half, bundle.COMPLETE)
    assert (opened.checksums.table, opened.checksums.table_index) == (record["table"], record["table_index"])
    assert opened.checksums.files[bundle.TOKENIZER] == record["files"][bundle.TOKENIZER]
    assert len(opened.checksums.table) == 32  # 2000 rows in files of 64
    layout = opened.layout
    assert (layout.num_rows, layout.width, layout.chunk_rows) == (2000, 64, 64)
    assert (str(layout.dtype), layout.row_bytes) == ("bfloat16", 128)
    assert opened.config.model.d_model == 64 and opened.config.scone.num_fgrams == 2000


def test_without_complete_no_table_is_opened(bundle_copy):
    """An export without its COMPLETE marker is refused at Bundle.open, so no table can be opened from it, with
    the message that names the rerun. Catches (tried): Bundle.open checking only that export.json exists (a
    TypeError from parsing the absent marker, not the one-line refusal)."""
    os.remove(os.path.join(bundle_copy, bundle.COMPLETE))
    with pytest.raises(bundle.BundleError, match=r"holds an unfinished export \(no COMPLETE marker\)\. Fix: run "
                       r"`python -m scone_jax\.serving\.export --workdir=RUN --output="):
        bundle.Bundle.open(bundle_copy)
    with pytest.raises(bundle.BundleError, match="no COMPLETE marker"):
        inference.load(bundle_copy, table="disk")


def test_a_complete_that_counts_other_table_files_is_refused_at_open(bundle_copy):
    """COMPLETE recording fewer table files than export.json's layout has: refused when the bundle is opened, not
    later by a table. Catches (tried): the count compared with table_index only."""
    record = serving_run.read_json(bundle_copy, bundle.COMPLETE)
    meta = serving_run.read_json(bundle_copy, bundle.META)
    with open(os.path.join(bundle_copy, bundle.COMPLETE), "wb") as f:
        f.write(bundle.complete_marker(meta, record["table"][:-1], record["table_index"], record["files"]))
    with pytest.raises(bundle.BundleError, match="COMPLETE records 31 table files, the table has 32; the bundle "
                       "was altered"):
        bundle.Bundle.open(bundle_copy)


@pytest.mark.parametrize("mode", ["ram", "disk"])
def test_the_table_reads_rows_only(bundle_copy, mode):
    """Once the bundle is open, its table needs only the table files: with export.json and COMPLETE gone, both
    stores still serve the exported rows. Catches (tried): open_table opening the bundle again from its path
    (Bundle.open(source.path): 'holds no export')."""
    opened = bundle.Bundle.open(bundle_copy)
    want = file_rows(bundle_copy)
    os.remove(os.path.join(bundle_copy, bundle.META))
    os.remove(os.path.join(bundle_copy, bundle.COMPLETE))
    table = table_lib.open_table(opened, table=mode)
    try:
        assert table.in_ram == (mode == "ram") and not hasattr(table, "meta")
        ids = np.array([[0, 63, 64, -1], [1999, 5, 700, 1234]])
        np.testing.assert_array_equal(table.gather(ids)[ids >= 0], want[ids[ids >= 0]])
    finally:
        table.close()


def test_load_reads_export_json_and_complete_once(original, monkeypatch):
    """inference.load reads export.json and COMPLETE exactly once each, and what it serves carries that bundle.
    Catches (tried): load's model half re-reading export.json (bundle.read_export_meta(path): 2 reads)."""
    reads = []
    read_bytes = bundle_files.read_bytes

    def counted(path, key, *args, **kwargs):
        reads.append(key)
        return read_bytes(path, key, *args, **kwargs)

    monkeypatch.setattr(bundle_files, "read_bytes", counted)
    monkeypatch.setattr(storage, "read_bytes", counted)
    served = inference.load(original)
    try:
        assert (reads.count(bundle.META), reads.count(bundle.COMPLETE)) == (1, 1)
        assert served.bundle.path == original and served.bundle.meta == serving_run.read_json(original, bundle.META)
        assert served.bundle.meta["model_fingerprint"] == bundle.params_fingerprint(served.params)
        assert served.config.to_dict() == served.bundle.config.to_dict()
    finally:
        served.table.close()


def test_a_refused_load_closes_the_table_it_opened(bundle_copy, monkeypatch):
    """A bundle refused after its table is open (here: a damaged tokenizer.model) closes that table: a disk table
    holds a descriptor per table file. Catches (tried): load without its close on the way out (32 descriptors
    left open)."""
    with open(os.path.join(bundle_copy, bundle.TOKENIZER), "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    opened = []
    open_table = table_lib.open_table

    def recorded(*args, **kwargs):
        opened.append(open_table(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(table_lib, "open_table", recorded)
    with pytest.raises(bundle.BundleError, match=r"tokenizer\.model is damaged: it hashes to"):
        inference.load(bundle_copy, table="disk")
    [table] = opened
    assert not table.in_ram and len(table.files.fds) == 32
    assert (table.files.fds == -1).all() and (table.files.direct_fds == -1).all()


def test_stored_config_takes_todays_defaults_and_refuses_unknown_keys():
    """A saved config over today's defaults: saved values win at any depth, keys it lacks take their defaults, and
    a key this code does not know is refused by name. Catches (tried): nested values assigned whole (a saved
    {'model': {'d_model': 96}} dropping every other model key's default)."""
    config = saved_config.stored_config({"model": {"d_model": 96}, "train": {"num_steps": 7}})
    assert (config.model.d_model, config.train.num_steps) == (96, 7)
    assert config.model.num_layers == 4 and config.model.d_ff == 1024  # today's defaults
    with pytest.raises(ValueError, match=r"The saved config has model\.d_modle, which this code does not know; use "
                       "the scone_jax version that wrote it"):
        saved_config.stored_config({"model": {"d_modle": 96}})
