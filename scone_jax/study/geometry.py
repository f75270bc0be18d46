"""How a set of embedding rows is spread: their mean norm, and how much they share one direction. The measure
of the f-gram rows' collapse (docs/quality.md, "Why the trends do not appear"), read by tools/embedding_scale.py
on an export's table and by tools/trace_steps.py on each step's f-gram rows."""
from __future__ import annotations

import numpy as np


def mean_norm(x: np.ndarray) -> float:
    """Mean L2 norm of the rows of `x` [N, d]."""
    return float(np.linalg.norm(x, axis=1).mean())


def alignment(x: np.ndarray) -> float:
    """Norm of the mean unit row: 1 when all rows point the same way, about 1/sqrt(N) for unrelated
    directions; rows of zero norm are left out."""
    norms = np.linalg.norm(x, axis=1)
    unit = x[norms > 0] / norms[norms > 0, None]
    return float(np.linalg.norm(unit.mean(axis=0)))
