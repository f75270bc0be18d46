"""The export's f-gram files, checked before vLLM serves a token: each problem is one line naming it and the fix."""
from __future__ import annotations

import json
import os

from scone_jax.hf.remote_code.scone_fgrams import Fgrams, SconeExportError


def open_export(directory: str, tokenizer: str | None = None) -> Fgrams:
    """The table and matcher of the export `directory` (config.json's fgrams section), refused in one line when a
    file is missing, damaged or belongs to another export."""
    with open(os.path.join(directory, "config.json")) as f:
        section = json.load(f).get("fgrams")
    return Fgrams(directory, section)
