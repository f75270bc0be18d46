"""The export bundle: everything inference needs, in one directory (local path or gs:// URL).

    export.json      metadata: format, S, d, K, dtype, chunk_rows, block_rows, fingerprints, the run's config
    table/<chunk>    the f-gram embeddings [S, d], `chunk_rows` rows per file, row-major, each file ending in
                     its block index (the CRC-32 of each block of `block_rows` rows): serving/table_layout.py.
                     A row is found by arithmetic and read with one small read, so a table larger than
                     RAM is served from disk (serving/disk_table.py); a file is the unit a process writes
    done/<chunk>     markers: table file written (an interrupted export resumes from them); also
                     done/fgrams and done/decoder for those two pieces
    fgrams/          the f-gram vocabulary (scone_jax.fgram.vocab format)
    tokenizer.model  the tokenizer the vocabulary and the decoder were trained with, in its serialized form
                     (scone_jax/data/tokenizer.py, Tokenizer.proto): a SentencePiece model with its own ids
                     is the .model file itself (as in bundles made before tokenizer.json support); anything
                     else (a Hugging Face tokenizer.json, or overridden special ids) is that file wrapped
                     with the run's bos/eos/pad ids, so serving uses them without the run's data config.
                     The name stays tokenizer.model for every kind: readers tell the kind from the content.
    decoder/         orbax checkpoint of the main decoder's parameters (no f-gram model, no optimizer)
    COMPLETE         written last; readers refuse a bundle without it. JSON: export.json's fingerprint, the
                     CRC-32 of every table file's rows and of its block index, and of every file of
                     decoder/ and tokenizer.model

Readers open a bundle once with Bundle.open, which reads export.json and COMPLETE and refuses an unfinished
or altered bundle, or one holding a field no export writes (every size a reader allocates from is checked
there); the table (serving/table.py), tokenizer, vocabulary and decoder (serving/inference.py,
saved_decoder.py) are read from the opened Bundle, never from export.json again. A local bundle's files are
read only inside it and only as regular files (serving/bundle_files.py).

Integrity: each done/<chunk> marker holds the CRC-32s of that file's rows and block index, computed
from the rows in memory before they were written; done/decoder holds the CRC-32 of each decoder
file, read back once saved. COMPLETE gathers them. Readers check every row they use: a table loaded
into RAM against its files' row CRCs (a mismatch is then located to its blocks), a table served
from disk each block it reads against the block index (itself checked against COMPLETE at open);
the decoder's files and tokenizer.model before parsing them; the f-gram vocabulary checks its own
arrays (scone_jax.fgram.vocab). A missing or short table file is an error at open. Repair: delete
the done marker of the bad piece and rerun the export, which rewrites pieces without a marker.

Every file goes through tensorstore's kvstore (or orbax), so the same code reads and writes local
disk and GCS. The bundle is self-contained on purpose: a table can only be paired with the decoder
it was exported with, and the fingerprints catch pieces swapped in from another bundle.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from scone_jax.runtime import checksums, storage
from scone_jax.runtime.crc import crc32_hex
from scone_jax.runtime.errors import one_line
from scone_jax.saved_config import stored_config
from scone_jax.serving import bundle_files
from scone_jax.serving.table_layout import Layout, block_rows_for

FORMAT, VERSION = "scone_export", 2  # CHANGELOG.md: a change bumps VERSION
META, COMPLETE, TOKENIZER = "export.json", "COMPLETE", "tokenizer.model"
TABLE, DONE, FGRAMS, DECODER = "table", "done", "fgrams", "decoder"
PIECES = (META, COMPLETE, TOKENIZER, TABLE, DONE, FGRAMS, DECODER)  # all a bundle's directory holds
DTYPES = ("bfloat16", "float32")


class BundleError(ValueError):
    """A bundle that is missing, unfinished, or does not match what it is used with."""


def decoder_checkpointer() -> ocp.AsyncCheckpointer:
    """Orbax for decoder/: one zarr array per parameter, not OCDBT. Written once, so OCDBT's small-file
    savings do not matter, and plain arrays are readable with tensorstore alone."""
    return ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler(use_ocdbt=False))


def meta_fingerprint(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def params_fingerprint(state) -> str:
    """Content fingerprint of a parameter tree, the same on any mesh and device count: each array's
    checksum (runtime/checksums.py, what checkpoints record) with its path, shape and dtype, hashed."""
    sums = checksums.tree_checksums(state)
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        key = jax.tree_util.keystr(path)
        digest.update(f"{key}:{leaf.shape}:{leaf.dtype}:{sums[key]};".encode())
    return digest.hexdigest()[:16]


def read_export_meta(path: str) -> dict | None:
    """export.json as written, or None if there is none; BundleError if it is not a JSON object."""
    raw = bundle_files.read_bytes(path, META)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise BundleError(f"{storage.join(path, META)} is not a JSON object: it was damaged or replaced. Fix: export "
                          "again into a fresh --output.")
    return meta


def is_export_meta(raw: bytes) -> bool:
    """Whether `raw` is an export.json this program writes (any version): what lets an export resume there."""
    try:
        meta = json.loads(raw)
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


@dataclasses.dataclass(frozen=True)
class Checksums:
    """What COMPLETE records: the CRC-32 (8 hex digits) of each table file's rows and of its block index, in
    chunk order, and of each file of decoder/ and of tokenizer.model, keyed by its path in the bundle."""

    table: list[str]
    table_index: list[str]
    files: dict[str, str]


def complete_marker(meta: dict, table: list[str], table_index: list[str], files: dict[str, str]) -> bytes:
    return json.dumps({"export_fingerprint": meta_fingerprint(meta), "checksum": "crc32", "table": table,
                       "table_index": table_index, "files": files}).encode()


def done_key(chunk: int) -> str:
    return f"{DONE}/{chunk:09d}"


def chunk_key(chunk: int) -> str:
    """The table file of chunk `chunk` (serving/table_layout.py)."""
    return f"{TABLE}/{chunk:09d}"


def rerun_fix(path: str, marker: str | None = None) -> str:
    """The repair readers print: rerun on a finished bundle, the export rewrites every piece whose done
    marker is missing, and tokenizer.model if it differs from the run's."""
    delete = f"delete {storage.join(path, marker)}, then " if marker else ""
    rewrites = "the pieces that have no done marker" if marker else f"{TOKENIZER} from the run"
    return (f"Fix: {delete}re-run `python -m scone_jax.serving.export --workdir=RUN --output={path}` with the run it was "
            f"exported from; it rewrites {rewrites}.")


