"""Exact-match scoring of generated answers, and pass@k over n samples per prompt (serving/generate_batch.py).

The normaliser (`normalize`): Unicode NFKC, case folded, every run of whitespace one space, and punctuation
and symbols (Unicode categories P* and S*) stripped from both ends, repeatedly, with the whitespace they
leave: "  The LORD.\n" and "the lord" match, "the Lord's" and "the lords" do not (inner characters stay). A
sample is correct when its normalised text (up to its stop token) equals a reference answer's.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n samples of which c are
correct, the chance that k drawn without replacement hold a correct one, 1 - C(n - c, k) / C(n, k), averaged
over prompts; pass@1 is the mean of c / n. It needs k <= n.
"""
from __future__ import annotations

import unicodedata


def normalize(text: str) -> str:
    """`text` as the scorer compares it (module docstring)."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    start, end = 0, len(text)
    while start < end and (text[start].isspace() or unicodedata.category(text[start])[0] in "PS"):
        start += 1
    while end > start and (text[end - 1].isspace() or unicodedata.category(text[end - 1])[0] in "PS"):
        end -= 1
    return text[start:end]


def is_correct(text: str, answers) -> bool:
    """Whether `text` matches one of `answers` (a string or a list of them) after normalisation."""
    answers = [answers] if isinstance(answers, str) else answers
    return normalize(text) in {normalize(a) for a in answers}


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of them correct, hold a correct one; computed
    as a product, exact for any n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} of {c} correct among {n} samples is not defined. Fix: 1 <= k <= n.")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def summary(correct: dict, ks) -> dict:
    """{prompts, samples, pass@k for each k of `ks` (those <= the samples per prompt)}, `correct` mapping each
    scored prompt to its samples' booleans (each prompt the same number)."""
    counts = [(len(v), sum(v)) for v in correct.values()]
    out = {"prompts": len(counts), "samples_per_prompt": counts[0][0] if counts else 0}
    for k in ks:
        if counts and k <= counts[0][0]:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
    return out
