"""The quality study's records: experiments/quality/runs.jsonl, one JSON object per finished run, appended by
tools/bench_quality.py and read by tools/plot_quality.py (docs/quality.md's tables and figure).

A record names everything that tells a run apart, so no file name has to: its arm, every config setting it
made on top of configs/quality.py's arm (`overrides`, dotted key -> value, the seed included when not 0), the
seed, learning rate, token budget and steps, the commit, the corpus and a hash of its splits' bytes, and what
it measured (validation and test perplexity, test tokens, FLOPs, hit rate). The file is append-only: a rerun
of the same settings adds a line, and readers take the last one (`latest`), so nothing already recorded is
ever rewritten. `source` names the results file a record was migrated from (null for appended runs).
"""
from __future__ import annotations

import hashlib
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(REPO, "experiments", "quality", "runs.jsonl")

# The fields of a record, in the order they are written (json.dumps keeps insertion order).
FIELDS = ("arm", "overrides", "seed", "learning_rate", "tokens", "steps", "validation_ppl", "test_ppl",
          "test_bits_per_byte", "test_tokens", "hit_rate", "inference_flops_per_token", "train_flops",
          "fgram_capacity", "train_seconds", "commit", "corpus", "splits_sha256", "source")
# Settings a run without SCONE never reads: left out of a baseline's overrides, so that a baseline of a study
# run with e.g. --override=scone.output_norm=false is the same baseline as any other.
SCONE_ONLY = ("scone.", "train.fgram_model_delay_steps")


def read(path: str = RECORDS) -> list[dict]:
    """Every record of `path`, in the order appended. A line that is not a record is refused naming it."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                missing = [k for k in FIELDS if k not in record]
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(f"{path}:{number} is not a JSON record ({e}). Fix: restore that line from "
                                 "git (the file is append-only).") from None
            if missing:
                raise ValueError(f"{path}:{number} lacks the fields {missing}. Fix: restore that line from git "
                                 "(the file is append-only).")
            out.append(record)
    return out


def append(record: dict, path: str = RECORDS) -> None:
    """Add `record` as the last line of `path` (created with its folder if missing); earlier lines are
    never rewritten. A last line cut short by a crash is ended first, so the new record stays a line."""
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise ValueError(f"A quality record lacks the fields {missing}; it has {sorted(record)}.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "ab") as f:
        if f.tell() and _last_byte(path) != b"\n":
            f.write(b"\n")
        f.write((json.dumps({k: record[k] for k in FIELDS}) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _last_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def overrides_of(config, settings: list[str]) -> dict:
    """The `KEY=VALUE` settings a run was given, as dotted key -> the value the run's config holds (typed:
    1 becomes 1.0 for a float key), the seed included when not 0, SCONE's keys dropped for a run without it."""
    out = {}
    for item in settings:
        key = item.partition("=")[0].strip()
        if config.scone.enabled or not key.startswith(SCONE_ONLY):
            out[key] = _get(config, key)
    if config.train.seed:
        out["train.seed"] = int(config.train.seed)
    return dict(sorted(out.items()))


def _get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def splits_sha256(train_files: str, validation_files: str, test_files: str) -> str:
    """SHA-256 over the bytes of the three splits' files (each split's files sorted by path; names and
    places not hashed: a corpus moved unchanged keeps its hash)."""
    from scone_jax.data import mixture, sources

    digest = hashlib.sha256()
    for name, patterns in (("train", mixture.all_files(train_files)), ("validation", validation_files),
                           ("test", test_files)):
        digest.update(f"\0split {name}\0".encode())
        for path in sources.expand_files(patterns):
            digest.update(b"\0file\0")
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
    return digest.hexdigest()


def corpus_name(train_files: str) -> str:
    """The corpus's name: the folder of its first training file (/data/linux_doc/train.jsonl -> linux_doc)."""
    from scone_jax.data import mixture

    first = mixture.all_files(train_files).split(",")[0]
    return os.path.basename(os.path.dirname(os.path.abspath(first))) or first


def from_run(result: dict, config, settings: list[str], test_files: str) -> dict:
    """The record of a run tools/bench_quality.py finished: its results-file entry `result`, the run's
    `config` and the study's --override `settings`."""
    record = {k: result.get(k) for k in FIELDS}
    record.update(overrides=overrides_of(config, settings), seed=int(config.train.seed),
                  corpus=corpus_name(config.data.train_files),
                  splits_sha256=splits_sha256(config.data.train_files, config.data.eval_files, test_files),
                  source=None)
    return record


def settings(record: dict) -> tuple:
    """What makes runs seeds of one protocol: arm, token budget, learning rate and overrides but the seed."""
    rest = tuple(sorted((k, v) for k, v in record["overrides"].items() if k != "train.seed"))
    return record["arm"], record["tokens"], float(record["learning_rate"]), rest


def latest(records: list[dict]) -> dict[tuple, dict[int, dict]]:
    """settings(...) -> seed -> the last record appended for them (a rerun supersedes, nothing is rewritten)."""
    out: dict[tuple, dict[int, dict]] = {}
    for record in records:
        out.setdefault(settings(record), {})[record["seed"]] = record
    return out