def file_checksums(path: str, directory: str) -> dict[str, str]:
    """CRC-32 of every file under `directory` of the bundle, keyed by its path in the bundle."""
    keys = sorted(k.decode() for k in storage.open_store(storage.join(path, directory)).list().result())
    store = storage.open_store(path)
    reads = {f"{directory}/{k}": store.read(f"{directory}/{k}") for k in keys}
    return {key: crc32_hex(bytes(read.result().value)) for key, read in reads.items()}


def verify_files(path: str, sums: Checksums, directory: str, fix: str) -> None:
    """The files under `directory` are exactly those COMPLETE records there, each with its CRC-32 (a library
    that reads the directory by path, as orbax does, reads nothing unchecked)."""
    recorded = sorted(key for key in sums.files if key.startswith(directory + "/"))
    present = {f"{directory}/{k.decode()}" for k in storage.open_store(storage.join(path, directory)).list().result()}
    extra = sorted(present - set(recorded))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise BundleError(f"{storage.join(path, extra[0])}{more} is not among the files {COMPLETE} records: it was "
                          f"added after the export finished. {fix}")
    store = storage.open_store(path)
    reads = {key: store.read(key) for key in recorded}
    for key, read in reads.items():
        raw = read.result()
        if raw.state != "value":
            raise BundleError(f"{storage.join(path, key)} is missing. {fix}")
        have = crc32_hex(bytes(raw.value))
        if have != sums.files[key]:
            raise BundleError(f"{storage.join(path, key)} is damaged: it hashes to {have}, {COMPLETE} records "
                              f"{sums.files[key]}. {fix}")


def bad_table_error(path: str, layout, bad: dict[int, str]) -> BundleError:
    """The error for table files that are missing, short or damaged (bad: chunk -> what is wrong with it, naming
    its bad rows where they are known): names the first file, its rows and the repair."""
    first = min(bad)
    lo, hi = layout.rows_of_chunk(first)
    more = f"; {len(bad) - 1} more table files are bad" if len(bad) > 1 else ""
    markers = ", ".join(storage.join(path, done_key(c)) for c in sorted(bad)[:3]) + (", ..." if len(bad) > 3 else "")
    return BundleError(
        f"{storage.join(path, chunk_key(first))} (table rows {lo}..{hi - 1}) {bad[first]}{more}. Fix: delete the done "
        f"marker of each bad file ({markers}), then re-run `python -m scone_jax.serving.export --workdir=RUN "
        f"--output={path}` with the run it was exported from; it rewrites the table files that have no done marker.")


