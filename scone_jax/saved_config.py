"""A config read back from what a run or an export saved (a checkpoint's metadata, a workdir's config.json,
an export's export.json), over today's defaults: runs and bundles both read configs this way."""
from __future__ import annotations

import ml_collections

from scone_jax import config as config_lib, config_keys


def stored_config(saved: dict) -> ml_collections.ConfigDict:
    """`saved` over base_config(): keys added to the code since it was saved take their defaults; a key the
    code does not know is a ValueError (the config came from another version). The data shorthand it may hold
    is resolved into its groups (config.resolve), as today's runs save it."""
    config = config_lib.base_config()

    def merge(node, values, where):
        for key, value in values.items():
            if key not in node:
                raise ValueError(f"The saved config has {where}{key}, which this code does not know; "
                                 "use the scone_jax version that wrote it.")
            if isinstance(value, dict) and f"{where}{key}" not in config_keys.GROUPS:
                merge(node[key], value, f"{where}{key}.")
            else:
                node[key] = value

    merge(config, saved, "")
    return config_lib.resolve(config)
