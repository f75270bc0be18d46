"""The entry point every program but the training job shares (tools/ scripts and the serving programs):
absl flags, no positional arguments, and bad input (ValueError, OSError: a wrong flag value, missing or
unreadable files; a job that could not start) as one line on stderr with exit status 2, the same contract as
`python -m scone_jax.main`."""
from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app

from scone_jax.runtime.errors import one_line

EXIT_BAD_INPUT = 2
BAD_INPUT = (ValueError, OSError)


def main_of(run: Callable[[], None], program: str = "", errors: tuple[type[BaseException], ...] = BAD_INPUT
            ) -> Callable[[list[str]], None]:
    """An absl `main` that calls `run()` and turns `errors` into `[program: ]error: <one line>`, exit 2."""
    prefix = f"{program}: error: " if program else "error: "

    def main(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        try:
            run()
        except errors as e:
            print(prefix + one_line(e, limit=4000), file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)

    return main


def require(**flag_values) -> None:
    """ValueError naming every flag among `flag_values` (name -> parsed value) that was not passed."""
    missing = [name for name, value in flag_values.items() if not value]
    if missing:
        raise ValueError("pass " + " and ".join(f"--{name}" for name in missing))
