"""The quality study's learning-rate rule and arm names (tools/bench_quality.py).

`runs` maps "<arm>/lr<rate>" to a finished run's record (its "validation_ppl" and "learning_rate").
"""
from __future__ import annotations

SHORT_ARMS = ("baseline_short", "scone_short")  # the 1x models at --ablation_tokens


def variant(arm: str) -> str:
    """The configs/quality.py variant an arm trains (a _short arm: its 1x model)."""
    return arm[:-len("_short")] if arm in SHORT_ARMS else arm


def without_short_arms(arms: list[str]) -> list[str]:
    """With --ablation_tokens equal to --tokens a _short arm is its 1x arm: that arm runs in its place, once
    (it used to be dropped without a word, so `--arms=baseline_short,...` silently trained no baseline)."""
    out = []
    for arm in arms:
        if arm in SHORT_ARMS and variant(arm) not in arms:
            print(f"{arm}: --ablation_tokens equals --tokens, so it is {variant(arm)}, which runs instead", flush=True)
        if variant(arm) not in out:
            out.append(variant(arm))
    return out


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


def family(arm: str) -> str:
    """The swept arm whose learning rate `arm` trains at: SCONE's, Over-Encoding's (oe*), Engram's or the
    baseline's."""
    return next((f for f in ("scone", "oe", "engram") if arm.startswith(f)), "baseline")


def planned_keys(planned: list[tuple[str, str | None]], runs: dict, rates: list[str]) -> list[str]:
    """"<arm>/lr<rate>" of every planned run, for progress and ETA. A rate not yet resolved (None: the family's
    sweep decides it) is the family's best so far, so a run finished by an earlier invocation counts as done
    (it used to count as left whatever its state: "0/4 runs done, 12.0M tokens left" with two of four done)."""
    return [f"{arm}/lr{rate if rate is not None else best_rate(runs, family(arm), rates)}" for arm, rate in planned]
