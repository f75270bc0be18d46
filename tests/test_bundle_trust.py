"""A bundle is read as what it claims to be (serving/bundle_files.py, bundle.py, saved_decoder.py): its files only
inside it and only if they are regular files, every size and field of export.json and COMPLETE checked against the
files before anything is allocated, and the decoder's config against its saved shapes before the model is built.
Each test crafts its own copy of the shared export as someone handing it over could, forging the seal (COMPLETE's
fingerprint of export.json) where that takes a changed export.json past the first check."""
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

from scone_jax.runtime.crc import crc32_hex
from scone_jax.serving import bundle, bundle_files, inference, saved_decoder, table as table_lib
from tests import serving_run
from tests.test_table import file_rows

# A refused orbax restore leaves its other reads' coroutines to be collected later, in whichever test runs then.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

DECODER_FILE = "decoder/stack.blocks.attn.key.kernel.value/0.3.0"
PIECES = ["table/000000003", "tokenizer.model", "export.json", "COMPLETE", DECODER_FILE, "fgrams/vocab.json"]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "float32")


@pytest.fixture
def bundle_copy(original, tmp_path):
    return serving_run.copy_of(original, tmp_path)


def forge(path: str, meta_changes: dict | None = None, record_changes: dict | None = None) -> None:
    """export.json with `meta_changes` and COMPLETE with `record_changes` (None: key removed), the seal forged:
    COMPLETE's export_fingerprint is that of the new export.json."""
    meta = serving_run.read_json(path, bundle.META) | (meta_changes or {})
    record = serving_run.read_json(path, bundle.COMPLETE) | {"export_fingerprint": bundle.meta_fingerprint(meta)}
    for key, value in (record_changes or {}).items():
        if value is None:
            record.pop(key, None)
        else:
            record[key] = value
    with open(os.path.join(path, bundle.META), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(path, bundle.COMPLETE), "w") as f:
        json.dump(record, f)


def finishes(fn, seconds: float = 120):
    """fn()'s exception (None if it returned), failing the test if it is still running after `seconds` (a read
    blocked on a FIFO, a model built from a crafted config): the thread is a daemon, left behind."""
    outcome = []

    def target():
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s"
    return outcome[0]


def named(path: str, piece: str) -> str:
    """How a refusal names `piece` of the bundle at `path` (a table file with its rows)."""
    return f"{path}/{piece}" + (" (table rows 192..255)" if piece == "table/000000003" else "")


def load_all(path: str, table: str = "ram"):
    served = inference.load(path, table=table)
    served.table.close()


@pytest.mark.parametrize("piece", PIECES)
def test_a_link_out_of_the_bundle_is_refused_even_to_an_identical_file(bundle_copy, tmp_path, piece):
    """Each piece replaced by a symbolic link to an exact copy of itself outside the bundle: the CRCs all match, so
    only the link gives it away, and it is refused in one line naming the piece, before it is read (for the table:
    from disk and into RAM). Caught: the table files opened with a plain os.open (the link followed: a link to any
    readable file had its CRC-32 printed in the damage message); tokenizer.model, export.json and COMPLETE read
    through tensorstore (which follows links: served, exit 0); the decoder's and the vocabulary's directories not
    walked before orbax and zarr read them (served)."""
    target = tmp_path / "elsewhere"
    shutil.copy(os.path.join(bundle_copy, piece), target)
    os.remove(os.path.join(bundle_copy, piece))
    os.symlink(target, os.path.join(bundle_copy, piece))
    words = _escape(f"{named(bundle_copy, piece)} is a symbolic link that leads out of the bundle")
    for table in ("ram", "disk"):
        with pytest.raises(ValueError, match=words) as error:
            load_all(bundle_copy, table)
        assert "\n" not in str(error.value) and crc32_hex(target.read_bytes()) not in str(error.value)


@pytest.mark.parametrize("piece", PIECES)
def test_a_fifo_in_a_files_place_is_refused_instead_of_blocking(bundle_copy, piece):
    """A FIFO where a file should be: reading it would wait forever for a writer (evaluate blocked until killed).
    Refused in one line naming it, at once. Caught: the table files opened without O_NONBLOCK and the file type
    unchecked (open_table still blocked after 120 s); export.json and the others read through tensorstore (blocked)."""
    os.remove(os.path.join(bundle_copy, piece))
    os.mkfifo(os.path.join(bundle_copy, piece))
    error = finishes(lambda: load_all(bundle_copy, "disk"))
    assert isinstance(error, ValueError), error
    assert f"{named(bundle_copy, piece)} is a FIFO, not a regular file" in str(error), error


