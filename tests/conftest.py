"""Test setup: 8 virtual CPU devices and fast compiles (tests/common.FAST_COMPILE) before JAX starts, one
compilation cache for the session, and parsed absl flags for grain workers."""
import os
import shutil
import tempfile

from tests.common import xla_flags  # starts no JAX backend, so the XLA_FLAGS set below still apply

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite starts the same small jobs again and again (resume, preemption, ownership tests); one
# persistent compilation cache for the session, inherited by every process a test starts, compiles
# each of their programs once. runtime/compile_cache.py keeps a directory set here, so the jobs use it
# instead of their workdir's (tests/test_compile_cache.py removes it to test that one).
_SESSION_CACHE = tempfile.mkdtemp(prefix="scone_jax_tests_compile_cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _SESSION_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    """The small config's 512-piece tokenizer, trained once for the whole session."""
    from scone_jax.training import assets
    from tests.common import small_config

    workdir = str(tmp_path_factory.mktemp("tok"))
    assets.ensure_tokenizer(small_config().data, workdir)
    return os.path.join(workdir, "tokenizer.model")


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A 500-piece tokenizer of 300 KJV paragraphs (the data tests' own), trained once per session."""
    from scone_jax.data import corpus, tokenizer_training

    path = tmp_path_factory.mktemp("tok") / "kjv500.model"
    return tokenizer_training.train_tokenizer(corpus.kjv_documents("train", 0.02)[:300], str(path), vocab_size=500)


@pytest.fixture(scope="module")
def bucket():
    """A GCS bucket URL (gs://...) served by the local emulator on loopback for one test module."""
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator (the [test] extra)")
    from tests import gcs_emulator

    with gcs_emulator.running() as url:
        yield url


def pytest_sessionstart(session):
    """The CLIs' filter on the asyncio logger of this process too: the tests that fail a checkpoint write in
    process leave orbax's abandoned write tasks behind, and their 'exception was never retrieved' tracebacks
    (a hundred or more) printed when a worker exited, outside any test's captured output."""
    import logging

    from scone_jax.runtime import logs

    logging.getLogger("asyncio").addFilter(logs._QuietLibraries())


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes or runs whole jobs; `-m 'not slow'` is the fast tier")


def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort, so the order stays deterministic, as pytest-xdist requires): xdist hands
    items out in this order, so the long jobs start at once and the short ones fill the workers' tails."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
