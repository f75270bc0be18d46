"""tools/extract_fgrams.py end to end on a small pre-tokenized ArrayRecord corpus."""
import os
import subprocess
import sys

import numpy as np
from test_fgram_reference import zipf_docs

from scone_jax.data.sources import write_token_arrayrecord
from scone_jax.fgram.extract import extract_fgrams
from scone_jax.fgram.vocab import load_vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "extract_fgrams.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_arrayrecord_corpus(tmp_path):
    docs = zipf_docs(np.random.default_rng(0), num_docs=300, vocab_size=50, max_doc_len=100)
    write_token_arrayrecord(str(tmp_path / "docs.arrayrecord"), docs)
    out = run_tool("--source=arrayrecord", f"--files={tmp_path}/*.arrayrecord", "--vocab_size=50",
                   "--num_fgrams=200", "--num_workers=1", f"--output={tmp_path}/fgrams",
                   "--stats_batch=2", "--stats_seq_len=256")
    assert out.returncode == 0, out.stderr
    expected = extract_fgrams(docs, num_fgrams=200, vocab_size=50, num_workers=1)
    assert load_vocab(str(tmp_path / "fgrams")).fingerprint == expected.fingerprint
    assert f"count cutoff (count of f-gram #200): {expected.counts[-1]}" in out.stdout
    assert "per length: 2: " in out.stdout and "hit_rate 0." in out.stdout
    assert "count 5-grams" in out.stderr and "M tokens/s" in out.stderr


def test_bad_input_is_one_line(tmp_path):
    out = run_tool("--source=kjv", "--num_fgrams=10", f"--output={tmp_path}/x")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --source=kjv is text: pass --tokenizer=<model> (tools/train_tokenizer.py).")
