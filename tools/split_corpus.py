"""Split a tree of text files into train / validation / test JSONL files, one document per file.

  apt-get install linux-doc-6.1     # Debian's kernel documentation: 3,184 reStructuredText sources
  python tools/split_corpus.py --input=/usr/share/doc/linux-doc-6.1/html/_sources --pattern='**/*.txt' \\
      --output=/tmp/linux_doc
writes /tmp/linux_doc/{train,validation,test}.jsonl (one line per file: {"text": ..., "path": ...}) and
split.json (counts and the rule). Each file goes to the split its relative path hashes to (SHA-256 of
the path, read as a fraction of 2^64, below --test_fraction: test; below test + validation: validation;
else train), so the split never depends on the order the files are found in, and adding a file never
moves another. Files are read as UTF-8 (undecodable bytes replaced); empty files are skipped. Train on
it with data.source=jsonl (tools/bench_quality.py, or --config.data.train_files=.../train.jsonl).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os

from absl import flags

from scone_jax.runtime import tool_main

_INPUT = flags.DEFINE_string("input", None, "Root directory of the text files.")
_PATTERN = flags.DEFINE_string("pattern", "**/*", "Glob below --input selecting the files (recursive '**').")
_OUTPUT = flags.DEFINE_string("output", None, "Directory to write train/validation/test.jsonl into.")
_VALIDATION = flags.DEFINE_float("validation_fraction", 0.05, "Expected fraction of files in the validation split.")
_TEST = flags.DEFINE_float("test_fraction", 0.05, "Expected fraction of files in the test split.")

SPLITS = ("train", "validation", "test")


def split_of(relative_path: str, validation_fraction: float, test_fraction: float) -> str:
    """The split a file belongs to, from its path alone (module docstring)."""
    u = int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64
    if u < test_fraction:
        return "test"
    return "validation" if u < test_fraction + validation_fraction else "train"


def split_files(root: str, pattern: str, output: str, validation_fraction: float, test_fraction: float) -> dict:
    """Write the three JSONL files; returns {split: {"files", "bytes"}} plus the rule's parameters."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"--input={root!r} is not a directory. Fix: pass the root of the text files.")
    if not (0 <= validation_fraction and 0 < test_fraction and validation_fraction + test_fraction < 1):
        raise ValueError(f"--validation_fraction={validation_fraction} and --test_fraction={test_fraction} must be "
                         ">= 0 and > 0 and sum to less than 1.")
    paths = sorted(p for p in glob.glob(os.path.join(root, pattern), recursive=True) if os.path.isfile(p))
    if not paths:
        raise FileNotFoundError(f"No file under {root!r} matches --pattern={pattern!r}. Fix: check both.")
    os.makedirs(output, exist_ok=True)
    stats = {s: {"files": 0, "bytes": 0} for s in SPLITS}
    temporary = {s: os.path.join(output, f".{s}.jsonl.partial") for s in SPLITS}
    outs = {s: open(temporary[s], "w", encoding="utf-8") for s in SPLITS}
    try:
        for path in paths:
            relative = os.path.relpath(path, root)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if not text.strip():
                continue
            split = split_of(relative, validation_fraction, test_fraction)
            outs[split].write(json.dumps({"text": text, "path": relative}, ensure_ascii=False) + "\n")
            stats[split]["files"] += 1
            stats[split]["bytes"] += len(text.encode("utf-8"))
    finally:
        for f in outs.values():
            f.close()
    empty = [s for s in SPLITS if not stats[s]["files"]]
    if empty:
        for t in temporary.values():
            os.remove(t)
        raise ValueError(f"The {', '.join(empty)} split would be empty ({len(paths)} files in all). Fix: raise its "
                         "fraction or give more files.")
    for s in SPLITS:  # published only when complete
        os.replace(temporary[s], os.path.join(output, f"{s}.jsonl"))
    record = {"input": os.path.abspath(root), "pattern": pattern, "validation_fraction": validation_fraction,
              "test_fraction": test_fraction, "rule": "sha256(relative path)[:8] / 2^64", "splits": stats}
    with open(os.path.join(output, "split.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def main():
    tool_main.require(input=_INPUT.value, output=_OUTPUT.value)
    record = split_files(_INPUT.value, _PATTERN.value, _OUTPUT.value, _VALIDATION.value, _TEST.value)
    for s in SPLITS:
        print(f"{s:10s} {record['splits'][s]['files']:6,} files {record['splits'][s]['bytes'] / 1e6:8.1f} MB -> "
              f"{os.path.join(_OUTPUT.value, s + '.jsonl')}")


if __name__ == "__main__":
    tool_main.run(main, program="split_corpus")
