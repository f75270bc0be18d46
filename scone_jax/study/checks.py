"""The quality study's checks (tools/bench_quality.py) before anything trains: splits that share a document, finished runs trained
with other settings than this invocation's, and the size of the training split (for the epochs check)."""
from __future__ import annotations

import hashlib
import os

import numpy as np

from scone_jax.config import resume_changes
from scone_jax.data import documents, sources
from scone_jax.runtime import workdir as workdir_layout
from scone_jax.study.runs import read_json


def document_hashes(data_cfg, split: str) -> set[str]:
    source = sources.open_source(data_cfg, split)
    out = set()
    for i in range(len(source)):
        doc = source[i]
        out.add(hashlib.sha1(doc.encode() if isinstance(doc, str) else np.asarray(doc, "<i4").tobytes()).hexdigest())
    return out


def check_splits(config, test_files: str) -> None:
    """Refuse splits that share a document (by content), naming the pair and the count."""
    d = config.data
    hashes = {"train": document_hashes(d, "train")}
    for name, files in (("validation", d.eval_files), ("test", test_files)):
        held = config.data.copy_and_resolve_references()
        held.eval_files = files
        hashes[name] = document_hashes(held, "eval")
    names = list(hashes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = len(hashes[a] & hashes[b])
            if shared:
                raise ValueError(f"The {a} and {b} splits share {shared} documents (by content): perplexity on a split "
                                 "the model trained on means nothing. Fix: split the corpus by document "
                                 "(tools/split_corpus.py does, by a hash of each file's path).")


def check_finished_runs(study: "Study", tokenizer) -> None:
    """Refuse to reuse a finished run of this invocation's arms that was trained with other settings than
    this invocation would train it with (a changed --config.KEY=VALUE, --tokens or configs/quality.py): its
    results would silently join a table of runs that differ in more than the arm. Compared: the keys a
    checkpoint must match to resume (config.RESUME_KEYS, but the training files' path: moved files are
    the same corpus) and the step count, against the run's own WORKDIR/<arm>/lr<rate>/config.json."""
    for key, record in sorted(study.results["runs"].items()):
        arm, rate = record["arm"], key.split("/lr", 1)[1]
        if arm not in study.arms:
            continue
        saved = read_json(os.path.join(study.run_dir(arm, rate), workdir_layout.CONFIG))
        if saved is None:
            continue
        extra = {"scone.fgram_capacity": record["fgram_capacity"]} if record["fgram_capacity"] else {}
        config = study.config(arm, rate, extra, tokenizer)
        changes = [c for c in resume_changes(saved, config) if not c.startswith("data.train_files:")]
        if saved["train"]["num_steps"] != config.train.num_steps:
            changes.append(f"train.num_steps: {saved['train']['num_steps']} -> {config.train.num_steps}")
        if changes:
            raise ValueError(f"{key} in {study.root} is finished but was trained with other settings than this "
                             f"invocation's (trained -> now: {'; '.join(changes)}). Fix: use a new --workdir for "
                             "the new settings, or pass the old ones (e.g. --config.KEY=VALUE, --tokens) to "
                             "continue that study.")


def train_positions(config, tokenizer) -> int:
    """Positions one pass over the training split gives: sum of (tokens + 1) over its documents."""
    docs = documents.load(config.data, "train", tokenizer, np.arange)
    return int(docs.lengths.sum()) + len(docs.lengths)
