"""A config read back from what a run or an export saved (a checkpoint's metadata, a workdir's config.json,
an export's export.json), over today's defaults: runs and bundles both read configs this way."""
from __future__ import annotations

import ml_collections

from scone_jax import config as config_lib


def stored_config(saved: dict) -> ml_collections.ConfigDict:
    """`saved` over base_config(): keys added to the code since it was saved take their defaults; a key the
    code does not know is a ValueError (the config came from another version)."""
    config = config_lib.base_config()

    def merge(node, values, where):
        for key, value in values.items():
            if key not in node:
                raise ValueError(f"The saved config has {where}{key}, which this code does not know; "
                                 "use the scone_jax version that wrote it.")
            if isinstance(value, dict):
                merge(node[key], value, f"{where}{key}.")
            else:
                node[key] = value

    merge(config, saved, "")
    return config
