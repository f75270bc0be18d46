"""Console logging for our CLIs: our INFO lines, and only warnings from the libraries.

orbax and grain log every save, restore and worker step at INFO through absl; a user
watching training or an export wants our progress lines. `--verbosity=1` shows everything.
"""
from __future__ import annotations

import logging as std_logging

from absl import logging


class _QuietLibraries(std_logging.Filter):
    def filter(self, record):
        return record.levelno >= std_logging.WARNING or "/scone_jax/" in record.pathname


def quiet_libraries() -> None:
    """Call at the top of a CLI's main (after flag parsing)."""
    if logging.get_verbosity() <= logging.INFO:
        logging.get_absl_handler().addFilter(_QuietLibraries())
