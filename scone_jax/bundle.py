"""The export bundle: everything inference needs, in one directory (local path or gs:// URL).

    export.json      metadata: format, S, d, K, dtype, chunk_rows, fingerprints, the run's config
    table/           zarr3 [S, d] f-gram embeddings in uncompressed chunks of `chunk_rows` rows: the
                     unit a process writes and the bounded cache reads (whole objects, no range
                     requests; embeddings do not compress)
    done/<chunk>     markers: table chunk written (an interrupted export resumes from them); also
                     done/fgrams and done/decoder for those two pieces
    fgrams/          the f-gram vocabulary (scone_jax.fgram.vocab format)
    tokenizer.model  the SentencePiece model the vocabulary and the decoder were trained with
    decoder/         orbax checkpoint of the main decoder's parameters (no f-gram model, no optimizer)
    COMPLETE         written last; holds export.json's fingerprint. Readers refuse a bundle without it.

Every file goes through tensorstore's kvstore (or orbax), so the same code reads and writes local
disk and GCS. The bundle is self-contained on purpose: a table can only be paired with the decoder
it was exported with, and the fingerprints catch pieces swapped in from another bundle.
"""
from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
import tensorstore as ts

from scone_jax import config as config_lib, storage

FORMAT, VERSION = "scone_export", 1
META, COMPLETE, TOKENIZER = "export.json", "COMPLETE", "tokenizer.model"
TABLE, DONE, FGRAMS, DECODER = "table", "done", "fgrams", "decoder"
DTYPES = ("bfloat16", "float32")


class BundleError(ValueError):
    """A bundle that is missing, unfinished, or does not match what it is used with."""


def stored_config(saved: dict) -> ml_collections.ConfigDict:
    """A config saved with a checkpoint or an export, over today's defaults: keys added to the code
    since it was saved take their defaults, so older runs still load."""
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

    merge(config, config_lib.upgrade_saved(saved), "")
    return config


def decoder_checkpointer() -> ocp.AsyncCheckpointer:
    """Orbax for decoder/: one zarr array per parameter, not OCDBT. Written once, so OCDBT's small-file
    savings do not matter, and plain arrays are readable with tensorstore alone."""
    return ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler(use_ocdbt=False))


def meta_fingerprint(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def params_fingerprint(state) -> str:
    """Content fingerprint of a parameter tree, the same on any mesh and device count.

    Each leaf's bits are summed as uint32 with position weights: integer sums wrap and are
    associative, so sharded reductions give the same value in any order (float sums would not).
    """
    leaves = jax.tree_util.tree_leaves_with_path(state)
    sums = [_bit_checksum(leaf) for _, leaf in leaves]
    digest = hashlib.sha256()
    for (path, leaf), s in zip(leaves, jax.device_get(sums)):
        digest.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}:{int(s)};".encode())
    return digest.hexdigest()[:16]


@jax.jit
def _bit_checksum(x):
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).ravel()
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def table_spec(path: str) -> dict:
    return {"driver": "zarr3", "kvstore": storage.kvstore_url(storage.join(path, TABLE))}


def create_table_spec(path: str, rows: int, width: int, dtype: str, chunk_rows: int) -> dict:
    return table_spec(path) | {"metadata": {
        "shape": [rows, width],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_rows, width]}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }}


def read_meta(path: str) -> dict | None:
    raw = storage.read_bytes(path, META)
    return None if raw is None else json.loads(raw)


def open_complete(path: str, expect: dict | None = None) -> dict:
    """The metadata of a finished bundle; refuses an unfinished one or one whose fingerprints
    differ from `expect` (keys of export.json, e.g. tokenizer_fingerprint)."""
    meta = read_meta(path)
    marker = storage.read_bytes(path, COMPLETE)
    if meta is None or marker is None:
        state = "no export" if meta is None else "an unfinished export (no COMPLETE marker)"
        raise BundleError(
            f"{path!r} holds {state}. Fix: run `python -m scone_jax.export --workdir=RUN --output={path}` "
            "(rerunning it resumes an interrupted export)."
        )
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise BundleError(f"{path!r} is format {meta.get('format')!r} v{meta.get('version')}; this code reads "
                          f"{FORMAT!r} v{VERSION}.")
    if marker.decode() != meta_fingerprint(meta):
        raise BundleError(f"{path!r}: {META} was changed after the export finished (its fingerprint no longer "
                          f"matches {COMPLETE}). Fix: export again into a fresh --output.")
    for key, want in (expect or {}).items():
        if meta.get(key) != want:
            raise BundleError(
                f"The export at {path!r} has {key}={meta.get(key)!r}, but what it is used with has {want!r}. "
                "Fix: use the export made from this run (or export this run again)."
            )
    return meta


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