def test_a_link_inside_the_bundle_is_followed(original, bundle_copy):
    """A table file that links to a copy elsewhere inside the bundle (a copy made with links) is served, from disk
    and into RAM: only links out are refused."""
    os.makedirs(os.path.join(bundle_copy, "spare"))
    os.replace(os.path.join(bundle_copy, "table", "000000003"), os.path.join(bundle_copy, "spare", "000000003"))
    os.symlink(os.path.join("..", "spare", "000000003"), os.path.join(bundle_copy, "table", "000000003"))
    ids = np.arange(150, 260)  # file 3 holds rows 192..255
    for mode in ("ram", "disk"):
        table = table_lib.open_table(bundle.Bundle.open(bundle_copy), table=mode)
        np.testing.assert_array_equal(table.gather(ids), file_rows(original)[ids])
        table.close()


def test_a_crafted_num_fgrams_is_refused_before_anything_is_allocated(bundle_copy):
    """export.json (seal forged) claiming 2**45 rows in files of 2**40 rows: still 32 files, so COMPLETE's lists fit,
    but the files are far shorter than such rows take. Refused at open, naming the first file, before the RAM
    table's 8 PiB array is allocated. Caught: the load allocating its array before opening the files (MemoryError:
    'Unable to allocate 8.00 PiB', a traceback)."""
    forge(bundle_copy, {"num_fgrams": 2 ** 45, "chunk_rows": 2 ** 40})
    with pytest.raises(bundle.BundleError, match=r"table/000000000 \(table rows 0\.\.1099511627775\) is 16400 bytes, "
                                                 r"not the 281749854617600 its rows"):
        table_lib.open_table(bundle.Bundle.open(bundle_copy), table="ram")


@pytest.mark.parametrize("changes,words", [
    ({"num_fgrams": "2000"}, "has num_fgrams='2000', which no export writes (an integer >= 0)"),
    ({"d_model": -64}, "has d_model=-64, which no export writes (an integer >= 1)"),
    ({"chunk_rows": 0}, "has chunk_rows=0, which no export writes (an integer >= 1)"),
    ({"dtype": "int8"}, "has dtype='int8', which no export writes (one of ('bfloat16', 'float32'))"),
    ({"block_rows": 8}, "has block_rows=8, but rows of 256 bytes in files of 64 are exported in blocks of 16"),
    ({"model_fingerprint": 7}, "has model_fingerprint=7, which no export writes (a fingerprint)"),
    ({"config": []}, "has config=[], which no export writes (a dict)"),
])
def test_export_json_fields_no_export_writes_are_refused_at_open(bundle_copy, changes, words):
    """Each field behind the seal is what an export writes, or one line at open naming it. Caught: the fields
    taken as they came (the bundle opened with a string num_fgrams, a TypeError only once its layout was used)."""
    forge(bundle_copy, changes)
    with pytest.raises(bundle.BundleError, match="export.json " + _escape(words)) as error:
        bundle.Bundle.open(bundle_copy)
    assert str(error.value).endswith("it was altered or damaged after the export. Fix: export again into a fresh "
                                     "--output.")


@pytest.mark.parametrize("changes,words", [
    ({"files": None}, "has no list of the CRCs of tokenizer.model and the decoder's files"),
    ({"files": {"tokenizer.model": 5}}, "has no list of the CRCs of tokenizer.model and the decoder's files"),
    ({"table_index": None}, "has no list of table CRCs under 'table_index'"),
    ({"table": ["zz"] * 32}, "has no list of table CRCs under 'table'"),
])
def test_a_complete_without_its_lists_is_refused_at_open(bundle_copy, changes, words):
    """COMPLETE's lists are whole: a missing file list was a KeyError traceback (`record['files']`), a damaged CRC
    list compared file by file only later. Caught: the 'files' list unchecked (the bundle opened)."""
    forge(bundle_copy, record_changes=changes)
    with pytest.raises(bundle.BundleError, match=f"{bundle_copy}/COMPLETE " + _escape(words)):
        bundle.Bundle.open(bundle_copy)


def test_export_json_whose_fingerprint_differs_from_completes_is_refused(bundle_copy):
    """One field of export.json changed (the step), the seal left as it was: refused at open, whichever field
    (every field is in the fingerprint). Caught: the fingerprint comparison dropped (the bundle opened as step 99)."""
    meta = serving_run.read_json(bundle_copy, bundle.META)
    with open(os.path.join(bundle_copy, bundle.META), "w") as f:
        json.dump(meta | {"step": 99}, f)
    with pytest.raises(bundle.BundleError, match=r"export\.json and COMPLETE do not match; one was changed or "
                                                 "damaged after the export finished"):
        bundle.Bundle.open(bundle_copy)


