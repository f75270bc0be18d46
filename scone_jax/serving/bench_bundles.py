"""What the serving benchmarks build: a SCONE run to export, and bundles holding only a table, of any size.

Used by tools/bench_serving.py, tools/bench_table_io.py and tests/test_disk_table.py; a package module so that
scripts and tests import it as they import the rest, with no script importing another.
"""
import json
import os

from scone_jax.config import base_config
from scone_jax.data import corpus, tokenizer_training
from scone_jax.serving import bundle, table_layout
from scone_jax.training import run as run_lib


def make_run(root: str, quick: bool):
    """A SCONE run directory with a checkpoint of the initial state, built by the run builder as training builds it."""
    tokenizer = tokenizer_training.train_tokenizer(corpus.kjv_documents("train", 0.02)[:3000],
                                              os.path.join(root, "tokenizer.model"), 1024, model_type="bpe")
    c = base_config()
    c.model.update(dict(vocab_size=1024, d_model=64 if quick else 256, num_layers=2 if quick else 4, num_heads=4,
                        d_ff=256 if quick else 1024, max_seq_len=128, init_std=0.2))
    c.data.update(dict(tokenizer_path=tokenizer.path, seq_len=64 if quick else 128, global_batch_size=16))
    c.scone.update(dict(enabled=True, max_len=4, num_fgrams=8000 if quick else 100_000, min_count=3,
                        fgram_capacity=1024 if quick else 2048, num_layers=1 if quick else 4,
                        extract_max_tokens=300_000 if quick else 3_000_000))
    workdir = os.path.join(root, "run")
    tokenizer, vocab = run_lib.save_initial_state(c, workdir, 1)  # trains nothing: the initial state, saved
    return c, workdir, tokenizer, vocab


def write_table_bundle(path: str, rows_of, num_rows: int, width: int, dtype: str, chunk_rows: int) -> dict:
    """A bundle holding only a table (export.json, table files, COMPLETE: what open_table reads), written with
    the export's own table_layout; rows_of(lo, hi) gives rows lo..hi-1. Returns its export.json."""
    np_dtype = bundle.numpy_dtype(dtype)
    meta = {"format": bundle.FORMAT, "version": bundle.VERSION, "num_fgrams": num_rows, "d_model": width, "max_len": 2,
            "dtype": dtype, "chunk_rows": chunk_rows,
            "block_rows": table_layout.block_rows_for(width * np_dtype.itemsize, chunk_rows), "step": 0, "config": {},
            "model_fingerprint": "", "fgram_model_fingerprint": None, "tokenizer_fingerprint": "",
            "fgram_vocab_fingerprint": ""}  # a table with no model: fingerprints of nothing
    layout = table_layout.Layout.of_meta(meta, np_dtype)
    os.makedirs(os.path.join(path, bundle.TABLE), exist_ok=True)
    sums = []
    for c in range(layout.num_chunks):
        data, rows_crc, index_crc = layout.encode(rows_of(*layout.rows_of_chunk(c)))
        with open(os.path.join(path, bundle.chunk_key(c)), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: as after a reboot
        sums.append((rows_crc, index_crc))
    with open(os.path.join(path, bundle.META), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(path, bundle.COMPLETE), "wb") as f:
        f.write(bundle.complete_marker(meta, [s[0] for s in sums], [s[1] for s in sums], {}))
    return meta
