"""Device mesh (data, fsdp, tensor) and the one table mapping logical axis names onto it."""
from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Batch rows spread over data and fsdp; FSDP shards the model
# width of every matrix; tensor parallelism splits heads, MLP width and vocabulary.
LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),  # stacked blocks (scan): every device holds its share of every layer
)

BATCH_AXES = ("data", "fsdp")


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
    """Resolve the config's axis sizes; exactly one may be -1 ("all remaining devices")."""
    sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"At most one mesh axis may be -1, got (data, fsdp, tensor) = {tuple(sizes)}.")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or num_devices % known:
        raise ValueError(
            f"Mesh (data, fsdp, tensor) = {tuple(sizes)} does not divide the {num_devices} devices; "
            "set config.mesh.* so their product is the device count (use -1 for one axis)."
        )
    sizes = [num_devices // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"Mesh (data, fsdp, tensor) = {tuple(sizes)} uses {math.prod(sizes)} devices but "
            f"{num_devices} are present; set config.mesh.* to match (use -1 for one axis)."
        )
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh_cfg, len(devices))
    grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(names) -> P:
    rules = dict(LOGICAL_RULES)
    unknown = [n for n in names if n is not None and n not in rules]
    if unknown:
        raise ValueError(f"Logical axis names {unknown} have no rule in sharding.LOGICAL_RULES.")
    return P(*(rules[n] if n is not None else None for n in names))


def constrain(x: jax.Array, logical_names: tuple) -> jax.Array:
    """Pin an activation's layout (e.g. ('batch', None, None)) when traced under a mesh with our
    axes; a no-op otherwise, so models also run un-sharded in tests and tools."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_names))


def map_batch_shards(fn, *args):
    """fn applied to each device's block of rows: dimension 0 of every argument and of the
    result is split over the batch axes (data, fsdp), everything else replicated. Under a mesh
    with our axes this is a jax.shard_map, so fn's work (e.g. a gather inside a data shard)
    stays local by construction and the partitioner has nothing to work out; without one,
    just fn(*args) (unsharded tests and tools)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) or mesh.manual_axes:
        return fn(*args)
    spec = P(BATCH_AXES)
    return jax.shard_map(fn, in_specs=(spec,) * len(args), out_specs=spec, axis_names=set(MESH_AXES),
                         check_vma=False)(*args)


def _variable_sharding(variable: nnx.Variable, mesh: Mesh) -> nnx.Variable:
    names = variable.get_metadata().get("out_sharding")
    spec = logical_to_spec(names) if names else P()
    shape = variable.get_value().shape
    for dim, axes in zip(shape, spec):
        size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        if dim % size:
            raise ValueError(
                f"A parameter dimension of size {dim} (logical axes {names}) does not divide over "
                f"mesh axes {axes} of size {size}; change config.mesh or the model width."
            )
    return variable.replace(NamedSharding(mesh, spec))


def state_shardings(abstract_state, mesh: Mesh):
    """NamedShardings for an (abstract) nnx.State, with the same tree structure."""
    return jax.tree.map(
        lambda v: _variable_sharding(v, mesh),
        abstract_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def sharded_abstract(abstract, shardings):
    """ShapeDtypeStructs of `abstract` carrying `shardings` (the same tree): a target to restore or lower into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def under_mesh(mesh: Mesh, jitted):
    """`jitted`, called and lowered (.lower) under `mesh` (jax.set_mesh) so activation constraints (constrain)
    apply when it is traced."""
    def call(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    def lower(*args):
        with jax.set_mesh(mesh):
            return jitted.lower(*args)

    call.lower = lower
    return call


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over (data, fsdp), other dimensions replicated, for an array of any rank: one sharding serves
    every array of a batch (and a jitted step's in_shardings for the whole Batch)."""
    return NamedSharding(mesh, P(BATCH_AXES))


def num_batch_shards(mesh: Mesh) -> int:
    """How many blocks a global batch splits into along its rows (one per data shard)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def global_batch(local_batch, mesh: Mesh):
    """This process's numpy batch (a scone_jax/batch.py Batch, or any tree of arrays) as global jax.Arrays sharded
    by rows over the mesh; the transfers start now (asynchronously)."""
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(batch_sharding(mesh), v),
                        local_batch)
