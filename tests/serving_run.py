"""One tiny trained SCONE run and its export, made once per test session and shared by the
export, table, evaluate, generate, integrity and GCS tests (module globals outlive each test module).
Under pytest-xdist the workers of a session share them too: the first to need one builds it in the
session's directory under a file lock and marks it done; the others wait on the lock and open it. Tests
only read them (a test that damages one works on copy_of)."""
import contextlib
import fcntl
import json
import os
import shutil

from scone_jax.data import corpus
from scone_jax.runtime.crc import crc32_hex
from scone_jax.serving import bundle, export, table as table_lib
from scone_jax.training import assets, run as run_lib
from tests.common import small_config

_CACHE = {}


def ram_table(path: str, expect: dict | None = None) -> table_lib.HostTable:
    """The table of the finished export at `path`, whole in RAM."""
    return table_lib.open_table(bundle.Bundle.open(path, expect), table="ram")


def scone_config(tokenizer_path):
    # init_std 0.5: an untrained model whose logits are far from uniform, so a wrong input embedding
    # shows in the perplexity (at 0.02 every variant scores ~ln(vocab)).
    config = small_config(init_std=0.5)
    config.data.tokenizer_path = tokenizer_path
    config.train.update(dict(num_steps=2, checkpoint_every=2, log_every=1))
    config.scone.update(dict(enabled=True, max_len=4, num_fgrams=2000, min_count=3, fgram_capacity=64,
                             num_layers=1, extract_max_tokens=200_000))
    return config


@contextlib.contextmanager
def _built_once(tmp_path_factory, name: str):
    """Yields (directory, whether this process must build it): `name` in the directory every worker of the
    session shares, held under its lock until the block ends; done once a block that built it ends cleanly."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/popen-gwK: pytest-N
    path = root / f"shared_{name}"
    with open(root / f"shared_{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = path / "DONE"
        build = not done.exists()
        if build:
            shutil.rmtree(path, ignore_errors=True)  # what a worker that failed while building left
            path.mkdir()
        yield str(path), build
        done.touch()


def trained_run(tmp_path_factory) -> dict:
    """{'workdir', 'config', 'tokenizer', 'vocab'}: a SCONE run directory as train.run leaves it,
    with a checkpoint of the initial state (training steps would only cost compile time here)."""
    if "run" not in _CACHE:
        with _built_once(tmp_path_factory, "scone_run") as (root, build):
            tokenizer = assets.ensure_tokenizer(small_config().data, os.path.join(root, "tok"))
            config = scone_config(tokenizer.path)
            workdir = os.path.join(root, "run")
            if build:
                tokenizer, vocab = run_lib.save_initial_state(config, workdir, 1)
            else:  # what the run's build restores for an existing run: its tokenizer, vocab size and f-grams
                tokenizer = assets.existing_tokenizer(config.data, workdir)
                assets.resolve_vocab_size(config, tokenizer)
                vocab = assets.existing_vocab(config.scone, tokenizer, workdir)
        _CACHE["run"] = {"workdir": workdir, "config": config, "tokenizer": tokenizer, "vocab": vocab}
    return _CACHE["run"]


def exported_variant(tmp_path_factory, name: str, table_dtype: str = "float32", **model_overrides) -> str:
    """Another architecture (model_overrides, e.g. position='rope', norm='rmsnorm', mlp='swiglu',
    dtype='bfloat16') with the shared run's tokenizer and f-gram vocabulary, checkpointed at its
    initial state and exported (once per `name`). The vocabulary is reused through scone.vocab_path,
    so only the model's init and the table's computation are paid again."""
    key = "variant_" + name
    if key not in _CACHE:
        run = trained_run(tmp_path_factory)
        config = scone_config(run["tokenizer"].path)
        with config.unlocked():
            config.model.update(model_overrides)
            config.model.vocab_size = run["config"].model.vocab_size
            config.scone.vocab_path = os.path.join(run["workdir"], "fgrams")
        root = tmp_path_factory.mktemp("variant_" + name)
        workdir = str(root / "run")
        run_lib.save_initial_state(config, workdir, 1)
        path = str(root / "export")
        export.export(workdir, path, dtype=table_dtype, chunk_rows=64, batch_rows=512)
        _CACHE[key] = path
    return _CACHE[key]


def eval_text(tmp_path_factory, num_docs: int = 40) -> str:
    """A small held-out text file (one KJV verse per line) for the data.source=text path."""
    if "eval_text" not in _CACHE:
        path = tmp_path_factory.mktemp("eval_text") / "held_out.txt"
        path.write_text("\n".join(corpus.kjv_documents("eval", 0.02)[:num_docs]) + "\n")
        _CACHE["eval_text"] = str(path)
    return _CACHE["eval_text"]


def exported(tmp_path_factory, dtype: str) -> str:
    """The run exported with a `dtype` table into a local directory (once per dtype)."""
    key = "export_" + dtype
    if key not in _CACHE:
        run = trained_run(tmp_path_factory)
        with _built_once(tmp_path_factory, key) as (root, build):
            path = os.path.join(root, dtype)
            if build:
                export.export(run["workdir"], path, dtype=dtype, chunk_rows=64, batch_rows=512)
        _CACHE[key] = path
    return _CACHE[key]


def reseal(path: str) -> None:
    """Rewrite COMPLETE with the CRCs of the decoder files and tokenizer.model now on disk, as if whoever
    swapped or removed a file had also forged the seal: what remains to catch it is what the files mean
    (the parameters' fingerprint) or whether they can be read at all."""
    with open(os.path.join(path, bundle.META)) as f:
        meta = json.load(f)
    with open(os.path.join(path, bundle.COMPLETE)) as f:
        record = json.load(f)
    files = bundle.file_checksums(path, bundle.DECODER)
    with open(os.path.join(path, bundle.TOKENIZER), "rb") as f:
        files[bundle.TOKENIZER] = crc32_hex(f.read())
    with open(os.path.join(path, bundle.COMPLETE), "wb") as f:
        f.write(bundle.complete_marker(meta, record["table"], record["table_index"], files))


def copy_of(bundle_path: str, tmp_path) -> str:
    """A copy of the export at `bundle_path` in the test's own directory, to damage or change."""
    path = str(tmp_path / "bundle")
    shutil.copytree(bundle_path, path)
    return path


def read_json(path: str, name: str):
    with open(os.path.join(path, name)) as f:
        return json.load(f)
