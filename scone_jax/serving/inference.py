"""The main model at inference: the decoder of an export, fed f-gram rows from the host.

The device holds only the decoder (token embedding T, blocks, head). Per batch the host finds
each position's longest f-gram with the Matcher and gathers its table row, from RAM or from disk
(serving/table.py, --table); the device embeds
where(matched, row, T(token)) and runs the decoder unchanged (docs/method.md §3 and §7). Because
matching depends only on token ids, the rows of a batch are known before the device needs them.

An Over-Encoding export (docs/method.md §8) has no f-gram table: its n-gram tables are part of the decoder, on
the devices, and the host computes each batch's n-gram ids instead (data/ngram_hash.py, `Served.hasher`), as
training's loader does.
"""
from __future__ import annotations

import dataclasses

import jax
import ml_collections
from absl import flags
from flax import nnx

from scone_jax import sharding
from scone_jax.batch import Batch
from scone_jax.data.ngram_hash import NgramHasher
from scone_jax.data.tokenizer import Tokenizer
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import load_vocab
from scone_jax.model.transformer import Decoder
from scone_jax.runtime import storage
from scone_jax.runtime.crc import crc32_hex
from scone_jax.runtime.errors import one_line
from scone_jax.serving import bundle, bundle_files
from scone_jax.serving import table as table_lib
from scone_jax.serving.saved_decoder import load_decoder
from scone_jax.training import assets, steps


@dataclasses.dataclass
class Served:
    """An export loaded for inference: decoder on the devices, everything else on the host. `bundle` holds what
    the export records (export.json, COMPLETE's checksums), read once when it was opened."""

    bundle: bundle.Bundle
    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer
    matcher: Matcher
    table: table_lib.HostTable | table_lib.DiskTable
    hasher: NgramHasher | None = None  # Over-Encoding's n-gram ids (None: no n-gram tables)

    @property
    def decoder(self) -> Decoder:
        return nnx.merge(self.graphdef, self.params)


def define_export_flag():
    """Define --export (the bundle scone_jax.serving.export wrote); returns the flag holder."""
    return flags.DEFINE_string("export", None, "Export directory written by scone_jax.serving.export (local or gs://).")


def define_table_flags():
    """Define --table and --max_table_bytes (where the f-gram rows are served from); returns their holders."""
    table = flags.DEFINE_enum("table", "auto", list(table_lib.TABLE_MODES),
                              "Where the f-gram rows come from: ram (the table loaded whole), disk (each row read "
                              "from the export's files when a batch needs it: tables larger than RAM), auto (ram "
                              "when the table fits --max_table_bytes). docs/serving.md has the trade-off.")
    max_table_bytes = flags.DEFINE_integer("max_table_bytes", 0, "Host RAM for the table; 0 = no limit. From disk, "
                                           "what its block index leaves holds the most frequent rows.")
    return table, max_table_bytes


def load(path: str, *, mesh=None, table: str = "auto", max_table_bytes: int | None = None,
         tokenizer_fingerprint: str | None = None) -> Served:
    """Load the export at `path`, its f-gram rows in RAM or served from disk (`table`: ram, disk or auto, within
    `max_table_bytes`); refuses an unfinished one, swapped pieces, or (if given) a tokenizer other than the
    one the export was trained with."""
    expect = {} if tokenizer_fingerprint is None else {"tokenizer_fingerprint": tokenizer_fingerprint}
    path = storage.resolved(path)  # resolved once: orbax and tensorstore refuse a local path holding ..
    opened = bundle.Bundle.open(path, expect)
    rows = table_lib.open_table(opened, table=table, max_bytes=max_table_bytes)
    try:
        return _load_model(opened, rows, mesh)
    except BaseException:  # a refused bundle leaves no table open (a disk table holds every file's descriptor)
        rows.close()
        raise


