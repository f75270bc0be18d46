"""The plot of docs/quality.md, from the study's result files: each arm's test perplexity is the mean over
the files (seeds) that hold it, so the figure is rebuilt from the repository alone.

  python tools/plot_quality.py --png=docs/quality.png \\
      --runs=docs/quality_results.json:baseline,baseline_2x --runs=docs/quality_results_seed1.json:baseline \\
      --runs='docs/quality_results_3m_delay.json@f-gram updates delayed'

--runs=FILE[:KEY,...][@LABEL], repeated: FILE is a --record file of tools/bench_quality.py; each KEY is an arm
of its "arms" (the run the protocol chose) or a run key "<arm>/lr<rate>" of its "runs"; no KEYs: every arm.
An arm given by several --runs of one label is the mean of their runs, which must share a token budget and a
learning rate (seeds of one protocol); a label's arms are drawn dashed beside the unlabelled ones. Prints
every arm's values and mean. Needs matplotlib (the [plot] extra).
"""
from __future__ import annotations

import json
import statistics

from absl import flags

from quality_figure import plot
from scone_jax.runtime import tool_main

_RUNS = flags.DEFINE_multi_string("runs", [], "FILE[:KEY,...][@LABEL]: the runs of a results file to plot "
                                  "(KEY: an arm, or a run key <arm>/lr<rate>); repeat for seeds and other files.")
_PNG = flags.DEFINE_string("png", None, "The figure to write (a .png path).")


def parse_spec(spec: str) -> tuple[str, list[str], str]:
    """'FILE[:KEY,...][@LABEL]' -> (file, keys, label)."""
    body, _, label = spec.partition("@")
    path, _, keys = body.partition(":")
    return path, [k for k in keys.split(",") if k], label.strip()


def select(results: dict, keys: list[str], path: str) -> dict[str, dict]:
    """arm -> run record of `results` (a bench_quality results file) for `keys` (all its arms if none)."""
    if not keys:
        return dict(results["arms"])
    out = {}
    for key in keys:
        run = results["runs"].get(key) if "/lr" in key else results["arms"].get(key)
        if run is None:
            raise ValueError(f"{path} holds no {'run' if '/lr' in key else 'arm'} {key!r}; it has the arms "
                             f"{sorted(results['arms'])} and the runs {sorted(results['runs'])}.")
        out[run["arm"]] = run
    return out


def gather(selections: list[tuple[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """label -> arm -> the mean record of that arm's runs under that label (test and validation perplexity
    averaged; "test_ppl_each" lists the runs'). Runs of one arm with another token budget or learning rate
    are not seeds of one protocol: refused, naming both."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for label, arms in selections:
        for arm, run in arms.items():
            grouped.setdefault(label, {}).setdefault(arm, []).append(run)
    out: dict[str, dict[str, dict]] = {}
    for label, arms in grouped.items():
        for arm, runs in arms.items():
            for field in ("tokens", "learning_rate"):
                if len({r[field] for r in runs}) > 1:
                    raise ValueError(f"The runs of {arm!r}{f' ({label})' if label else ''} differ in {field} "
                                     f"({sorted({r[field] for r in runs})}): only seeds of one protocol average. "
                                     "Fix: give them different @LABELs.")
            mean = dict(runs[0])
            mean["test_ppl_each"] = [r["test_ppl"] for r in runs]
            mean["test_ppl"] = statistics.mean(mean["test_ppl_each"])
            mean["validation_ppl"] = statistics.mean(r["validation_ppl"] for r in runs)
            out.setdefault(label, {})[arm] = mean
    return out


def main():
    tool_main.require(runs=_RUNS.value, png=_PNG.value)
    selections = []
    for spec in _RUNS.value:
        path, keys, label = parse_spec(spec)
        with open(path) as f:
            selections.append((label, select(json.load(f), keys, path)))
    sets = gather(selections)
    for label, arms in sets.items():
        for arm, r in sorted(arms.items()):
            each = ", ".join(f"{v:.2f}" for v in r["test_ppl_each"])
            print(f"{label or 'study'}: {arm} {r['tokens'] / 1e6:.0f}M lr {r['learning_rate']:g}: test {each} "
                  f"(mean {r['test_ppl']:.2f})")
    main_arms = sets.pop("", {})
    if not plot({"arms": main_arms}, _PNG.value, sets):
        raise ValueError("plotting needs matplotlib. Fix: pip install -e '.[plot]'")
    print(f"plot: {_PNG.value}")


if __name__ == "__main__":
    tool_main.run(main, program="plot_quality")
