"""Console logging for our CLIs: our INFO lines, and only warnings from the libraries.

orbax and grain log every save, restore and worker step at INFO through absl; a user
watching training or an export wants our progress lines. `--verbosity=1` shows everything.
"""
from __future__ import annotations

import logging as std_logging
import sys

from absl import logging

# grain's worker processes hand batches over in shared memory; the few still in flight when a
# run closes its pipeline are freed by multiprocessing's resource tracker, which then warns
# "resource_tracker: There appear to be N leaked shared_memory objects to clean up at
# shutdown". Nothing is lost or leaked; the tracker process takes its warning filters from
# sys.warnoptions when it starts (before the first worker), so this keeps our CLIs' ends quiet.
_TRACKER_WARNING = "ignore:resource_tracker:UserWarning"


class _QuietLibraries(std_logging.Filter):
    def filter(self, record):
        return record.levelno >= std_logging.WARNING or "/scone_jax/" in record.pathname


def quiet_libraries() -> None:
    """Call at the top of a CLI's main (after flag parsing)."""
    if _TRACKER_WARNING not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_WARNING)
    if logging.get_verbosity() <= logging.INFO:
        logging.get_absl_handler().addFilter(_QuietLibraries())