@dataclasses.dataclass(frozen=True)
class Bundle:
    """A finished export, opened: export.json and what COMPLETE records, each read once, at open. Everything
    that reads the bundle (its table, tokenizer, vocabulary and decoder: serving/table.py, inference.py) reads
    them from here."""

    path: str
    meta: dict
    checksums: Checksums
    layout: Layout  # the table's files (serving/table_layout.py)

    @classmethod
    def open(cls, path: str, expect: dict | None = None) -> "Bundle":
        """The finished bundle at `path`; refuses an unfinished one, one whose export.json and COMPLETE disagree
        (with each other, or on the table's files), hold a field no export writes, or whose fingerprints differ
        from `expect` (keys of export.json, e.g. tokenizer_fingerprint). Every size the readers allocate from is
        checked here, before anything is allocated."""
        meta = read_export_meta(path)
        marker = bundle_files.read_bytes(path, COMPLETE)
        if meta is None or marker is None:
            state = "no export" if meta is None else "an unfinished export (no COMPLETE marker)"
            raise BundleError(
                f"{path!r} holds {state}. Fix: run `python -m scone_jax.serving.export --workdir=RUN --output={path}` "
                "(rerunning it resumes an interrupted export)."
            )
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            old = ", its table in zarr chunks that cannot be read a row at a time" if meta.get("version") == 1 else ""
            raise BundleError(f"{path!r} is format {meta.get('format')!r} v{meta.get('version')}{old}; this code reads "
                              f"{FORMAT!r} v{VERSION}. Fix: export the run again with this version: `python -m "
                              "scone_jax.serving.export --workdir=RUN --output=NEW_PATH` (a fresh --output).")
        try:
            record = json.loads(marker)
        except ValueError:
            record = {}
        if not isinstance(record, dict) or record.get("export_fingerprint") != meta_fingerprint(meta):
            raise BundleError(f"{path!r}: {META} and {COMPLETE} do not match; one was changed or damaged after the "
                              f"export finished. Fix: delete {storage.join(path, COMPLETE)} and re-run the export, "
                              "which rebuilds it (if it says the export differs, export into a fresh --output).")
        layout = _checked_layout(path, meta)
        for key, want in (expect or {}).items():
            if meta.get(key) != want:
                raise BundleError(
                    f"The export at {path!r} has {key}={meta.get(key)!r}, but what it is used with has {want!r}. "
                    "Fix: use the export made from this run (or export this run again)."
                )
        return cls(path, meta, _checked_sums(path, record, layout), layout)

    @property
    def config(self) -> ml_collections.ConfigDict:
        """The config of the run the bundle was exported from, over today's defaults."""
        try:
            return stored_config(self.meta["config"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise BundleError(f"{storage.join(self.path, META)} holds a config this code cannot read "
                              f"({one_line(e, 300)}).") from None


_ALTERED = "it was altered or damaged after the export. Fix: export again into a fresh --output."
_INTEGERS = {"num_fgrams": 0, "d_model": 1, "max_len": 0, "chunk_rows": 1, "block_rows": 1, "step": 0}
_TEXTS = ("model_fingerprint", "tokenizer_fingerprint", "fgram_vocab_fingerprint")


def _checked_layout(path: str, meta: dict) -> Layout:
    """The table's layout from export.json, each field first checked to be what an export writes."""
    where = storage.join(path, META)
    for key, least in _INTEGERS.items():
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise BundleError(f"{where} has {key}={value!r}, which no export writes (an integer >= {least}); {_ALTERED}")
    for key in _TEXTS + ("fgram_model_fingerprint",):
        value = meta.get(key)
        if not isinstance(value, str) and not (key == "fgram_model_fingerprint" and value is None):
            raise BundleError(f"{where} has {key}={value!r}, which no export writes (a fingerprint); {_ALTERED}")
    if not isinstance(meta.get("config"), dict):
        raise BundleError(f"{where} has config={meta.get('config')!r}, which no export writes (a dict); {_ALTERED}")
    if meta.get("dtype") not in DTYPES:
        raise BundleError(f"{where} has dtype={meta.get('dtype')!r}, which no export writes (one of {DTYPES}); "
                          f"{_ALTERED}")
    layout = Layout.of_meta(meta, numpy_dtype(meta["dtype"]))
    want = block_rows_for(layout.row_bytes, layout.chunk_rows)
    if layout.block_rows != want:
        raise BundleError(f"{where} has block_rows={layout.block_rows}, but rows of {layout.row_bytes} bytes in files "
                          f"of {layout.chunk_rows} are exported in blocks of {want}; {_ALTERED}")
    return layout


def _crcs(value) -> bool:
    """A list of CRC-32s as COMPLETE records them (8 hex digits)."""
    return isinstance(value, list) and all(map(_is_crc, value))


def _is_crc(value) -> bool:
    return isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)


def _checked_sums(path: str, record: dict, layout: Layout) -> Checksums:
    """COMPLETE's checksums, checked to be a whole record of this layout: a CRC per table file's rows and block
    index, and a CRC per file (of tokenizer.model and decoder/: their readers check that each is recorded)."""
    where = storage.join(path, COMPLETE)
    for key in ("table", "table_index"):
        if not _crcs(record.get(key)):
            raise BundleError(f"{where} has no list of table CRCs under {key!r}; {_ALTERED}")
        if len(record[key]) != layout.num_chunks:
            raise BundleError(f"{path!r}: {COMPLETE} records {len(record[key])} table files, the table has "
                              f"{layout.num_chunks}; the bundle was altered. Fix: export again into a fresh --output.")
    files = record.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and _is_crc(v) for k, v in files.items()):
        raise BundleError(f"{where} has no list of the CRCs of {TOKENIZER} and the decoder's files; {_ALTERED}")
    return Checksums(table=record["table"], table_index=record["table_index"], files=files)


def numpy_dtype(name: str):
    if name not in DTYPES:
        raise BundleError(f"Table dtype {name!r} is not supported; use one of {DTYPES}.")
    return jnp.dtype(name)
