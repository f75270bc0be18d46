"""docs/quality.md's result tables and its figure, from the study's records alone, in one command:

  python tools/plot_quality.py      # experiments/quality/runs.jsonl -> docs/quality.md's tables, docs/quality.png

Every `<!-- records:NAME -->...<!-- /records -->` block of --markdown is rebuilt from --records (the rows of
each table: scone_jax/study/tables.py's TABLES; `answer`: the page's opening table, scone_jax/study/answer.py;
`finetune`: the fine-tuning comparison of tools/bench_finetune.py, scone_jax/study/finetune_table.py; `all`: every
run); the prose around them stays as written.
The figure plots each table row marked for it, the mean over its seeds, against inference and training FLOPs
(needs matplotlib: the [plot] extra). Prints every plotted arm's seeds and mean.
"""
from __future__ import annotations

from absl import flags

from scone_jax.runtime import tool_main
from scone_jax.study import records, tables

_RECORDS = flags.DEFINE_string("records", records.RECORDS, "The study's records (JSON lines).")
_MARKDOWN = flags.DEFINE_string("markdown", f"{records.REPO}/docs/quality.md",
                                "The page whose records blocks to rebuild ('' = none).")
_PNG = flags.DEFINE_string("png", f"{records.REPO}/docs/quality.png", "The figure to write ('' = none).")


def main():
    tables.rebuild(records.read(_RECORDS.value), _MARKDOWN.value, _PNG.value)


if __name__ == "__main__":
    tool_main.run(main, program="plot_quality")
