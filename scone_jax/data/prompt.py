"""How a document starts for the model: the one rule (data.add_bos) that training batches (data/packing.py), f-gram
counting (data/tokenize.model_documents) and every prompt served (serving/generate.py, serving/lm_eval.py,
tools/bench_*.py) follow. With data.add_bos (the default) each document is read as [bos] + ids; without it as its
ids alone, as models trained without a bos (Qwen) read text. Serving takes the flag from the bundle's stored
config (bundles exported before it existed read True, which is what they were trained with)."""
from __future__ import annotations

import numpy as np


def document_bos(tokenizer, add_bos: bool) -> int | None:
    """The id that opens every document, or None without one (data.add_bos=False)."""
    return tokenizer.bos_id if add_bos else None


def start_id(tokenizer, add_bos: bool) -> int:
    """What a model reads before an empty text (the harness's prefix for an empty context, a prompt of no
    tokens): bos, or without one eos, the end of a previous document (the harness's own fallback for Hugging
    Face models without a bos)."""
    return tokenizer.bos_id if add_bos else tokenizer.eos_id


def prompt_ids(tokenizer, text: str, add_bos: bool) -> np.ndarray:
    """`text` as a model reads it from a document's start, int32: [bos] + its ids, or its ids alone (never
    empty: an empty text without bos is [start_id])."""
    ids = [int(i) for i in tokenizer.encode(text)]
    if add_bos or not ids:
        ids = [start_id(tokenizer, add_bos)] + ids
    return np.asarray(ids, np.int32)
