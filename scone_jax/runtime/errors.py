"""An exception as one line: what every error message of this package quotes from a library's exception."""
from __future__ import annotations

# Tails that tensorstore and orbax append to their messages: a spec dump, C++ source locations, a pointer.
_TAILS = (" [tensorstore_spec=", " [source locations=", " See full TensorStore details")


def one_line(e: BaseException, limit: int = 400) -> str:
    """The exception's message collapsed onto one line (its type's name if it has none), library tails
    cut, at most `limit` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    for tail in _TAILS:
        text = text.split(tail)[0]
    return text[:limit]
