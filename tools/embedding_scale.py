"""How large an export's f-gram rows are next to the token embeddings they replace.

  python tools/embedding_scale.py --export=/data/quality/scone/lr0.001/export [--export=...]

A matched position's input is the f-gram row instead of T(token) (docs/method.md §3). The f-gram
model ends in its block stack's final norm (§4), so its rows have a norm of about sqrt(d) times the
norm's scale, while T's rows start at init_std * sqrt(d) and grow as they train. The token rows
are measured as the decoder reads them: times model.embedding_multiplier (1 in the method).
docs/quality.md reads the ratio for the study's arms. For each export (named by its two parent
directories, e.g. `scone/lr0.001`), over all S table rows and all vocabulary rows of T, mean L2 norms:
  RESULT fgram_row_norm_<name>, RESULT token_row_norm_<name>, RESULT fgram_over_token_<name>
and how much the rows share one direction (alignment: the norm of the mean of the unit rows; 1 = every row
points the same way, about 1/sqrt(rows) for unrelated directions), the measure of the f-gram rows' collapse
that docs/quality.md describes:
  RESULT fgram_row_alignment_<name>, RESULT token_row_alignment_<name>
A decoder-only export (a baseline) has no f-gram rows: only its token figures are printed.
"""
import os

import numpy as np
from absl import flags

from scone_jax.runtime import tool_main
from scone_jax.study.geometry import alignment, mean_norm

_EXPORTS = flags.DEFINE_multi_string("export", [], "An export directory (scone_jax.serving.export); repeatable.")


def export_name(path: str) -> str:
    parts = os.path.normpath(path).split(os.sep)
    return "/".join(parts[-3:-1]) if len(parts) >= 3 else parts[-1]


def rows(path: str) -> tuple[np.ndarray | None, np.ndarray]:
    """(the f-gram table's rows [S, d], None for a decoder-only export; the token embedding's rows as decoder
    input [V, d], i.e. times model.embedding_multiplier) of one export, in float32."""
    from scone_jax.serving import inference

    served = inference.load(path)
    token = np.asarray(served.params["token_embed"]["embedding"][...], np.float32) * served.config.model.embedding_multiplier
    if served.table.num_rows == 0:
        return None, token
    return np.asarray(served.table.gather(np.arange(served.table.num_rows)), np.float32), token


def main():
    if not _EXPORTS.value:
        raise ValueError("Name at least one --export=DIR (an export bundle of a SCONE run).")
    for path in _EXPORTS.value:
        fgram, token = rows(path)
        name = export_name(path)
        figures = [("token_row_norm", mean_norm(token)), ("token_row_alignment", alignment(token))]
        if fgram is None:
            print(f"{name}: decoder-only export (no f-gram rows), token rows {mean_norm(token):.3f}")
        else:
            ratio = mean_norm(fgram) / mean_norm(token)
            print(f"{name}: f-gram rows {mean_norm(fgram):.3f} (alignment {alignment(fgram):.3f}), token rows "
                  f"{mean_norm(token):.3f} (alignment {alignment(token):.3f}), ratio {ratio:.2f}")
            figures += [("fgram_row_norm", mean_norm(fgram)), ("fgram_row_alignment", alignment(fgram)),
                        ("fgram_over_token", ratio)]
        for figure, value in figures:
            print(f"RESULT {figure}_{name} {value:.4f}")


if __name__ == "__main__":
    tool_main.run(main, "embedding_scale")
