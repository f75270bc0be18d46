"""`serving.export --output=D` writes only into a missing or empty directory, or into an export (resumed, repaired,
or refused if it is another run's): anything else at D is refused in one line before a byte is written
(serving/output_dir.py). Before, a user's tokenizer.model was replaced and decoder/ deleted, exit 0."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from scone_jax.runtime import storage, write_probe
from scone_jax.serving import bundle, export, output_dir
from tests import serving_run
from tests.common import run_tool

EXPORT = dict(dtype="float32", chunk_rows=64, batch_rows=512)  # the shared export's (serving_run.exported)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return serving_run.trained_run(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return serving_run.exported(tmp_path_factory, "float32")


def snapshot(path) -> dict:
    """Every entry under `path`: files with their bytes' hash, directories as such."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), path)] = "dir"
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def users_directory(path, *, notes=True, meta=None):
    """A directory of the user's: their own tokenizer.model and decoder/ (names an export writes too), notes.txt,
    and, given `meta`, an export.json of theirs."""
    os.makedirs(os.path.join(path, "decoder"))
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(b"the user's own tokenizer")
    with open(os.path.join(path, "decoder", "weights.bin"), "wb") as f:
        f.write(b"the user's own weights")
    if notes:
        with open(os.path.join(path, "notes.txt"), "w") as f:
            f.write("keep me")
    if meta is not None:
        with open(os.path.join(path, "export.json"), "w") as f:
            json.dump(meta, f)


@pytest.mark.parametrize("case,words", [
    ("users_files", "holds 'notes.txt', which a scone_jax export does not write; nothing was written there"),
    ("export_names_only", "holds decoder, tokenizer.model but no export.json: not a scone_jax export this program "
                          "wrote, so it would be overwritten; nothing was written there"),
    ("foreign_export_json", "holds decoder, export.json, tokenizer.model but the export.json there is not a "
                            "scone_jax export's"),
    ("a_file", "is a file, not a directory; nothing was written. Fix: pass a new or empty directory for the export."),
])
def test_an_output_holding_anything_else_is_refused_before_anything_is_written(run, tmp_path, case, words):
    """Caught: the export without its output check (the user's tokenizer.model replaced by the run's, decoder/'s
    weights.bin deleted, the export finished); the check accepting every name an export writes without its
    export.json (the second case exported over the user's files); any export.json taken for an export's (the third)."""
    output = str(tmp_path / "out")
    if case == "a_file":
        with open(output, "w") as f:
            f.write("a file")
    else:
        users_directory(output, notes=case == "users_files",
                        meta={"format": "someone_else"} if case == "foreign_export_json" else None)
    before = snapshot(tmp_path)
    with pytest.raises(output_dir.OutputNotFreeError) as error:
        export.export(run["workdir"], output, **EXPORT)
    message = str(error.value)
    assert message.startswith(f"--output={output} ") and words in message and "\n" not in message, message
    assert message.endswith("Fix: pass a new or empty directory for --output, or remove what is there (an export "
                            "writes only into one of those, or into an unfinished export of the same run, which it "
                            "resumes).") or case == "a_file", message
    assert snapshot(tmp_path) == before


def test_a_directory_holding_only_a_write_probe_is_a_fresh_export(run, reference, tmp_path):
    """Every process of a multi-process export claims --output, and each also probes it (write_probe.py writes and
    deletes a file there), so one process may list the directory while another's probe file is in it; a probe the
    user killed leaves one behind. Neither is content: the export goes ahead, equal to one into an empty directory;
    beside a user's file the refusal names only that file. Caught: the probe's name counted as content (the
    two-process export failed in CI: process 1 refused 'holds .write_probe-... but no export.json' and process 0
    aborted waiting for it)."""
    output = tmp_path / "out"
    output.mkdir()
    (output / f"{write_probe.PROBE_PREFIX}0123abcd").write_text("ok")
    assert export.claim_output(str(output)) is False
    assert export.export(run["workdir"], str(output), **EXPORT)["rows_computed"] == 2000
    assert bundle.Bundle.open(str(output)).meta == bundle.Bundle.open(reference).meta
    np.testing.assert_array_equal(serving_run.ram_table(str(output)).gather(np.arange(2000)),
                                  serving_run.ram_table(reference).gather(np.arange(2000)))

    users = tmp_path / "users"
    users.mkdir()
    (users / f"{write_probe.PROBE_PREFIX}0123abcd").write_text("ok")
    (users / "notes.txt").write_text("keep me")
    with pytest.raises(output_dir.OutputNotFreeError, match=f"--output={users} holds 'notes.txt', which a scone_jax "
                                                            "export does not write; nothing"):
        export.claim_output(str(users))


