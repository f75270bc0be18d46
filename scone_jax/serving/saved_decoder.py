"""The decoder of a bundle (decoder/, an orbax checkpoint of plain zarr arrays), restored only once it is known
to be what the bundle says: its files exactly those COMPLETE records, each with its CRC-32, and export.json's
model config building the shapes the files hold.

The config is compared with the saved arrays in two steps, both before any parameter is read: first the
number of layers the files hold (a scanned stack's leading axis, or an unscanned stack's numbered blocks)
against model.num_layers, since building an abstract model of an altered config with, say, 100,000 unscanned
blocks takes minutes; then every array's shape against the abstract model's.
"""
from __future__ import annotations

import json

import jax
import orbax.checkpoint as ocp
from flax import nnx

from scone_jax import sharding
from scone_jax.model.transformer import Decoder
from scone_jax.runtime import storage
from scone_jax.runtime.errors import one_line
from scone_jax.serving import bundle, bundle_files

_BLOCKS = "stack.blocks."  # the block stack's arrays: [layers, ...] scanned, stack.blocks.<i>.* unscanned
_ARRAY_METADATA = (".zarray", "zarr.json")  # zarr v2 (what orbax writes today), zarr v3


def saved_shapes(path: str, sums: bundle.Checksums) -> dict[str, tuple[int, ...]]:
    """Each saved array's name (orbax's: the parameter's path joined by '.') -> its shape, from its zarr metadata
    among the files COMPLETE records (call after bundle.verify_files)."""
    shapes = {}
    for key in sorted(sums.files):
        directory, _, name = key.rpartition("/")
        if name not in _ARRAY_METADATA or not directory.startswith(bundle.DECODER + "/"):
            continue
        raw = bundle_files.read_bytes(path, key)
        try:
            shape = json.loads(raw)["shape"]
        except (TypeError, ValueError, KeyError):
            shape = None
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise bundle.BundleError(f"{storage.join(path, key)} holds no array shape. "
                                     f"{bundle.rerun_fix(path, f'{bundle.DONE}/{bundle.DECODER}')}")
        shapes[directory[len(bundle.DECODER) + 1:]] = tuple(shape)
    return shapes


def saved_layers(shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The number of blocks the saved stack holds; None if the arrays do not say (no block stack)."""
    blocks = {name: shape for name, shape in shapes.items() if name.startswith(_BLOCKS)}
    indices = {name[len(_BLOCKS):].split(".", 1)[0] for name in blocks}
    if indices and all(i.isdigit() for i in indices):  # unscanned: one array per block
        return len(indices)
    leading = {shape[0] if shape else None for shape in blocks.values()}
    return leading.pop() if len(leading) == 1 else None


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def abstract_decoder(path: str, model_cfg, shapes: dict[str, tuple[int, ...]], overencoding=None, engram=None):
    """(graphdef, abstract params) of the decoder export.json's config builds (with `overencoding`'s or `engram`'s
    n-gram tables if enabled), refused (one line) unless its layers and then every array's shape are those saved."""
    where = f"{storage.join(path, bundle.META)}'s model config"
    layers = saved_layers(shapes)
    if layers is not None and model_cfg.get("num_layers") != layers:
        raise bundle.BundleError(f"{where} has num_layers={model_cfg.get('num_layers')!r}, but the decoder's files "
                                 f"hold {layers} layers: export.json was altered. Fix: export again into a fresh "
                                 "--output.")
    try:
        graphdef, abstract = nnx.eval_shape(lambda: nnx.split(Decoder(model_cfg, nnx.Rngs(0), overencoding, engram),
                                                              nnx.Param))
    except Exception as e:  # noqa: BLE001 - whatever an altered config makes the model's constructor raise
        raise bundle.BundleError(f"{where} does not build a decoder ({one_line(e, 300)}): export.json was altered. "
                                 "Fix: export again into a fresh --output.") from None
    built = {_name(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    for name in sorted(set(built) | set(shapes)):
        if built.get(name) != shapes.get(name):
            have = f"shape {shapes[name]}" if name in shapes else "no such array"
            wants = f"shape {built[name]}" if name in built else "no such array"
            raise bundle.BundleError(f"{where} builds {name} with {wants}, but the decoder's files hold {have}: the "
                                     "two do not belong together. Fix: export again into a fresh --output.")
    return graphdef, abstract


# tensorstore's words for a file that is not there or does not hold what was written: damage, not a reader's problem.
_DAMAGE = ("NOT_FOUND", "DATA_LOSS", "is missing", "corrupt")


def load_decoder(path: str, model_cfg, mesh, sums: bundle.Checksums, overencoding=None, engram=None):
    """(graphdef, params) of the bundle's decoder (Over-Encoding's or Engram's n-gram tables among them when
    `overencoding` or `engram` is enabled), each parameter restored directly into its sharding, after its files and
    shapes are checked (module docstring)."""
    fix = bundle.rerun_fix(path, f"{bundle.DONE}/{bundle.DECODER}")
    bundle_files.check_tree(path, bundle.DECODER)
    bundle.verify_files(path, sums, bundle.DECODER, fix)
    graphdef, abstract = abstract_decoder(path, model_cfg, saved_shapes(path, sums), overencoding, engram)
    shardings = sharding.state_shardings(abstract, mesh)
    target = sharding.sharded_abstract(abstract, shardings)
    try:
        with bundle.decoder_checkpointer() as restorer:
            params = restorer.restore(storage.join(path, bundle.DECODER), args=ocp.args.StandardRestore(target))
    except Exception as e:  # noqa: BLE001 - orbax's errors vary by what is wrong
        cause = e
        while cause.__cause__ or cause.__context__:  # orbax wraps tensorstore's error, which names the file
            cause = cause.__cause__ or cause.__context__
        where = storage.join(path, bundle.DECODER)
        if any(word in str(cause) for word in _DAMAGE):  # a file missing or corrupt behind a seal that says not
            raise bundle.BundleError(f"The decoder at {where} cannot be restored ({one_line(cause, 300)}). "
                                     f"{fix}") from e
        # Every file matched its CRC-32 above and none is missing: the bundle is sound, so rewriting it repairs
        # nothing (a path or permission this process cannot use, issue 62).
        raise bundle.BundleError(f"The decoder at {where} could not be read here, although its files match their "
                                 f"checksums: {one_line(cause, 300)}. Fix: check that this process can read that "
                                 "directory (path, permissions, storage); the bundle itself needs no repair.") from e
    return graphdef, params
