"""tools/extract_fgrams.py end to end on a small pre-tokenized ArrayRecord corpus."""
import pytest
import os
import subprocess
import sys

import numpy as np
from test_fgram_reference import zipf_docs

from scone_jax.data.sources import write_token_arrayrecord
from scone_jax.data.tokenizer import Tokenizer
from scone_jax.fgram.extract import extract_fgrams
from scone_jax.fgram.vocab import load_vocab
from scone_jax.training import assets
from tests.common import REPO, small_config

pytestmark = pytest.mark.slow  # every test here starts processes or runs whole jobs


def run_tool(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "extract_fgrams.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


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


@pytest.mark.parametrize("add_bos", [True, False])
def test_text_corpus_counts_what_the_training_run_counts(tmp_path, tokenizer_path, add_bos):
    """The tool and the run's own extraction (training/assets.ensure_vocab) read one stream, [bos] + ids of each
    training document (ids alone with data.add_bos=False and the tool's --noadd_bos), so they build the same
    vocabulary; f-grams hold the bos exactly when documents start with it. Catches the tool counting documents
    without bos, as it did before the two shared data/tokenize.model_documents (tried: the fingerprints differ),
    ensure_vocab counting [bos] + ids whatever data.add_bos says, and the tool ignoring --noadd_bos (each tried:
    the no-bos case fails)."""
    config = small_config()
    config.data.tokenizer_path = tokenizer_path
    config.data.add_bos = add_bos
    config.scone.update(dict(max_len=4, num_fgrams=500, min_count=3, extract_max_tokens=60_000))
    tok = Tokenizer.load(tokenizer_path)
    run_vocab = assets.ensure_vocab(config.scone, config.data, tok, str(tmp_path / "run"))
    out = run_tool("--source=kjv", f"--eval_fraction={config.data.eval_fraction}", f"--tokenizer={tokenizer_path}",
                   "--max_len=4", "--num_fgrams=500", "--min_count=3", "--max_tokens=60000", "--num_workers=1",
                   f"--output={tmp_path}/tool", "--stats_batch=2", "--stats_seq_len=256", "--stats_tokens=2000",
                   "--add_bos" if add_bos else "--noadd_bos")
    assert out.returncode == 0, out.stderr[-2000:]
    tool_vocab = load_vocab(str(tmp_path / "tool"))
    assert tool_vocab.tokens_counted == run_vocab.tokens_counted == 60_000
    assert tool_vocab.fingerprint == run_vocab.fingerprint
    with_bos = (run_vocab.tokens == tok.bos_id).any(axis=1).sum()  # f-grams that open a document
    assert with_bos > 0 if add_bos else with_bos == 0
