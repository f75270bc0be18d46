"""The export bundle: everything inference needs, in one directory (local path or gs:// URL).

    export.json      metadata: format, S, d, K, dtype, chunk_rows, fingerprints, the run's config
    table/           zarr3 [S, d] f-gram embeddings in uncompressed chunks of `chunk_rows` rows: the
                     unit a process writes and the bounded cache reads (whole objects, no range
                     requests; embeddings do not compress)
    done/<chunk>     markers: table chunk written (an interrupted export resumes from them); also
                     done/fgrams and done/decoder for those two pieces
    fgrams/          the f-gram vocabulary (scone_jax.fgram.vocab format)
    tokenizer.model  the tokenizer the vocabulary and the decoder were trained with, in its serialized form
                     (scone_jax/data/tokenizer.py, Tokenizer.proto): a SentencePiece model with its own ids
                     is the .model file itself (as in bundles made before tokenizer.json support); anything
                     else (a Hugging Face tokenizer.json, or overridden special ids) is that file wrapped
                     with the run's bos/eos/pad ids, so serving uses them without the run's data config.
                     The name stays tokenizer.model for every kind: readers tell the kind from the content.
    decoder/         orbax checkpoint of the main decoder's parameters (no f-gram model, no optimizer)
    COMPLETE         written last; readers refuse a bundle without it. JSON: export.json's fingerprint and
                     the CRC-32 of every table chunk and of every file of decoder/ and tokenizer.model

Integrity: each done/<chunk> marker holds the CRC-32 of that chunk's rows, computed from the rows in
memory before they were written; done/decoder holds the CRC-32 of each decoder file, read back once
saved. COMPLETE gathers them. Readers check every chunk as they read it (HostTable: the whole table
at load, or each chunk the bounded cache fetches), the decoder's files and tokenizer.model before
parsing them; the f-gram vocabulary checks its own arrays (scone_jax.fgram.vocab). A missing chunk
reads as zeros through zarr, and zeros fail its CRC, so deleted files cannot pass as data. Repair:
delete the done marker of the bad piece and rerun the export, which rewrites pieces without a
marker.

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
import tensorstore as ts

from scone_jax import config as config_lib
from scone_jax.fgram.vocab import array_checksum
from scone_jax.runtime.errors import one_line
from scone_jax.runtime import storage
from scone_jax.training import checksums

FORMAT, VERSION = "scone_export", 1  # CHANGELOG.md: a change bumps VERSION and keeps a reader of the previous one
META, COMPLETE, TOKENIZER = "export.json", "COMPLETE", "tokenizer.model"
TABLE, DONE, FGRAMS, DECODER = "table", "done", "fgrams", "decoder"
DTYPES = ("bfloat16", "float32")


class BundleError(ValueError):
    """A bundle that is missing, unfinished, or does not match what it is used with."""


def stored_config(saved: dict) -> ml_collections.ConfigDict:
    """A config saved with a checkpoint or an export, over today's defaults: keys added to the code
    since it was saved take their defaults."""
    config = config_lib.base_config()

    def merge(node, values, where):
        for key, value in values.items():
            if key not in node:
                raise BundleError(f"The saved config has {where}{key}, which this code does not know; "
                                  "use the scone_jax version that wrote it.")
            if isinstance(value, dict):
                merge(node[key], value, f"{where}{key}.")
            else:
                node[key] = value

    merge(config, saved, "")
    return config


def decoder_checkpointer() -> ocp.AsyncCheckpointer:
    """Orbax for decoder/: one zarr array per parameter, not OCDBT. Written once, so OCDBT's small-file
    savings do not matter, and plain arrays are readable with tensorstore alone."""
    return ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler(use_ocdbt=False))


def meta_fingerprint(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def params_fingerprint(state) -> str:
    """Content fingerprint of a parameter tree, the same on any mesh and device count: each array's
    checksum (training/checksums.py, what checkpoints record) with its path, shape and dtype, hashed."""
    sums = checksums.tree_checksums(state)
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        key = jax.tree_util.keystr(path)
        digest.update(f"{key}:{leaf.shape}:{leaf.dtype}:{sums[key]};".encode())
    return digest.hexdigest()[:16]


def table_spec(path: str) -> dict:
    return {"driver": "zarr3", "kvstore": storage.kvstore_url(storage.join(path, TABLE))}


def create_table_spec(path: str, rows: int, width: int, dtype: str, chunk_rows: int) -> dict:
    return table_spec(path) | {"metadata": {
        "shape": [rows, width],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_rows, width]}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }}


def read_export_meta(path: str) -> dict | None:
    raw = storage.read_bytes(path, META)
    return None if raw is None else json.loads(raw)


@dataclasses.dataclass(frozen=True)
class Checksums:
    """What COMPLETE records: the CRC-32 (8 hex digits) of each table chunk's rows, in chunk order, and
    of each file of decoder/ and of tokenizer.model, keyed by its path in the bundle."""

    table: list[str]
    files: dict[str, str]


def complete_marker(meta: dict, table: list[str], files: dict[str, str]) -> bytes:
    return json.dumps({"export_fingerprint": meta_fingerprint(meta), "checksum": "crc32", "table": table,
                       "files": files}).encode()


def done_key(chunk: int) -> str:
    return f"{DONE}/{chunk:09d}"


def chunk_key(chunk: int) -> str:
    """The table chunk's object: zarr3's default key encoding; one chunk spans the row width."""
    return f"{TABLE}/c/{chunk}/0"


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
    return {key: array_checksum(bytes(read.result().value)) for key, read in reads.items()}


def verify_files(path: str, sums: Checksums, directory: str, fix: str) -> None:
    """Every file COMPLETE records under `directory` is there and has its CRC-32."""
    store = storage.open_store(path)
    reads = {key: store.read(key) for key in sorted(sums.files) if key.startswith(directory + "/")}
    for key, read in reads.items():
        raw = read.result()
        if raw.state != "value":
            raise BundleError(f"{storage.join(path, key)} is missing. {fix}")
        have = array_checksum(bytes(raw.value))
        if have != sums.files[key]:
            raise BundleError(f"{storage.join(path, key)} is damaged: it hashes to {have}, {COMPLETE} records "
                              f"{sums.files[key]}. {fix}")


def bad_chunks_error(path: str, meta: dict, bad: dict, sums: list[str] | None) -> BundleError:
    """The error for table chunks that failed their CRC (bad: chunk -> the CRC of the rows read) or
    could not be read (chunk -> the exception): names the first chunk's object and the repair."""
    first, rows = min(bad), meta["chunk_rows"]
    lo, hi = first * rows, min((first + 1) * rows, meta["num_fgrams"])
    if isinstance(bad[first], Exception):
        state = f"cannot be read ({one_line(bad[first])})"
    elif storage.read_bytes(path, chunk_key(first)) is None:
        state = "is missing (zarr would serve its rows as zeros)"
    else:
        state = f"is damaged: its rows hash to {bad[first]}, {COMPLETE} records {sums[first]}"
    more = f"; {len(bad) - 1} more table chunks are bad" if len(bad) > 1 else ""
    markers = ", ".join(storage.join(path, done_key(c)) for c in sorted(bad)[:3]) + (", ..." if len(bad) > 3 else "")
    return BundleError(
        f"{storage.join(path, chunk_key(first))} (table rows {lo}..{hi - 1}) {state}{more}. Fix: delete the done "
        f"marker of each bad chunk ({markers}), then re-run `python -m scone_jax.serving.export --workdir=RUN --output={path}` "
        "with the run it was exported from; it rewrites the chunks that have no done marker.")


