"""tools/pretokenize.py end to end, in a subprocess: shards, sidecars, determinism, errors."""
import json
import os
import re
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from scone_jax.data import corpus, sources
from scone_jax.data.tokenizer import Tokenizer
from scone_jax.training.assets import ensure_tokenizer
from tests.common import REPO, small_config


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("tok"))
    ensure_tokenizer(small_config().data, workdir, max_chars=300_000)
    return os.path.join(workdir, "tokenizer.model")


def pretokenize(*args):
    return subprocess.run([sys.executable, "tools/pretokenize.py", "--progress_seconds=0.05", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def records(path):
    source = sources.TokenArrayRecordSource([path])
    return [source[i].tolist() for i in range(len(source))]


def files_of(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.fixture
def text_corpus(tmp_path):
    """Two text files; the documents are their non-empty lines, file a first."""
    kjv = list(corpus.kjv_documents("eval", 0.02)[:70])
    (tmp_path / "a.txt").write_text("\n\n".join(kjv[:40]) + "\n")
    odd = ["naïve café ☃", "  leading and trailing spaces  ", "tab\there", "crlf line"]
    (tmp_path / "b.txt").write_bytes(("\n".join(kjv[40:] + odd[:3]) + "\n" + odd[3] + "\r\n").encode())
    return f"{tmp_path}/a.txt,{tmp_path}/b.*", kjv + odd


@pytest.mark.slow  # worker processes
def test_text_corpus_shards_equal_encode_in_order_for_1_and_2_workers(tok_path, text_corpus, tmp_path):
    """Catches shard ranges computed as i * (N // S) instead of N * i // S, which drop the last N mod S
    documents (74 documents in 3 shards), and any shard layout that depends on the worker count."""
    pattern, docs = text_corpus
    tok = Tokenizer.load(tok_path)
    expected = [tok.encode(doc).tolist() for doc in docs]
    outputs = {}
    for workers in (1, 2):
        out = str(tmp_path / f"out{workers}")
        result = pretokenize(f"--input={pattern}", f"--tokenizer={tok_path}", f"--output={out}", "--num_shards=3",
                             f"--workers={workers}")
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"-> 3 shard(s) in {out} with {workers} process(es)" in result.stderr
        assert re.search(r"pretokenize: 74/74 documents \(100\.0%\), [\d.]+M tokens, [\d.]+M tokens/s, ETA 0 s",
                         result.stderr)
        assert float(re.search(r"^RESULT pretokenize_tokens_per_s (\d+)$", result.stdout, re.M)[1]) > 0
        outputs[workers] = files_of(out)
        shard_paths = [os.path.join(out, f"tokens-{i:05d}-of-00003.arrayrecord") for i in range(3)]
        assert sorted(outputs[workers]) == sorted(p + s for p in map(os.path.basename, shard_paths)
                                                  for s in ("", ".json", ".lengths.npy"))  # nothing else, no temps
        got = [r for p in shard_paths for r in records(p)]
        assert got == expected
        firsts = [0, 24, 49]  # 74 * i // 3
        for i, path in enumerate(shard_paths):
            lengths = np.load(path + ".lengths.npy")
            assert lengths.dtype == np.int32 and lengths.tolist() == [len(r) for r in records(path)]
            meta = json.load(open(path + ".json"))
            assert meta == {
                "format": "scone_jax.tokens.v1", "tokenizer_fingerprint": tok.fingerprint,
                "tokenizer_vocab_size": 512, "num_documents": len(lengths), "num_tokens": int(lengths.sum()),
                "first_document": firsts[i], "source": {"input": pattern, "format": "text", "document_unit": "line"}}
            assert records(path) == expected[firsts[i] : firsts[i] + len(lengths)]
    assert outputs[1] == outputs[2]  # byte for byte


@pytest.mark.slow  # the CLI three times, with 2 worker processes
def test_jsonl_corpus_trains_from_a_glob_over_the_directory_and_reruns_overwrite(tok_path, tmp_path):
    rows = [{"id": i, "text": text} for i, text in enumerate(
        ["first\nparagraph", "ünïcödé ☃", "x", "In the beginning God created the heaven and the earth."] * 5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = str(tmp_path / "out")
    args = [f"--input={tmp_path}/*.jsonl", "--format=jsonl", f"--tokenizer={tok_path}", f"--output={out}",
            "--workers=2"]
    result = pretokenize(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote 2 shard(s): 20 documents" in result.stdout  # default: one shard per worker for a small corpus
    tok = Tokenizer.load(tok_path)
    data = {"source": "arrayrecord", "train_files": f"{out}/*", "eval_files": "", "text_field": "text",
            "document_unit": "line", "eval_fraction": 0.0}
    source = sources.open_source(ml_collections.ConfigDict(data), "train", tokenizer_fingerprint=tok.fingerprint)
    assert [source[i].tolist() for i in range(len(source))] == [tok.encode(r["text"]).tolist() for r in rows]
    assert source.document_lengths().tolist() == [len(tok.encode(r["text"])) for r in rows]
    before = files_of(out)
    dead = subprocess.Popen(["true"])  # a process id that no longer runs, once waited for
    dead.wait()
    stale = tmp_path / "out" / f".run-{dead.pid}-x1y2" / "tokens-00001-of-00002.arrayrecord"
    stale.parent.mkdir()
    stale.write_bytes(b"left by a killed run")
    assert pretokenize(*args).returncode == 0
    assert files_of(out) == before and not stale.parent.exists()  # same shards again; the killed run's are gone
    again = pretokenize(*args, "--num_shards=1")
    assert again.returncode == 2
    assert again.stderr.strip().endswith(f"error: --output='{out}' holds shards of another run "
                                         "(tokens-00000-of-00002.arrayrecord, 2 in all) that a glob would mix with "
                                         "these 1. Fix: delete them or choose another --output.")


@pytest.mark.parametrize("case, message", [
    ("no_match", "error: No files match the pattern '{tmp}/missing-*.txt'. Fix: check the path/glob."),
    ("empty", "error: The 1 file(s) matching '{tmp}/blank.txt' hold zero documents"),
    ("format", "error: --format='csv' is unknown; use one of text, jsonl, chat."),
    ("output", "error: --output='{tmp}/blank.txt/out' is not writable (Not a directory). Fix: choose a directory"),
    ("tokenizer", "error: --tokenizer='{tmp}/none.model' does not exist. Fix: point it at a SentencePiece .model"),
    ("not_a_tokenizer", "error: {tmp}/c.txt is neither a SentencePiece model nor a Hugging Face tokenizer.json"),
    ("special_token", "error: --pad_token='<nope>' is not a token of "),
])
def test_bad_input_is_one_line_and_exit_2(case, message, tok_path, tmp_path):
    (tmp_path / "blank.txt").write_text("\n\n")
    (tmp_path / "c.txt").write_text("a document\n")
    args = {"input": f"{tmp_path}/c.txt", "tokenizer": tok_path, "output": f"{tmp_path}/out"}
    args.update({"no_match": {"input": f"{tmp_path}/missing-*.txt"}, "empty": {"input": f"{tmp_path}/blank.txt"},
                 "format": {"format": "csv"}, "output": {"output": f"{tmp_path}/blank.txt/out"},
                 "tokenizer": {"tokenizer": f"{tmp_path}/none.model"},
                 "not_a_tokenizer": {"tokenizer": f"{tmp_path}/c.txt"}, "special_token": {"pad_token": "<nope>"}}[case])
    result = pretokenize(*(f"--{k}={v}" for k, v in args.items()))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(tmp=tmp_path)), result.stderr
    assert result.stdout == ""


def test_one_document_per_file(tok_path, tmp_path):
    texts = {"b.txt": "second file\n\nwith a blank line\n", "a.txt": "first file, one line", "c.txt": ""}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    out = str(tmp_path / "out")
    result = pretokenize(f"--input={tmp_path}/*.txt", "--document_unit=file", f"--tokenizer={tok_path}",
                         f"--output={out}", "--workers=1")
    assert result.returncode == 0, result.stderr[-2000:]
    tok = Tokenizer.load(tok_path)
    expected = [tok.encode(texts[name]).tolist() for name in ("a.txt", "b.txt")]  # c.txt is empty: no document
    assert records(f"{out}/tokens-00000-of-00001.arrayrecord") == expected


@pytest.mark.slow  # starts the program
def test_a_chat_template_that_loops_without_end_stops_in_one_line(tmp_path):
    """--format=chat with a template whose nested range(100000) loops would run for hours: exit 2 within seconds,
    one line naming the template. Bug it caught: the sandbox bounded what a template touches, not how long it runs
    (pretokenize hung, no message)."""
    import time

    from tests.chat_data import tokenizer_dir

    tokenizer = tokenizer_dir(str(tmp_path / "tok"), "qwen", merges=False)
    template = tmp_path / "loop.jinja"
    template.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                        "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n")
    start = time.monotonic()
    result = pretokenize(f"--input={data}", "--format=chat", f"--tokenizer={tokenizer}", f"--chat_template={template}",
                         f"--output={tmp_path}/out", "--workers=1")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert f"the chat template of {template} took more than 1,000,000 steps" in lines[0]
    assert time.monotonic() - start < 60
