"""Named held-out sets: data.eval_sets, set name -> globs, set in a config file or by the command line's
shorthand `--config.data.eval_files='web=/d/web/*.jsonl;books=/d/books/*.txt.gz'` (`parse`, called by
config.resolve alone).

The paper reports perplexity on several evaluation domains and their unweighted average. Each named
set is evaluated on its own (training's periodic evaluation and serving.evaluate), and the average of
the sets' figures is reported as the set `average`. Without sets, data.eval_files (a comma-separated glob
list, or '' for the embedded corpus's held-out split) is one set, reported as before.
"""
from __future__ import annotations

import glob
import math
import re

import ml_collections

SINGLE = ""  # the name of the one set of an unnamed data.eval_files
AVERAGE = "average"
_NAMED = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*=(.*)$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse(eval_files: str) -> dict[str, str] | None:
    """The data.eval_sets group the shorthand `eval_files` spells ({name: comma-separated globs}), None for an
    unnamed value. ValueError naming the problem and the fix for a set without files, a name used twice or the
    reserved name. Only config.resolve calls it: the one place the shorthand is read."""
    parts = [p for p in eval_files.split(";") if p.strip()]
    named = [_NAMED.match(p) for p in parts]
    if not parts or not any(named):
        return None
    if not all(named):
        bad = next(p for p, m in zip(parts, named) if not m)
        raise ValueError(f"data.eval_files: {bad.strip()!r} has no name, but other sets do. Fix: name every set, "
                         "e.g. 'web=/d/web/*.jsonl;books=/d/books/*.txt', or give one unnamed glob list.")
    sets: dict[str, str] = {}
    for part, m in zip(parts, named):
        name, files = m.group(1), m.group(2).strip()
        if "://" not in part and glob.glob(part.strip()):
            raise ValueError(f"data.eval_files: {part.strip()!r} names the set {name!r} of the files {files!r} "
                             f"(NAME=GLOBS names a set), but it is also a path. Fix: {QUOTE_PATH}, e.g. "
                             f"'./{part.strip()}'.")
        if name == AVERAGE:
            raise ValueError(f"data.eval_files: the set name {AVERAGE!r} is reserved for the average of the sets. "
                             "Fix: rename that set.")
        if name in sets:
            raise ValueError(f"data.eval_files: the set name {name!r} is used twice. Fix: give each set its own name.")
        if not files.strip(", "):
            raise ValueError(f"data.eval_files: the set {name!r} names no files. Fix: {name}=<comma-separated globs>.")
        sets[name] = files
    return sets


QUOTE_PATH = "to give a path that contains '=', write it with its directory (a set's name has no '/')"


def check(group) -> dict[str, str]:
    """`group` (data.eval_sets's value, set in a config file) checked and in its plain form; ValueError naming
    the set and the fix for a bad name, the reserved name or a set without files."""
    for name, files in group.items():
        if name == AVERAGE:
            raise ValueError(f"data.eval_sets: the set name {AVERAGE!r} is reserved for the average of the sets. "
                             "Fix: rename that set.")
        if not isinstance(name, str) or not _NAME.match(name) or not isinstance(files, str) or not files.strip(", "):
            raise ValueError(f"data.eval_sets: the set {name!r} is {files!r}. Fix: a name (a string) of letters, digits, "
                             "_ . - and its comma-separated globs, e.g. config.data.eval_sets = {'web': '/d/web/*.jsonl'}.")
    return {name: files.strip() for name, files in group.items()}


def configs(data_cfg) -> dict[str, ml_collections.ConfigDict]:
    """A copy of `data_cfg` per set of data.eval_sets (name order), its eval_files that set's globs; without
    sets (a data config without the key included), {SINGLE: `data_cfg` itself}."""
    sets = data_cfg.get("eval_sets") or {}
    if not sets:
        return {SINGLE: data_cfg}
    out = {}
    for name in sorted(sets):
        cfg = data_cfg.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.eval_files = sets[name]
            cfg.eval_sets = {}
        out[name] = cfg
    return out


def open_set(name: str, data_cfg, make):
    """make(data_cfg) for the held-out set `name`; a set whose files match nothing is refused naming the set, and
    how to write a path with '=' that was read as NAME=GLOBS ('run=3.jsonl' is the set 'run' of '3.jsonl')."""
    try:
        return make(data_cfg)
    except FileNotFoundError as e:
        if name == SINGLE:
            raise
        raise FileNotFoundError(f"The held-out set {name!r} (data.eval_sets, or NAME=GLOBS in data.eval_files) of the "
                                f"files {data_cfg.eval_files!r}: {e} If {name}={data_cfg.eval_files} was one path, "
                                f"{QUOTE_PATH}: './{name}={data_cfg.eval_files}'.") from None


def all_files(data_cfg) -> str:
    """Every set's globs as one comma-separated list (data.eval_files itself without sets)."""
    sets = data_cfg.get("eval_sets") or {}
    return ",".join(sets[name] for name in sorted(sets)) if sets else data_cfg.eval_files


def average(results: dict[str, dict], keys=("loss", "perplexity", "bits_per_byte")) -> dict:
    """The unweighted mean of each of `keys` over the sets (None where any set lacks it)."""
    out = {}
    for key in keys:
        values = [r.get(key) for r in results.values()]
        out[key] = sum(values) / len(values) if values and all(v is not None for v in values) else None
    return out


def held_out_bytes(data_cfg, tokenizer) -> int:
    """UTF-8 bytes of every held-out document of `data_cfg` (pre-tokenized ones are decoded first): the
    denominator of bits per byte. 0 (no bits per byte) for conversations: their loss counts some tokens only."""
    from scone_jax.data import sources

    if data_cfg.source == "chat":
        return 0
    source = sources.open_source(data_cfg, "eval")
    total = 0
    for i in range(len(source)):
        doc = source[i]
        total += len((doc if isinstance(doc, str) else tokenizer.decode(doc)).encode("utf-8"))
    return total


def bits_per_byte(loss: float, tokens: float, num_bytes: int) -> float | None:
    """Total next-token loss (nats) / ln 2 / bytes; None without a byte count."""
    return loss * tokens / math.log(2) / num_bytes if num_bytes else None
