"""A damaged export bundle is a one-line error naming the file and the repair, never zero rows; the
repair it names works.

Each test damages its own copy of one shared export, as a user's disk or a partial copy would, and
runs the CLI a user runs."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorstore as ts

from scone_jax.runtime import storage
from scone_jax.serving import bundle, export, inference, table as table_lib
from tests import serving_run
from tests.common import REPO, xla_flags

# A failed orbax restore leaves its other reads' coroutines to be collected later, in whichever test runs then.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8)}
ROWS = 2000  # the shared run's f-grams; files of 64 rows: 32 files, the last one 16 rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return serving_run.trained_run(tmp_path_factory)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return serving_run.eval_text(tmp_path_factory)


@pytest.fixture
def bundle_copy(original, tmp_path):
    path = str(tmp_path / "bundle")
    shutil.copytree(original, path)
    return path


def cli(tool, path, text, *flags):
    argv = [sys.executable, "-m", f"scone_jax.serving.{tool}", f"--export={path}"]
    if tool == "evaluate":
        argv += ["--config.data.source=text", f"--config.data.eval_files={text}", "--max_batches=1", "--result="]
    else:
        argv += ["--prompt=And God said", "--num_tokens=3", "--temperature=0"]
    return subprocess.run(argv + list(flags), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def one_line_error(result, tool) -> str:
    """Exit 2 and exactly one error line (no traceback); returns it."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"scone_jax.serving.{tool}: error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_deleted_table_file_is_named_and_rerunning_the_export_repairs_it(run, original, bundle_copy, text):
    """A deleted table file, with rows served from disk: one line naming it, its rows and the repair (exit 2), at
    open. Catches (tried): a table opened without looking for its files (the missing one found only when a batch
    needs its rows), and an export whose rerun on a COMPLETE bundle ignores deleted done markers (the repair
    left the file missing: 0 rows computed)."""
    os.remove(os.path.join(bundle_copy, "table", "000000005"))
    line = one_line_error(cli("evaluate", bundle_copy, text, "--table=disk"), "evaluate")
    assert f"{bundle_copy}/table/000000005 (table rows 320..383) is missing" in line
    assert f"Fix: delete the done marker of each bad file ({bundle_copy}/done/000000005)" in line
    assert "re-run `python -m scone_jax.serving.export --workdir=RUN" in line

    os.remove(os.path.join(bundle_copy, "done", "000000005"))  # the repair the message names
    figures = export.export(run["workdir"], bundle_copy, dtype="float32", chunk_rows=64, batch_rows=512)
    assert figures["rows_computed"] == 512  # the one round holding file 5
    np.testing.assert_array_equal(serving_run.ram_table(bundle_copy).gather(np.arange(ROWS)),
                                  serving_run.ram_table(original).gather(np.arange(ROWS)))
    with open(os.path.join(bundle_copy, "COMPLETE")) as a, open(os.path.join(original, "COMPLETE")) as b:
        assert json.load(a)["table"] == json.load(b)["table"]


def test_corrupted_table_file_is_named_with_its_rows_from_disk_and_at_load(bundle_copy, text):
    """Same size, two bytes flipped in rows 0 and 39 (blocks of 16 fp32 rows): the CLI serving rows from disk names
    the first damaged block's rows when a batch reads them (tried: the blocks' CRC check skipped; evaluate exited
    0), the load into RAM names them too."""
    chunk = os.path.join(bundle_copy, "table", "000000000")
    data = bytearray(open(chunk, "rb").read())
    data[100] ^= 0xFF
    data[39 * 256 + 8] ^= 0x01
    open(chunk, "wb").write(bytes(data))
    line = one_line_error(cli("evaluate", bundle_copy, text, "--table=disk"), "evaluate")
    assert f"{bundle_copy}/table/000000000 (table rows 0..63) is damaged: table rows " in line
    assert "hash to " in line and ", its block index records " in line
    with pytest.raises(bundle.BundleError, match=r"table/000000000 \(table rows 0\.\.63\) is damaged: table rows "
                                                 r"0\.\.15 hash to [0-9a-f]{8}, its block index records [0-9a-f]{8} "
                                                 r"\(1 more damaged blocks in this file\)"):
        serving_run.ram_table(bundle_copy)