def test_an_export_stopped_after_its_first_write_resumes_to_the_same_bundle(run, reference, tmp_path, monkeypatch):
    """A stop right after the vocabulary was written (before its done marker): export.json is already there, written
    first, so the rerun takes the directory for the unfinished export it is and finishes it, equal to one never
    stopped. An empty directory is taken too. Caught: export.json written after the vocabulary, as before (the
    stopped export held fgrams/ and no export.json, and its rerun was refused as someone else's directory)."""
    output = str(tmp_path / "out")
    os.makedirs(output)  # empty: a fresh export
    real = export.save_vocab

    def stopped_after(vocab, path):
        real(vocab, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "save_vocab", stopped_after)
    with pytest.raises(KeyboardInterrupt):
        export.export(run["workdir"], output, **EXPORT)
    monkeypatch.undo()
    assert set(os.listdir(output)) >= {"export.json", "fgrams"} and "COMPLETE" not in os.listdir(output)
    figures = export.export(run["workdir"], output, **EXPORT)
    assert figures["rows_computed"] == 2000
    np.testing.assert_array_equal(serving_run.ram_table(output).gather(np.arange(2000)),
                                  serving_run.ram_table(reference).gather(np.arange(2000)))


def test_an_export_stopped_while_orbax_saved_the_decoder_resumes(run, reference, tmp_path):
    """orbax saves decoder/ under a temporary name first; an export stopped then leaves it beside the rest. The rerun
    takes the directory as its own unfinished export (orbax's name is an export's) and completes it. Caught: only
    the bundle's own names allowed (the rerun refused: 'holds decoder.orbax-checkpoint-tmp-...')."""
    output = str(tmp_path / "out")
    shutil.copytree(reference, output)
    os.remove(os.path.join(output, bundle.COMPLETE))
    os.remove(os.path.join(output, bundle.DONE, bundle.DECODER))
    os.makedirs(os.path.join(output, "decoder.orbax-checkpoint-tmp-1700000000"))
    assert export.export(run["workdir"], output, **EXPORT)["rows_computed"] == 0
    assert bundle.Bundle.open(output).meta == bundle.Bundle.open(reference).meta


@pytest.mark.slow
def test_the_cli_refuses_a_users_directory_in_one_line_and_leaves_it_as_it_was(run, tmp_path):
    """The issue's case through the program: exit 2, one line, the user's files as they were."""
    output = str(tmp_path / "mine")
    users_directory(output)
    before = snapshot(output)
    result = run_tool("-m scone_jax.serving.export", [f"--workdir={run['workdir']}", f"--output={output}"], timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"scone_jax.serving.export: error: --output={output} holds 'notes.txt'"), line
    assert snapshot(output) == before


@pytest.mark.slow
def test_a_gcs_prefix_holding_anything_else_is_refused(run, bucket):
    """The same check on gs:// (the emulator): an object of the user's under the prefix refuses the export, and the
    object is left as it was; a prefix an export stopped in (export.json only) is taken."""
    output = f"{bucket}/users/prefix"
    storage.write_bytes(output, "notes.txt", b"keep me")
    storage.write_bytes(output, "tokenizer.model", b"the user's own tokenizer")
    with pytest.raises(output_dir.OutputNotFreeError, match=f"--output={output} holds 'notes.txt', which a scone_jax "
                                                            "export does not write"):
        export.export(run["workdir"], output, **EXPORT)
    assert storage.read_bytes(output, "tokenizer.model") == b"the user's own tokenizer"
    assert storage.read_bytes(output, "notes.txt") == b"keep me"
    started = f"{bucket}/users/started"
    storage.write_bytes(started, bundle.META, json.dumps({"format": bundle.FORMAT}).encode())
    assert export.claim_output(started) is True and export.claim_output(f"{bucket}/users/none") is False


def test_relative_paths_with_dotdot_export_and_load(run, reference, tmp_path, monkeypatch):
    """`--output=../x` and `--export=../x` (issue 62: tensorstore refused '../x/decoder...' with four tracebacks,
    and the reader's failure advised deleting done/decoder of a sound bundle): resolved once where the program
    takes them, the export writes the bundle the absolute path gets and the reader serves it. Caught: export.export
    and inference.load without storage.resolved ('Invalid file path')."""
    from scone_jax.serving import inference

    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    figures = export.export(run["workdir"], "../x", **EXPORT)
    assert figures["rows_computed"] == 2000
    served = inference.load("../x", table="ram")
    want = serving_run.ram_table(reference).gather(np.arange(2000))
    np.testing.assert_array_equal(served.table.gather(np.arange(2000)), want)


def test_a_sound_bundle_that_cannot_be_read_here_is_not_called_damaged(reference, monkeypatch):
    """The decoder's files match their checksums but orbax cannot restore them here (issue 62: a relative path it
    refused): the one-line error names the directory and the cause and does not advise deleting done/decoder and
    exporting again, which would rewrite a sound bundle. Caught: the old message's rerun_fix."""
    from scone_jax.serving import inference

    class Refusing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def restore(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", "decoder/_sharding")

    monkeypatch.setattr(bundle, "decoder_checkpointer", Refusing)
    with pytest.raises(bundle.BundleError) as refused:
        inference.load(reference, table="ram")
    message = str(refused.value)
    assert "\n" not in message and "Permission denied" in message and f"{reference}/decoder" in message
    assert "needs no repair" in message and bundle.DONE not in message and "delete" not in message.lower()