def open_complete(path: str, expect: dict | None = None) -> dict:
    """The metadata of a finished bundle; refuses an unfinished one or one whose fingerprints
    differ from `expect` (keys of export.json, e.g. tokenizer_fingerprint)."""
    return open_checked(path, expect)[0]


def open_checked(path: str, expect: dict | None = None) -> tuple[dict, Checksums]:
    """open_complete, and the checksums COMPLETE records."""
    meta = read_export_meta(path)
    marker = storage.read_bytes(path, COMPLETE)
    if meta is None or marker is None:
        state = "no export" if meta is None else "an unfinished export (no COMPLETE marker)"
        raise BundleError(
            f"{path!r} holds {state}. Fix: run `python -m scone_jax.serving.export --workdir=RUN --output={path}` "
            "(rerunning it resumes an interrupted export)."
        )
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise BundleError(f"{path!r} is format {meta.get('format')!r} v{meta.get('version')}; this code reads "
                          f"{FORMAT!r} v{VERSION}. Fix: export the run again with this version.")
    try:
        record = json.loads(marker)
    except ValueError:
        record = {}
    if not isinstance(record, dict) or record.get("export_fingerprint") != meta_fingerprint(meta) or "table" not in record:
        raise BundleError(f"{path!r}: {META} and {COMPLETE} do not match; one was changed or damaged after the export "
                          f"finished. Fix: delete {storage.join(path, COMPLETE)} and re-run the export, which rebuilds "
                          "it (if it says the export differs, export into a fresh --output).")
    for key, want in (expect or {}).items():
        if meta.get(key) != want:
            raise BundleError(
                f"The export at {path!r} has {key}={meta.get(key)!r}, but what it is used with has {want!r}. "
                "Fix: use the export made from this run (or export this run again)."
            )
    return meta, Checksums(table=record["table"], files=record["files"])


def check_table(meta: dict, table: ts.TensorStore, path: str) -> None:
    """The stored array must have the shape and dtype export.json promises."""
    want = ([meta["num_fgrams"], meta["d_model"]], meta["dtype"])
    have = (list(table.shape), str(table.dtype.name))
    if have != want:
        raise BundleError(f"The table at {path!r} is {have[1]} {have[0]} but {META} says {want[1]} {want[0]}; "
                          "the bundle was altered. Fix: export again.")


def numpy_dtype(name: str):
    if name not in DTYPES:
        raise BundleError(f"Table dtype {name!r} is not supported; use one of {DTYPES}.")
    return jnp.dtype(name)
