"""What the training documents are, for checkpoints to compare on resume: a changed corpus would be a
different data stream under the same batch numbers."""
from __future__ import annotations

import os

from scone_jax.data import local_cache, mixture, sources


def train_data_identity(data_cfg) -> dict:
    """{file: [size, CRC-32 of all its bytes]} of every file the training globs match (text, JSONL, .gz/.zst
    archives, pre-tokenized shards alike), so a change anywhere in a file is seen, in the middle as at the
    ends. No modification times: a corpus copied to a new machine unchanged still resumes. A large file is
    read once per content on a host (local_cache.file_id keeps its CRC). The embedded corpus has none ({})."""
    if data_cfg.source == "kjv":
        return {}
    return {os.path.abspath(path): list(local_cache.file_id(path))
            for path in sources.expand_files(mixture.all_files(data_cfg))}


def identity_changes(saved: dict, now: dict) -> list[str]:
    """The differences between two train_data_identity results, one phrase each (empty: the same data)."""
    changes = [f"{p} is new" for p in sorted(set(now) - set(saved))]
    changes += [f"{p} is gone" for p in sorted(set(saved) - set(now))]
    for p in sorted(set(saved) & set(now)):
        if list(saved[p]) != list(now[p]):
            (size0, id0), (size1, id1) = saved[p], now[p]
            changes.append(f"{p} changed ({size0} -> {size1} bytes)" if size0 != size1 else f"{p} changed (same size, "
                           f"content {id0} -> {id1})")
    return changes
