"""A config read back from what a run or an export saved (a checkpoint's metadata, a workdir's config.json,
an export's export.json), over today's defaults: runs and bundles both read configs this way.

A key the code does not know is one of two things. A run's config file could set undeclared keys (a typo,
`c.model.num_layrs = 2`) until config.check_declared refused them; nothing read them, so that run trained with
the defaults, and its checkpoints still export: the key is dropped with a one-line note. Any other unknown key
was declared by another scone_jax version, which may have trained with it: refused, naming it. Checkpoints
saved since the check carry DECLARED_ONLY in their metadata (training/run.py), so an unknown key in them is
always the other version's; an export's config is the stored one (undeclared keys already dropped).
"""
from __future__ import annotations

import ml_collections
from absl import logging

from scone_jax import config as config_lib, config_keys

# Metadata flag of a checkpoint whose config held declared keys only (config.validate refused the others).
DECLARED_ONLY = "config_keys_declared_only"


def stored_config(saved: dict, *, typos_possible: bool = False) -> ml_collections.ConfigDict:
    """`saved` over base_config(): keys added to the code since it was saved take their defaults; a key the
    code does not know is a ValueError (the config came from another version), unless `typos_possible` (a run
    saved before undeclared keys were refused: run_config): then it is dropped with one note naming it. The data
    shorthand it may hold is resolved into its groups (config.resolve), as today's runs save it."""
    config = config_lib.base_config()
    dropped = []

    def merge(node, values, where):
        for key, value in values.items():
            if key not in node:
                if typos_possible:
                    dropped.append(f"{where}{key}")
                    continue
                raise ValueError(f"The saved config has {where}{key}, which this code does not know; "
                                 "use the scone_jax version that wrote it.")
            if isinstance(value, dict) and f"{where}{key}" not in config_keys.GROUPS:
                merge(node[key], value, f"{where}{key}.")
            else:
                node[key] = value

    merge(config, saved, "")
    if dropped:
        logging.warning("Note: the run's config sets %s, which no scone_jax key declares (a misspelling its config "
                        "file made before such keys were refused): the run never read it and trained with the "
                        "defaults; ignored.", ", ".join(dropped))
    return config_lib.resolve(config)


def run_config(meta: dict) -> ml_collections.ConfigDict:
    """The config of a checkpoint from its metadata (stored_config), unknown keys noted and dropped if it was
    saved before undeclared keys were refused (no DECLARED_ONLY flag), refused otherwise."""
    return stored_config(meta["config"], typos_possible=not meta.get(DECLARED_ONLY, False))