def _load_model(opened: bundle.Bundle, rows, mesh) -> Served:
    """The tokenizer, vocabulary and decoder of the opened bundle, each checked against what it records."""
    path, meta, sums = opened.path, opened.meta, opened.checksums
    config = opened.config
    tokenizer = load_tokenizer(path, sums)
    bundle_files.check_tree(path, bundle.FGRAMS)  # zarr arrays, read by path
    vocab = load_vocab(storage.join(path, bundle.FGRAMS), expected_tokenizer_fingerprint=tokenizer.fingerprint,
                       fix=bundle.rerun_fix(path, f"{bundle.DONE}/{bundle.FGRAMS}"), num_fgrams=meta["num_fgrams"])
    for what, have in (("tokenizer_fingerprint", tokenizer.fingerprint), ("fgram_vocab_fingerprint", vocab.fingerprint)):
        if have != meta[what]:
            raise bundle.BundleError(f"The export at {path!r} records {what}={meta[what]!r} but its files hash to "
                                     f"{have!r}: a piece was replaced. Fix: export again into a fresh --output.")
    if meta["d_model"] != config.model.d_model:
        raise bundle.BundleError(f"The table at {path!r} has width {meta['d_model']} but the decoder has "
                                 f"d_model={config.model.d_model}. Fix: export again.")
    mesh = mesh or sharding.make_mesh(config.mesh)
    graphdef, params = load_decoder(path, config.model, mesh, sums, config.overencoding, config.get("engram"))
    have = bundle.params_fingerprint(params)
    if have != meta["model_fingerprint"]:
        raise bundle.BundleError(
            f"The decoder in {path!r} hashes to {have!r} but the table was exported from model "
            f"{meta['model_fingerprint']!r}: the table belongs to another model. Fix: export again.")
    return Served(opened, config, mesh, graphdef, params, tokenizer, Matcher(vocab), rows,
                  assets.ngram_hasher(config, tokenizer))


def load_tokenizer(path: str, sums: bundle.Checksums) -> Tokenizer:
    """The bundle's tokenizer.model, its CRC checked before it is parsed: either kind, with the special ids
    the run trained with (they are part of its serialized form; see scone_jax/data/tokenizer.py)."""
    fix = bundle.rerun_fix(path)  # the export rewrites tokenizer.model when it differs from the run's
    where = storage.join(path, bundle.TOKENIZER)
    raw = bundle_files.read_bytes(path, bundle.TOKENIZER)
    if raw is None:
        raise bundle.BundleError(f"{where} is missing. {fix}")
    if crc32_hex(raw) != sums.files.get(bundle.TOKENIZER):
        raise bundle.BundleError(f"{where} is damaged: it hashes to {crc32_hex(raw)}, "
                                 f"{bundle.COMPLETE} records {sums.files.get(bundle.TOKENIZER)}. {fix}")
    try:
        return Tokenizer.from_bytes(raw, path=where)
    except (ValueError, RuntimeError) as e:  # its CRC matched, yet unreadable: written by another version
        why = one_line(e).split(" Fix: ")[0]  # the tokenizer's own fix names flags, not the bundle
        raise bundle.BundleError(f"{where} is not a tokenizer this code reads ({why}). {fix}") from e


def host_rows(served: Served, batch: Batch) -> Batch:
    """The table provider's arrays (scone_jax/batch.py): fgram_ids (longest match, -1 none; stays on the host),
    fgram_rows [B, T, d] (zero where none) and fgram_matched; for an Over-Encoding export (no f-grams) its
    n-gram ids instead of the rows."""
    ids = served.matcher.match(batch.inputs, batch.segment_ids)
    if served.hasher is not None:
        return served.hasher(batch.replace(fgram_ids=ids))
    return batch.replace(fgram_ids=ids, fgram_rows=served.table.gather(ids), fgram_matched=ids >= 0)


def make_eval_step(served: Served):
    """jit(batch) -> (sum of token losses, number of target tokens) of the export's decoder: the training
    loop's eval step (training/steps.py), fed table rows instead of the f-gram model."""
    step = steps.make_eval_step(served.graphdef, jax.tree.map(lambda a: a.sharding, served.params), served.mesh)
    return lambda batch: step(served.params, batch)


def device_batch(served: Served, batch: Batch) -> Batch:
    """This process's host batch -> global arrays sharded by rows (host-only fields dropped; the transfer
    starts now, asynchronously)."""
    return sharding.global_batch(batch.for_device(), served.mesh)
