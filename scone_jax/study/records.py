"""The quality study's records: experiments/quality/runs.jsonl, one JSON object per finished run, appended by
tools/bench_quality.py and read by tools/plot_quality.py (docs/quality.md's tables and figure: study/tables.py).

A record names everything that tells a run apart, so no file name has to: its arm, every config setting it
made on top of configs/quality.py's arm (`overrides`, dotted key -> value, `train.seed` among them when
given), the seed, learning rate, token budget and steps, the commit, the corpus and a hash of its splits' bytes, and what
it measured (validation and test perplexity, test tokens, FLOPs, hit rate). The file is append-only: a rerun
of the same settings adds a line and nothing already recorded is ever rewritten. Readers never choose between
lines by their order: a seed's records of one setting are one entry (`by_seed`), a record appended twice is said
once, and reruns that measured differently are averaged and counted. `source` names the results file a record
was migrated from (null for appended runs); `platform` the device kind the run trained on ("cpu", "NVIDIA
H200"): runs of one protocol on another platform are other runs (their numerics differ), never seeds of the same
table row.

Records appended since Over-Encoding joined the study also carry OPTIONAL fields: the served decoder's bytes on
the accelerator (`accelerator_bytes`: Over-Encoding's tables among them), the f-gram table's bytes off it
(`host_table_bytes`, in host RAM or on disk; 0 without SCONE) and the median training throughput
(`train_tokens_per_s`); older records lack them.

Records of the fine-tuning study (tools/bench_finetune.py, arms `ft_*` and `pretrain_*`) carry more OPTIONAL
fields: `pretrain` (what the fine-tuned models started from: the pretraining corpus, tokens, arms and tokenizer;
runs from other pretraining are other settings), `decode_ms_per_token` (greedy decoding of the export, one row, ms per
token) and `decode_ms_per_token_plain` (the plain fine-tune's export, timed alternately with it in the same
process: the pair to compare on a shared machine). A fine-tune scored on conversations has no bits per byte (its
loss covers the assistant tokens only): `test_bits_per_byte` is null there.

`overrides` are relative to configs/quality.py's defaults when the run was recorded, and those defaults
change as the study finds better ones. So a record carries `defaults_version` (DEFAULTS_VERSION when
appended; a record without it is version 1, the method's defaults), and readers compare runs by `effective`
settings: that version's defaults plus the overrides, told as their difference from version 1. An old run
with train.fgram_model_delay_steps=80 and a new 10M run with no override (today's share, 0.065 of 1,221 steps:
80) are then the same setting. A record keeps
every override it was given, but runs are compared only by what changes their result: the keys config_keys.py
declares LOOP (data.worker_count, train.max_steps_per_run: how a run was fitted to its machine and job slots)
are left out of the effective settings.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

from scone_jax import config as config_lib, config_keys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = os.path.join(REPO, "experiments", "quality", "runs.jsonl")

# The fields of a record, in the order they are written (json.dumps keeps insertion order).
FIELDS = ("arm", "overrides", "seed", "learning_rate", "tokens", "steps", "validation_ppl", "test_ppl",
          "test_bits_per_byte", "test_tokens", "hit_rate", "inference_flops_per_token", "train_flops",
          "fgram_capacity", "train_seconds", "commit", "corpus", "splits_sha256", "source", "platform")
# Fields of records appended since Over-Encoding joined the study (module docstring), absent from older ones.
SERVING_FIELDS = ("accelerator_bytes", "host_table_bytes", "train_tokens_per_s")
# Fields only the fine-tuning study's records carry (module docstring).
FINETUNE_FIELDS = ("pretrain", "decode_ms_per_token", "decode_ms_per_token_plain")
OPTIONAL = SERVING_FIELDS + FINETUNE_FIELDS
# Settings a run without SCONE never reads: left out of a baseline's overrides, so that a baseline of a study
# run with e.g. --config.scone.output_norm=false is the same baseline as any other. Likewise Over-Encoding's.
SCONE_ONLY = ("scone.", "train.fgram_model_delay_")
OE_ONLY = ("overencoding.",)
ENGRAM_ONLY = ("engram.",)
# configs/quality.py's defaults that changed, per version, for the SCONE arms (a baseline reads none of them).
# Version 1: the method's (no delay); 2: the delay chosen on validation at 10M tokens (docs/quality.md, "How the
# study got here"); 3: that delay as a share of the run (80 of 1,221 steps at 10M, 24 of 367 at 3M).
_STEPS, _FRACTION = "train.fgram_model_delay_steps", "train.fgram_model_delay_fraction"
DEFAULTS = {1: {_STEPS: 0, _FRACTION: 0.0}, 2: {_STEPS: 80, _FRACTION: 0.0}, 3: {_STEPS: 0, _FRACTION: 0.065}}
DEFAULTS_VERSION = max(DEFAULTS)  # configs/quality.py's now: what a record appended today carries
# Keys that say how a run was fitted to its machine (workers, job slots, logging, checkpoints), never what it
# computes: kept in a record's overrides, left out of the settings runs are compared by.
LOOP_KEYS = frozenset(config_keys.LOOP_ONLY_KEYS)


def read(path: str = RECORDS) -> list[dict]:
    """Every record of `path`, in the order appended; blank lines are skipped (an editor's final newline). A
    line that is not a record (not JSON, a field missing or of the wrong type) is refused naming it."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not a JSON record ({e}). Fix: restore that line from "
                                 "git (the file is append-only).") from None
            problem = check(record)
            if problem:
                raise ValueError(f"{path}:{number} {problem}. Fix: restore that line from git (the file is "
                                 "append-only).")
            out.append(record)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Each field's test and what it must be (what tables.py, figure.py and the checks read), for check()'s message.
