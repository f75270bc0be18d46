"""Content checksums of array trees that do not depend on the mesh, the device count or the layout
of the shards: what a checkpoint records when it is saved and checks when it is restored, and what an
export's model fingerprint hashes (serving/bundle.py), so a bundle and the run it came from agree.

Each array's bits are read as unsigned integers and summed as uint32 with position weights.
Integer sums wrap and are associative, so a sharded reduction gives the same value in any order
(a float sum would not), and a moved or flipped element changes the sum. One jitted call covers
the whole tree: one compile per tree structure, one read of every array, one small transfer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_GOLDEN = 2654435761  # odd multiplier (Knuth): consecutive positions get well-spread weights


def _bits(x: jax.Array) -> jax.Array:
    """The array's bit patterns as a flat uint32 vector (8-byte types as two words per element)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    return jax.lax.bitcast_convert_type(x, _UINT[size]).astype(jnp.uint32).ravel()


def _checksum(x: jax.Array) -> jax.Array:
    bits = _bits(x)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(_GOLDEN) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


@jax.jit
def _all_checksums(leaves: list) -> list:
    return [_checksum(x) for x in leaves]


def tree_checksums(tree) -> dict[str, int]:
    """{path: checksum} for every array leaf of `tree` (paths as jax.tree_util.keystr writes them).
    Every process of a multi-process job must call it together (it reduces global arrays)."""
    with_paths = jax.tree_util.tree_leaves_with_path(tree)
    sums = jax.device_get(_all_checksums([leaf for _, leaf in with_paths]))
    return {jax.tree_util.keystr(path): int(s) for (path, _), s in zip(with_paths, sums)}


def first_difference(saved: dict[str, int], now: dict[str, int]) -> str | None:
    """The first path whose checksum differs (or that one side lacks); None if all agree."""
    for path in sorted(set(saved) | set(now)):
        if saved.get(path) != now.get(path):
            return path
    return None