def test_a_crafted_layer_count_is_refused_before_the_model_is_built(bundle_copy):
    """export.json's config (seal forged) asking for 100,000 unscanned blocks, against files holding 2 layers:
    refused in seconds by the layer count. Caught: the layers not compared before the abstract model is built
    (the 100,000 blocks took minutes to trace; the test's 120 s ran out)."""
    config = serving_run.read_json(bundle_copy, bundle.META)["config"]
    config["model"] |= {"num_layers": 100_000, "scan_layers": False}
    forge(bundle_copy, {"config": config})
    start = time.monotonic()
    error = finishes(lambda: load_all(bundle_copy))
    assert isinstance(error, bundle.BundleError), error
    assert "export.json's model config has num_layers=100000, but the decoder's files hold 2 layers" in str(error)
    assert time.monotonic() - start < 60


@pytest.mark.slow  # trains and exports a run of its own
def test_the_layers_of_an_unscanned_stack_are_counted_from_its_numbered_blocks(tmp_path_factory, tmp_path):
    """An export of a model with model.scan_layers=False keeps one array per block (stack.blocks.0.*, .1.*): its
    layers are counted from those numbers, and a config asking for another count is refused before the model is
    built, as for a scanned stack. Caught: an off-by-one in the arrays' names (found by tools/mutate_diff.py: no
    test read an unscanned stack; every name then missed, and the count was taken as absent)."""
    original = serving_run.exported_variant(tmp_path_factory, "unscanned", scan_layers=False)
    path = str(tmp_path / "bundle")
    shutil.copytree(original, path)
    sums = bundle.Bundle.open(path).checksums
    shapes = saved_decoder.saved_shapes(path, sums)
    assert any(name.startswith("stack.blocks.1.") for name in shapes) and saved_decoder.saved_layers(shapes) == 2
    load_all(path)  # the config builds what is saved
    config = serving_run.read_json(path, bundle.META)["config"]
    config["model"]["num_layers"] = 3
    forge(path, {"config": config})
    with pytest.raises(bundle.BundleError, match="export.json's model config has num_layers=3, but the decoder's "
                                                 "files hold 2 layers"):
        load_all(path)


def test_a_config_whose_shapes_differ_from_the_saved_arrays_is_refused_naming_the_array(bundle_copy):
    """model.d_ff 128 -> 256 behind a forged seal: the layers match, the MLP's arrays do not; refused before orbax
    reads a parameter, naming the array and both shapes. Caught: no shape comparison (orbax's restore refused in its
    own words, 'Requested shape: (2, 256) is not compatible with the stored shape: (2, 128)', naming no array)."""
    config = serving_run.read_json(bundle_copy, bundle.META)["config"]
    config["model"]["d_ff"] = 256
    forge(bundle_copy, {"config": config})
    with pytest.raises(bundle.BundleError, match=r"export\.json's model config builds stack\.blocks\.mlp\.\w+\.\w+\.value "
                                                 r"with shape \(2, \d+, \d+\), but the decoder's files hold shape "
                                                 r"\(2, \d+, \d+\): the two do not belong together"):
        load_all(bundle_copy)


def test_a_file_added_to_the_decoder_is_refused(bundle_copy):
    """A file in decoder/ that COMPLETE does not record (orbax would read whatever it finds by name): one line
    naming it and the repair. Caught: only the recorded files checked (the bundle loaded)."""
    extra = os.path.join(bundle_copy, "decoder", "stack.blocks.attn.key.kernel.value", "1.0.0")
    shutil.copy(os.path.join(bundle_copy, DECODER_FILE), extra)
    with pytest.raises(bundle.BundleError, match=f"{extra} is not among the files COMPLETE records: it was added after "
                                                 f"the export finished. Fix: delete {bundle_copy}/done/decoder"):
        load_all(bundle_copy)


def test_bundle_files_refuse_every_kind_of_non_file(tmp_path):
    """The reader's own rules, one case each: a socket and a directory where a file is read, and a link to a
    directory where a directory is walked. Caught: a link to a directory inside the bundle walked like a real one
    (no error)."""
    import socket

    root = tmp_path / "b"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "real").write_bytes(b"x")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(root / "sock"))
    try:
        with pytest.raises(bundle_files.UnsafeBundleFile, match="sock is a socket, not a regular file"):
            bundle_files.read_bytes(str(root), "sock")
    finally:
        server.close()
    with pytest.raises(bundle_files.UnsafeBundleFile, match="sub is a directory, not a regular file"):
        bundle_files.read_bytes(str(root), "sub")
    os.symlink(root / "sub", root / "linked")
    with pytest.raises(bundle_files.UnsafeBundleFile, match="linked is a symbolic link to a directory"):
        bundle_files.check_tree(str(root), "linked")
    assert bundle_files.read_bytes(str(root), "sub/real") == b"x" and bundle_files.read_bytes(str(root), "none") is None


def _escape(text: str) -> str:
    import re

    return re.escape(text)
