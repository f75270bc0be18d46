"""Plain-Python references for the f-gram tests: straight from docs/method.md §1 and §2, no cleverness."""
from collections import Counter

import numpy as np


def reference_fgrams(docs, max_len, num_fgrams, min_count):
    """Rule 1: K-1 scans with prefix/suffix pruning, min_count, one ranking; returns [(gram, count)]."""
    kept, frequent = {}, set()
    for n in range(2, max_len + 1):
        counts = Counter()
        for doc in docs:
            doc = [int(t) for t in doc]
            for i in range(len(doc) - n + 1):
                gram = tuple(doc[i : i + n])
                if n > 2 and (gram[:-1] not in frequent or gram[1:] not in frequent):
                    continue
                counts[gram] += 1
        frequent = {g for g, c in counts.items() if c >= min_count}
        kept.update((g, counts[g]) for g in frequent)
    return sorted(kept.items(), key=lambda gc: (-gc[1], len(gc[0]), gc[0]))[:num_fgrams]


def reference_match(fgrams, tokens, segment_ids, max_len):
    """Rule 2: id of the longest f-gram ending at each position inside its segment, else -1."""
    ids = {tuple(g): i for i, g in enumerate(fgrams)}
    out = np.full(tokens.shape, -1, np.int32)
    for b in range(tokens.shape[0]):
        for i in range(tokens.shape[1]):
            if segment_ids[b, i] == 0:
                continue
            for n in range(2, max_len + 1):
                j = i - n + 1
                if j < 0 or any(segment_ids[b, k] != segment_ids[b, i] for k in range(j, i)):
                    break
                gram = tuple(int(t) for t in tokens[b, j : i + 1])
                if gram in ids:
                    out[b, i] = ids[gram]
    return out


def zipf_docs(rng, num_docs, vocab_size, max_doc_len, exponent=1.2):
    """Documents of Zipf-distributed tokens: heavy repetition, like text."""
    docs = []
    for _ in range(num_docs):
        length = int(rng.integers(0, max_doc_len + 1))
        docs.append(np.minimum(rng.zipf(exponent, size=length) - 1, vocab_size - 1).astype(np.int32))
    return docs


def planted_docs(rng, num_docs, vocab_size, max_doc_len, phrases, rate=0.3):
    """Uniform random tokens with `phrases` pasted in at random places (so long n-grams repeat)."""
    docs = []
    for _ in range(num_docs):
        doc = list(rng.integers(0, vocab_size, size=int(rng.integers(0, max_doc_len + 1))))
        for _ in range(int(rate * len(doc) / 4)):
            at = int(rng.integers(0, len(doc) + 1))
            doc[at:at] = list(phrases[int(rng.integers(len(phrases)))])
        docs.append(np.asarray(doc, np.int32))
    return docs


def test_reference_fgrams_by_hand():
    # "a b c" 3x and "a b" once more: ab=4, bc=3, abc=3; "b c d" once, pruned at min_count 3.
    docs = [[0, 1, 2]] * 3 + [[0, 1], [1, 2, 3]]
    assert reference_fgrams(docs, 3, 10, 3) == [((0, 1), 4), ((1, 2), 4), ((0, 1, 2), 3)]
    assert reference_fgrams(docs, 3, 2, 3) == [((0, 1), 4), ((1, 2), 4)]


def test_reference_match_by_hand():
    fgrams = [(0, 1), (1, 2), (0, 1, 2)]
    tokens = np.array([[0, 1, 2, 0, 1, 2]])
    segments = np.array([[1, 1, 1, 2, 2, 0]])
    assert reference_match(fgrams, tokens, segments, 3).tolist() == [[-1, 0, 2, -1, 0, -1]]
