"""The main model at inference: the decoder of an export, fed f-gram rows from the host.

The device holds only the decoder (token embedding T, blocks, head). Per batch the host finds
each position's longest f-gram with the Matcher and gathers its table row; the device embeds
where(matched, row, T(token)) and runs the decoder unchanged (docs/method.md §3 and §7). Because
matching depends only on token ids, the rows of a batch are known before the device needs them.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from flax import nnx

from scone_jax import sharding
from scone_jax.data.tokenizer import Tokenizer
from scone_jax.fgram.matcher import Matcher
from scone_jax.fgram.vocab import load_vocab
from scone_jax.model import losses
from scone_jax.model.transformer import Decoder
from scone_jax.runtime import storage
from scone_jax.serving import bundle
from scone_jax.serving.table import HostTable


@dataclasses.dataclass
class Served:
    """An export loaded for inference: decoder on the devices, everything else on the host."""

    meta: dict
    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer
    matcher: Matcher
    table: HostTable

    @property
    def decoder(self) -> Decoder:
        return nnx.merge(self.graphdef, self.params)


def define_export_flag(program: str):
    """Define --export (the bundle scone_jax.serving.export wrote) and --table, its old name, kept for one
    release; the returned function gives the path after parsing (None if neither was passed)."""
    export = flags.DEFINE_string("export", None, "Export directory written by scone_jax.serving.export (local or gs://).")
    table = flags.DEFINE_string("table", None, "Deprecated: the old name of --export, removed in the next release.")

    def path() -> str | None:
        if table.value:
            print(f"{program}: warning: --table is deprecated; pass --export={table.value}", file=sys.stderr)
        return export.value or table.value

    return path


def load(path: str, *, mesh=None, max_table_bytes: int | None = None, tokenizer_fingerprint: str | None = None) -> Served:
    """Load the export at `path`; refuses an unfinished one, swapped pieces, or (if given) a tokenizer
    other than the one the export was trained with."""
    expect = {} if tokenizer_fingerprint is None else {"tokenizer_fingerprint": tokenizer_fingerprint}
    table = HostTable.open(path, expect=expect, max_bytes=max_table_bytes)
    meta, sums = table.meta, table.checksums
    config = bundle.stored_config(meta["config"])
    tokenizer = load_tokenizer(path, sums)
    vocab = load_vocab(storage.join(path, bundle.FGRAMS), expected_tokenizer_fingerprint=tokenizer.fingerprint,
                       fix=bundle.rerun_fix(path, f"{bundle.DONE}/{bundle.FGRAMS}"))
    for what, have in (("tokenizer_fingerprint", tokenizer.fingerprint), ("fgram_vocab_fingerprint", vocab.fingerprint)):
        if have != meta[what]:
            raise bundle.BundleError(f"The export at {path!r} records {what}={meta[what]!r} but its files hash to "
                                     f"{have!r}: a piece was replaced. Fix: export again into a fresh --output.")
    if meta["d_model"] != config.model.d_model:
        raise bundle.BundleError(f"The table at {path!r} has width {meta['d_model']} but the decoder has "
                                 f"d_model={config.model.d_model}. Fix: export again.")
    mesh = mesh or sharding.make_mesh(config.mesh)
    graphdef, params = load_decoder(path, config.model, mesh, sums)
    have = bundle.params_fingerprint(params)
    if have != meta["model_fingerprint"]:
        raise bundle.BundleError(
            f"The decoder in {path!r} hashes to {have!r} but the table was exported from model "
            f"{meta['model_fingerprint']!r}: the table belongs to another model. Fix: export again.")
    return Served(meta, config, mesh, graphdef, params, tokenizer, Matcher(vocab), table)


def load_tokenizer(path: str, sums: bundle.Checksums | None) -> Tokenizer:
    """The bundle's tokenizer.model, its CRC checked before it is parsed: either kind, with the special ids
    the run trained with (they are part of its serialized form; see scone_jax/data/tokenizer.py)."""
    fix = bundle.rerun_fix(path)  # the export rewrites tokenizer.model when it differs from the run's
    where = storage.join(path, bundle.TOKENIZER)
    raw = storage.read_bytes(path, bundle.TOKENIZER)
    if raw is None:
        raise bundle.BundleError(f"{where} is missing. {fix}")
    if sums is not None and bundle.array_checksum(raw) != sums.files.get(bundle.TOKENIZER):
        raise bundle.BundleError(f"{where} is damaged: it hashes to {bundle.array_checksum(raw)}, "
                                 f"{bundle.COMPLETE} records {sums.files.get(bundle.TOKENIZER)}. {fix}")
    try:
        return Tokenizer.from_bytes(raw, path=where)
    except (ValueError, RuntimeError) as e:  # unreadable (a version 1 bundle has no CRC to catch this first)
        why = bundle.brief_error(e).split(" Fix: ")[0]  # the tokenizer's own fix names flags, not the bundle
        raise bundle.BundleError(f"{where} is not a tokenizer this code reads ({why}). {fix}") from e


def load_decoder(path: str, model_cfg, mesh, sums: bundle.Checksums | None = None):
    """The decoder's parameters from the export, each restored directly into its sharding; with `sums`,
    every file of decoder/ is first checked against its CRC."""
    fix = bundle.rerun_fix(path, f"{bundle.DONE}/{bundle.DECODER}")
    if sums is not None:
        bundle.verify_files(path, sums, bundle.DECODER, fix)
    graphdef, abstract = nnx.eval_shape(lambda: nnx.split(Decoder(model_cfg, nnx.Rngs(0)), nnx.Param))
    shardings = sharding.state_shardings(abstract, mesh)
    target = sharding.sharded_abstract(abstract, shardings)
    try:
        with bundle.decoder_checkpointer() as restorer:
            params = restorer.restore(storage.join(path, bundle.DECODER), args=ocp.args.StandardRestore(target))
    except Exception as e:  # orbax's errors vary by what is missing; a version 1 bundle gets here unchecked
        cause = e
        while cause.__cause__ or cause.__context__:  # orbax wraps tensorstore's error, which names the file
            cause = cause.__cause__ or cause.__context__
        raise bundle.BundleError(f"The decoder at {storage.join(path, bundle.DECODER)} cannot be restored "
                                 f"({bundle.brief_error(cause)[:300]}). {fix}") from e
    return graphdef, params


def host_rows(served: Served, batch: dict) -> dict:
    """Adds fgram_ids [B, T] (longest match, -1 none) and fgram_rows [B, T, d] (zero where none)."""
    ids = served.matcher.match(batch["inputs"], batch["segment_ids"])
    return batch | {"fgram_ids": ids, "fgram_rows": served.table.gather(ids)}


def input_embeddings(decoder: Decoder, tokens: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    """T(token), replaced by the table row where an f-gram ends (the same rule as SconeModel)."""
    x = decoder.embed(tokens)
    return jnp.where((ids >= 0)[..., None], rows.astype(x.dtype), x)


def batch_logits(decoder: Decoder, batch: dict) -> jax.Array:
    x = input_embeddings(decoder, batch["inputs"], batch["fgram_ids"], batch["fgram_rows"])
    return decoder.logits(decoder.decode(x, batch["segment_ids"], batch["positions"]))


def make_eval_step(served: Served, use_table: bool = True):
    """jit(params, batch) -> (sum of token losses, number of target tokens), batch sharded by rows.

    use_table=False runs the same decoder on T(token) alone: the baseline the benchmark compares with."""
    graphdef = served.graphdef

    @jax.jit
    def step(params, batch):
        decoder = nnx.merge(graphdef, params)
        logits = batch_logits(decoder, batch) if use_table else decoder.batch_logits(batch)
        return losses.token_cross_entropy(logits, batch).sum(), batch["loss_mask"].sum()

    run = sharding.under_mesh(served.mesh, step)
    return lambda batch: run(served.params, batch)


def device_batch(served: Served, batch: dict, keys=("inputs", "targets", "segment_ids", "positions", "loss_mask",
                                                    "fgram_ids", "fgram_rows")) -> dict:
    """This process's host arrays -> global arrays sharded by rows (the transfer starts now, async)."""
    return sharding.global_batch({k: np.asarray(batch[k]) for k in keys if k in batch}, served.mesh)
