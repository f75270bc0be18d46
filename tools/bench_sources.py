"""Reading documents from compressed corpora (.gz, .zst) against the plain file, as grain workers do.

  python tools/bench_sources.py                       # the embedded corpus as JSONL, one paragraph per line
  python tools/bench_sources.py --input=/data/linux_doc/train.jsonl

The input is written gzip- and zstd-compressed into a temporary directory; each source is opened
(a compressed file is decompressed once into its local block copy: timed) and --reads documents at
random indices are read through it, the best of --rounds rounds. Last lines:
`RESULT source_docs_per_s_<plain|gzip|zstd>`, `RESULT source_mb_per_s_<...>` (decompressed text) and
`RESULT source_open_s_<gzip|zstd>` (the first open: the block copy and the line scan).
"""
import gzip
import json
import os
import shutil
import tempfile
import time

import numpy as np
import zstandard
from absl import flags

from scone_jax.data import corpus, sources
from scone_jax.runtime import tool_main

_INPUT = flags.DEFINE_string("input", "", "A .jsonl file with a 'text' field; '' = the embedded corpus.")
_READS = flags.DEFINE_integer("reads", 5000, "Documents read per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; the fastest counts.")


def main():
    scratch = tempfile.mkdtemp(prefix="bench_sources-")
    os.environ["SCONE_JAX_BLOCK_CACHE"] = os.path.join(scratch, "block_cache")
    try:
        plain = _INPUT.value or os.path.join(scratch, "kjv.jsonl")
        if not _INPUT.value:
            with open(plain, "w") as f:
                f.writelines(json.dumps({"text": d}) + "\n" for d in corpus.kjv_documents("train", 0.02))
        data = open(plain, "rb").read()
        with gzip.open(os.path.join(scratch, "c.jsonl.gz"), "wb") as f:
            f.write(data)
        with open(os.path.join(scratch, "c.jsonl.zst"), "wb") as f:
            f.write(zstandard.ZstdCompressor(write_checksum=True).compress(data))
        files = {"plain": plain, "gzip": os.path.join(scratch, "c.jsonl.gz"),
                 "zstd": os.path.join(scratch, "c.jsonl.zst")}
        for kind, path in files.items():
            start = time.perf_counter()
            source = sources.JsonlSource([path], "text")
            opened = time.perf_counter() - start
            indices = np.random.default_rng(0).integers(0, len(source), _READS.value)
            best, chars = float("inf"), 0
            for _ in range(_ROUNDS.value):
                start = time.perf_counter()
                chars = sum(len(source[int(i)].encode()) for i in indices)
                best = min(best, time.perf_counter() - start)
            print(f"{kind}: {len(source):,} documents, {os.path.getsize(path) / 1e6:.1f} MB on disk, opened in "
                  f"{opened:.2f} s", flush=True)
            print(f"RESULT source_docs_per_s_{kind} {_READS.value / best:.0f}")
            print(f"RESULT source_mb_per_s_{kind} {chars / best / 1e6:.1f}")
            if kind != "plain":
                print(f"RESULT source_open_s_{kind} {opened:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    tool_main.run(main, "bench_sources")
