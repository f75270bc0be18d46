"""The entry point every tools/ script shares: absl flags, no positional arguments, and bad
input (ValueError, OSError: a wrong flag value, missing or unreadable files) as one line on
stderr with exit status 2, the same contract as `python -m scone_jax.main`."""
from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app

EXIT_BAD_INPUT = 2


def main_of(run: Callable[[], None]) -> Callable[[list[str]], None]:
    """An absl `main` that calls `run()` and turns bad input into `error: <one line>`, exit 2."""
    def main(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        try:
            run()
        except (ValueError, OSError) as e:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)

    return main
