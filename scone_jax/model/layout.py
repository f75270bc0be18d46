"""Moving a state between the two block layouts of BlockStack (transformer.py).

Scanned (model.scan_layers=True, the default): one entry per parameter, stacked along a
leading 'layers' axis, at paths like (..., 'blocks', 'attn', 'query', 'kernel').
Unscanned: one entry per layer, at (..., 'blocks', i, 'attn', 'query', 'kernel').
The same holds for every optimizer slot that mirrors the parameters (Adam's mu and nu).
Checkpoints and exports record the layout they were written in (the config's
model.scan_layers), so a run can resume or serve either kind (scan_layers=False is for
debugging): restore in the saved layout, then `convert` to the run's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

BLOCKS = "blocks"


def _layer_index(path: tuple) -> int | None:
    """Position of the layer number in an unscanned path, or None."""
    for i, key in enumerate(path[:-1]):
        if key == BLOCKS and isinstance(path[i + 1], int):
            return i + 1
    return None


def convert(state: nnx.State, target: nnx.State) -> nnx.State:
    """`state`'s values in the structure of `target` (a state of the same model in the other,
    or the same, layout; its values are only read for their shapes). Raises ValueError naming
    the first path that has no counterpart."""
    source = dict(nnx.to_flat_state(state))
    stacked: dict[tuple, dict[int, jax.Array]] = {}
    for path, variable in source.items():
        at = _layer_index(path)
        if at is not None:
            stacked.setdefault(path[:at] + path[at + 1:], {})[path[at]] = variable.get_value()
    out = []
    for path, variable in nnx.to_flat_state(target):
        at = _layer_index(path)
        if path in source:
            value = source[path].get_value()
        elif at is None and path in stacked:  # unscanned -> scanned
            layers = stacked[path]
            value = jnp.stack([layers[i] for i in range(len(layers))])
        elif at is not None and path[:at] + path[at + 1:] in source:  # scanned -> unscanned
            value = source[path[:at] + path[at + 1:]].get_value()[path[at]]
        else:
            raise ValueError(f"The saved state has nothing for {'/'.join(map(str, path))}: it belongs to "
                             "another model. Use the config it was saved with.")
        want = variable.get_value()
        if value.shape != want.shape:
            raise ValueError(f"{'/'.join(map(str, path))} has shape {value.shape} in the saved state but "
                             f"{want.shape} in this model. Use the config it was saved with.")
        out.append((path, variable.replace(value)))
    return nnx.from_flat_state(out)


def is_scanned(saved_config: dict) -> bool:
    """The layout a checkpoint or export was written in, from its saved config (model.scan_layers)."""
    return bool(saved_config["model"]["scan_layers"])