def test_deleted_table_directory_stops_generate(bundle_copy, text):
    """Every table file gone: generate (table in RAM) refuses, counting the files (tried: open_table not
    looking for the files; a bare FileNotFoundError)."""
    shutil.rmtree(os.path.join(bundle_copy, "table"))
    line = one_line_error(cli("generate", bundle_copy, text), "generate")
    assert f"{bundle_copy}/table/000000000 (table rows 0..63) is missing" in line
    assert "31 more table files are bad" in line and "done/000000002, ...)" in line


@pytest.mark.parametrize("tool", ["evaluate", "generate"])
def test_table_flags_reach_the_loader_and_a_budget_below_the_index_is_one_line(original, text, tool):
    """--table=disk with --max_table_bytes under the block index that must stay in RAM (125 blocks: 500 bytes):
    one line with the size it needs, exit 2 (caught: generate without the flags passed to inference.load:
    the table loaded whole into RAM, exit 0)."""
    line = one_line_error(cli(tool, original, text, "--table=disk", "--max_table_bytes=100"), tool)
    assert f"--max_table_bytes=100 is less than the 500 bytes the block index of {original}'s table (125 blocks) " \
           "must keep in RAM to serve rows from disk. Fix: raise --max_table_bytes to at least 500" in line


DECODER_CHUNK = os.path.join("decoder", "stack.blocks.attn.key.kernel.value", "0.3.0")  # one shard of one array


def test_deleted_decoder_array_file_is_named_and_repaired(run, bundle_copy, text):
    """One chunk file of a decoder array deleted: a 148-line traceback before (orbax's Exception around
    tensorstore's NOT_FOUND); now the CRCs name the file before orbax reads anything (tried: load_decoder
    without verify_files; the restore's wrapped error came instead). Deleting done/decoder and rerunning
    the export, as the message says, rewrites the decoder."""
    os.remove(os.path.join(bundle_copy, DECODER_CHUNK))
    line = one_line_error(cli("evaluate", bundle_copy, text), "evaluate")
    assert f"{bundle_copy}/{DECODER_CHUNK} is missing" in line
    assert f"Fix: delete {bundle_copy}/done/decoder, then re-run" in line

    os.remove(os.path.join(bundle_copy, "done", "decoder"))
    assert export.export(run["workdir"], bundle_copy, dtype="float32", chunk_rows=64, batch_rows=512)[
        "rows_computed"] == 0
    served = inference.load(bundle_copy)
    assert bundle.params_fingerprint(served.params) == served.bundle.meta["model_fingerprint"]


def test_a_missing_decoder_file_behind_a_forged_seal_is_one_line(bundle_copy):
    """With COMPLETE resealed over the removed file, the restore itself fails: one line with tensorstore's
    words naming the file, and the fix (tried: no wrapper around the restore; orbax's bare Exception
    escaped, the CLI's traceback)."""
    os.remove(os.path.join(bundle_copy, DECODER_CHUNK))
    serving_run.reseal(bundle_copy)
    with pytest.raises(bundle.BundleError, match=f"The decoder at {bundle_copy}/decoder cannot be restored "
                                                 f"\\(NOT_FOUND: .*{DECODER_CHUNK}\" is missing\\)\\. "
                                                 f"Fix: delete {bundle_copy}/done/decoder, then re-run") as error:
        inference.load(bundle_copy)
    assert "\n" not in str(error.value)