_TYPES = {
    "arm": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "overrides": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v), "an object of dotted keys"),
    "seed": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "learning_rate": (lambda v: _number(v) and v > 0, "a number > 0"),
    "tokens": (lambda v: _integer(v) and v > 0, "an integer > 0"),
    "steps": (lambda v: _integer(v) and v > 0, "an integer > 0"),
    "validation_ppl": (lambda v: _number(v) and v >= 1, "a finite perplexity (a number >= 1)"),
    "test_ppl": (lambda v: _number(v) and v >= 1, "a finite perplexity (a number >= 1)"),
    "test_bits_per_byte": (lambda v: v is None or _number(v) and v >= 0, "a number >= 0 or null"),
    "test_tokens": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "hit_rate": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "inference_flops_per_token": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "train_flops": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "fgram_capacity": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "train_seconds": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "commit": (lambda v: isinstance(v, str), "a string"),
    "corpus": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "splits_sha256": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "source": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "platform": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "accelerator_bytes": (lambda v: _integer(v) and v > 0, "an integer > 0"),
    "host_table_bytes": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "train_tokens_per_s": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "pretrain": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "decode_ms_per_token": (lambda v: _number(v) and v > 0, "a number > 0"),
    "decode_ms_per_token_plain": (lambda v: _number(v) and v > 0, "a number > 0"),
}


def check(record) -> str | None:
    """What is wrong with `record` as a record (a field missing, or of the wrong type or range: "seed": "1",
    "test_ppl": null), None if nothing."""
    if not isinstance(record, dict):
        return f"is {type(record).__name__}, not a record (a JSON object)"
    missing = [k for k in FIELDS if k not in record]
    if missing:
        return f"lacks the fields {missing}"
    for field, (test, want) in _TYPES.items():
        if field in OPTIONAL and field not in record:
            continue
        if not test(record[field]):
            return f"has {field}={json.dumps(record[field])}, which must be {want}"
    if "defaults_version" in record and record["defaults_version"] not in DEFAULTS:
        return (f"has defaults_version={json.dumps(record['defaults_version'])}, which must be one of "
                f"{sorted(DEFAULTS)}")
    return None


def version(record: dict) -> int:
    """The defaults version a record's overrides are relative to (1 for a record written before versions)."""
    return record.get("defaults_version", 1)


def effective(record: dict) -> dict:
    """The run's settings apart from its seed, as their difference from version 1's defaults: its version's
    defaults (SCONE arms) with its overrides on top, less what equals version 1's defaults and less the keys
    that cannot change the result (config_keys' LOOP keys). A SCONE delay given as a share of the run is told
    as the steps it gave (train.fgram_model_delay_steps), so runs held back equally long meet however it was
    asked. data.shuffle_seed equal to the seed is the seed (the fine-tuning study's seeds set the data order
    too: study/finetune.py), not a setting."""
    given = {k: v for k, v in record["overrides"].items() if k != "train.seed" and k not in LOOP_KEYS
             and not (k == "data.shuffle_seed" and v == record["seed"])}  # a seed that is its data order too
    defaults = DEFAULTS[version(record)] if record["arm"].startswith("scone") else {}
    merged = {**defaults, **given}
    if defaults and _FRACTION in merged:  # SCONE: the delay as the steps it gave this run, however it was asked
        fraction = merged.pop(_FRACTION)
        if fraction:
            merged[_STEPS] = config_lib.delay_steps_for_fraction(fraction, record["steps"])
    first = DEFAULTS[1]
    return dict(sorted((k, v) for k, v in merged.items() if not (k in first and first[k] == v)))


