"""The learning-rate rule of tools/bench_quality.py, apart from its flags so that tests can import it.

`runs` maps "<arm>/lr<rate>" to a finished run's record (its "validation_ppl" and "learning_rate").
"""
from __future__ import annotations


def sweep_stopped(runs: dict, family: str, rate: str, rates: list[str]) -> bool:
    """Whether `family`'s sweep ends before `rate`. Rates are tried in ascending order and the sweep
    stops at the first one whose validation perplexity is above the best of the rates below it:
    validation perplexity is U-shaped in the learning rate, so a rate past the rise costs a run and
    cannot win."""
    best = None
    for r in sorted((r for r in rates if float(r) < float(rate)), key=float):
        run = runs.get(f"{family}/lr{r}")
        if run is None:
            return False  # not decided while a rate below has no result
        if best is not None and run["validation_ppl"] > best:
            return True
        best = run["validation_ppl"] if best is None else min(best, run["validation_ppl"])
    return False


def best_rate(runs: dict, family: str, rates: list[str]) -> float:
    """The rate of `family`'s finished run with the lowest validation perplexity (the lowest rate
    while none has finished)."""
    done = [runs[f"{family}/lr{r}"] for r in rates if f"{family}/lr{r}" in runs]
    if not done:
        return min(float(r) for r in rates)
    return min(done, key=lambda r: r["validation_ppl"])["learning_rate"]
