"""docs/quality.md's result tables and its figure, from the study's records alone:

  python tools/plot_quality.py      # experiments/quality/runs.jsonl -> docs/quality.md's tables, docs/quality.png

Every `<!-- records:NAME -->...<!-- /records -->` block of --markdown is rebuilt from --records (the rows of
each table: quality_records.TABLES; `all`: every run); the prose around them stays as written. The figure
plots each table row marked for it, the mean over its seeds, against inference and training FLOPs (needs
matplotlib: the [plot] extra). Prints every plotted arm's seeds and mean.
"""
from __future__ import annotations

import os

from absl import flags

import quality_records
from quality_figure import plot
from scone_jax.runtime import tool_main

_RECORDS = flags.DEFINE_string("records", quality_records.RECORDS, "The study's records (JSON lines).")
_MARKDOWN = flags.DEFINE_string("markdown", f"{quality_records.REPO}/docs/quality.md",
                                "The page whose records blocks to rebuild ('' = none).")
_PNG = flags.DEFINE_string("png", f"{quality_records.REPO}/docs/quality.png", "The figure to write ('' = none).")


def main():
    records = quality_records.read(_RECORDS.value)
    if _MARKDOWN.value:
        with open(_MARKDOWN.value) as f:
            text = f.read()
        filled = quality_records.fill(text, records)
        with open(_MARKDOWN.value + ".tmp", "w") as f:
            f.write(filled)
        os.replace(_MARKDOWN.value + ".tmp", _MARKDOWN.value)
        print(f"tables: {_MARKDOWN.value}" + ("" if filled != text else " (unchanged)"))
    if _PNG.value:
        sets = quality_records.figure_sets(records)
        for label, arms in sets.items():
            for arm, r in sorted(arms.items()):
                print(f"{label or 'study'}: {arm} {r['tokens'] / 1e6:.0f}M lr {r['learning_rate']:g}: "
                      f"mean test {r['test_ppl']:.2f}")
        main_arms = sets.pop("", {})
        if not plot({"arms": main_arms}, _PNG.value, sets):
            raise ValueError("plotting needs matplotlib. Fix: pip install -e '.[plot]'")
        print(f"plot: {_PNG.value}")


if __name__ == "__main__":
    tool_main.run(main, program="plot_quality")