def append(record: dict, path: str = RECORDS) -> None:
    """Add `record` as the last line of `path` (created with its folder if missing); earlier lines are
    never rewritten. A last line cut short by a crash is ended first, so the new record stays a line."""
    problem = check(record)
    if problem:
        raise ValueError(f"The quality record of {record.get('arm')!r} {problem}; nothing was appended to {path}.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "ab") as f:
        if f.tell() and _last_byte(path) != b"\n":
            f.write(b"\n")
        fields = FIELDS + tuple(k for k in OPTIONAL + ("defaults_version",) if k in record)
        f.write((json.dumps({k: record[k] for k in fields}) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _last_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def overrides_of(config, keys) -> dict:
    """The dotted config keys a run was given, as key -> the value the run's config holds (typed: 1 becomes
    1.0 for a float key; train.seed stays one of them), SCONE's (Over-Encoding's, Engram's) keys dropped for a run
    without it."""
    out = {}
    for key in keys:
        if (config.scone.enabled or not key.startswith(SCONE_ONLY)) and (
                config.overencoding.enabled or not key.startswith(OE_ONLY)) and (
                config.engram.enabled or not key.startswith(ENGRAM_ONLY)):
            out[key] = _get(config, key)
    return dict(sorted(out.items()))


def _get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def splits_sha256(train_files: str, validation_files: str, test_files: str) -> str:
    """SHA-256 over the bytes of the three splits' files, each a comma-separated glob list (each split's files
    sorted by path; names and places not hashed: a corpus moved unchanged keeps its hash)."""
    from scone_jax.data import sources

    digest = hashlib.sha256()
    for name, patterns in (("train", train_files), ("validation", validation_files),
                           ("test", test_files)):
        digest.update(f"\0split {name}\0".encode())
        for path in sources.expand_files(patterns):
            digest.update(b"\0file\0")
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
    return digest.hexdigest()


def corpus_name(train_files: str) -> str:
    """The corpus's name: the folder of its first training file (/data/linux_doc/train.jsonl -> linux_doc), of a
    comma-separated glob list."""
    first = train_files.split(",")[0]
    return os.path.basename(os.path.dirname(os.path.abspath(first))) or first


def from_run(result: dict, config, keys, test_files: str) -> dict:
    """The record of a run tools/bench_quality.py finished: its results-file entry `result`, the run's
    `config` and the keys the study set on top of configs/quality.py (its --config.KEY=VALUE flags)."""
    from scone_jax.config import resolve
    from scone_jax.data import eval_sets, mixture

    record = {k: result.get(k) for k in FIELDS + tuple(k for k in OPTIONAL if k in result)}
    data = resolve(config.copy_and_resolve_references()).data  # the shorthand, if given, into its groups
    train_files = mixture.all_files(data)
    record.update(overrides=overrides_of(config, keys), seed=int(config.train.seed), defaults_version=DEFAULTS_VERSION,
                  corpus=corpus_name(train_files),
                  splits_sha256=splits_sha256(train_files, eval_sets.all_files(data), test_files),
                  source=None, platform=_device_kind())
    return record


def _device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


def settings(record: dict) -> tuple:
    """What makes runs seeds of one protocol: arm, token budget (the exact tokens trained), learning rate,
    effective settings but the seed, the platform and the corpus (with what a fine-tune started from, `pretrain`)."""
    rest = tuple(effective(record).items())
    corpus = record["corpus"] + (f" after {record['pretrain']}" if record.get("pretrain") else "")
    return record["arm"], record["tokens"], float(record["learning_rate"]), rest, record["platform"], corpus


def _figures(record: dict) -> tuple:
    """What a run measured: two records with these equal are one measurement, appended twice."""
    return tuple(record[k] for k in ("validation_ppl", "test_ppl", "test_bits_per_byte", "test_tokens", "hit_rate"))


def distinct(records: list[dict]) -> list[dict]:
    """`records` in their order, each measurement once: a record whose setting, seed and figures equal an
    earlier one's (the same run appended twice) is left out."""
    seen, out = set(), []
    for record in records:
        key = (settings(record), record["seed"], _figures(record))
        if key not in seen:
            seen.add(key)
            out.append(record)
    return out


def by_seed(records: list[dict]) -> dict[tuple, dict[int, dict]]:
    """settings(...) -> seed -> the one entry of that setting and seed (seed_entry), whatever order the records
    were appended in."""
    grouped: dict[tuple, dict[int, list[dict]]] = {}
    for record in distinct(records):
        grouped.setdefault(settings(record), {}).setdefault(record["seed"], []).append(record)
    return {setting: {seed: seed_entry(runs) for seed, runs in seeds.items()} for setting, seeds in grouped.items()}


def seed_entry(runs: list[dict]) -> dict:
    """One entry for the distinct records of one setting and seed, independent of their order: the record itself
    when there is one; else the first by its figures, with test and validation perplexity, bits per byte and hit
    rate averaged over them and `runs` saying how many."""
    runs = sorted(runs, key=lambda r: json.dumps(r, sort_keys=True))
    entry = dict(runs[0], runs=len(runs))
    if len(runs) > 1:
        for k in ("validation_ppl", "test_ppl", "test_bits_per_byte", "hit_rate"):
            if all(r[k] is not None for r in runs):  # bits per byte: null for a fine-tune on conversations
                entry[k] = sum(r[k] for r in runs) / len(runs)
    return entry