def test_deleted_tokenizer_is_named_and_rerunning_the_export_rewrites_it(run, original, bundle_copy, text):
    """Before: a tokenizer parsed from nothing, 'defines no pad/bos/eos piece'. A damaged one is caught
    by its CRC before sentencepiece parses it (tried: no CRC check; the parse error came instead)."""
    tokenizer = os.path.join(bundle_copy, "tokenizer.model")
    proto = open(tokenizer, "rb").read()
    os.remove(tokenizer)
    line = one_line_error(cli("evaluate", bundle_copy, text), "evaluate")
    assert line.endswith(f"{tokenizer} is missing. Fix: re-run `python -m scone_jax.serving.export --workdir=RUN "
                         f"--output={bundle_copy}` with the run it was exported from; it rewrites tokenizer.model "
                         "from the run.")
    open(tokenizer, "wb").write(proto[:-10])
    with pytest.raises(bundle.BundleError, match=f"{tokenizer} is damaged: it hashes to"):
        inference.load(bundle_copy)

    assert export.export(run["workdir"], bundle_copy, dtype="float32", chunk_rows=64, batch_rows=512)[
        "rows_computed"] == 0
    assert open(tokenizer, "rb").read() == proto
    assert inference.load(bundle_copy).tokenizer.fingerprint == run["tokenizer"].fingerprint


def test_corrupted_fgram_vocabulary_array_is_named(bundle_copy, text):
    """Flipped bytes in the zstd chunk of fgrams/tokens: undecodable, named with the bundle's repair
    (done/fgrams), not the standalone vocabulary's (tried: inference.load not passing its fix to
    load_vocab; the message sent the user to tools/extract_fgrams.py)."""
    chunk = os.path.join(bundle_copy, "fgrams", "tokens", "c", "0", "0")
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(chunk, "wb").write(bytes(data))
    line = one_line_error(cli("evaluate", bundle_copy, text), "evaluate")
    assert f"The f-gram vocabulary array {bundle_copy}/fgrams/tokens " in line
    assert f"Fix: delete {bundle_copy}/done/fgrams, then re-run" in line and "extract_fgrams" not in line


@pytest.mark.slow
def test_damaged_file_on_gcs_is_named_and_repaired(run, tmp_path_factory):
    """The same on gs:// (the emulator): the export's CRCs, both readers' checks, the marker repair
    (tried: an export rerun that trusts COMPLETE and ignores deleted markers; 0 rows recomputed)."""
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator (the [test] extra)")
    from tests import gcs_emulator

    with gcs_emulator.running() as bucket:
        output = f"{bucket}/exports/damaged"
        export.export(run["workdir"], output, dtype="float32", chunk_rows=64, batch_rows=512)
        want = serving_run.ram_table(output).gather(np.arange(ROWS))
        store = storage.open_store(output)
        good = bytes(store.read(bundle.chunk_key(7)).result().value)
        store.write(bundle.chunk_key(7), b"\0" * (64 * 64 * 4) + good[64 * 64 * 4:]).result()  # rows zeroed
        with pytest.raises(bundle.BundleError, match=f"{output}/table/000000007 .* is damaged: table rows 448..463"):
            serving_run.ram_table(output)
        with pytest.raises(bundle.BundleError, match=f"{output}/table/000000007 .* is damaged: table rows 464..479"):
            table_lib.open_table(bundle.Bundle.open(output), table="disk").gather(np.arange(464, 470))
        store.delete_range(_key_range(bundle.chunk_key(7))).result()
        with pytest.raises(bundle.BundleError, match=f"{output}/table/000000007 .* is missing"):
            table_lib.open_table(bundle.Bundle.open(output), table="disk")
        store.delete_range(_key_range(bundle.done_key(7))).result()
        assert export.export(run["workdir"], output, dtype="float32", chunk_rows=64, batch_rows=512)[
            "rows_computed"] == 512
        np.testing.assert_array_equal(serving_run.ram_table(output).gather(np.arange(ROWS)), want)


def _key_range(key):
    return ts.KvStore.KeyRange(key, key + "\0")
