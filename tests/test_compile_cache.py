"""The persistent compilation cache (runtime/compile_cache.py): where it lives, how a gs:// cache is
copied, and that a restarted job loads its traced and compiled step from the workdir instead of tracing
and compiling it (tests/test_exported_step.py checks the traced step's key and its results)."""
import os

import pytest

from scone_jax.runtime import compile_cache, storage
from scone_jax.training import exported_step
from tests.common import record_list, run_main, step_records


def test_the_cache_directory_is_inside_the_workdir_unless_given_whole():
    assert compile_cache.resolve("compilation_cache", "/runs/a") == "/runs/a/compilation_cache"
    assert compile_cache.resolve("compilation_cache", "gs://b/runs/a") == "gs://b/runs/a/compilation_cache"
    assert compile_cache.resolve("/shared/cache", "gs://b/runs/a") == "/shared/cache"
    assert compile_cache.resolve("gs://b/cache", "/runs/a") == "gs://b/cache"
    assert compile_cache.resolve("", "/runs/a") == ""  # off


def test_a_remote_cache_is_copied_in_and_only_new_entries_go_back(tmp_path):
    """The copy of a gs:// cache, through the same kvstore calls (here on a local directory). Bug it caught:
    the mirror uploaded every entry it had just downloaded again at its first round (skip_existing)."""
    remote = str(tmp_path / "remote")
    storage.write_bytes(remote, "jit_step-1-cache", b"step executable")
    storage.write_bytes(remote, "jit_eval-2-cache", b"eval executable")
    storage.write_bytes(remote, "nested/ignored", b"not a cache entry")
    local = str(tmp_path / "local")
    os.makedirs(local)
    assert compile_cache.copy_in(remote, local) == 2
    assert sorted(os.listdir(local)) == ["jit_eval-2-cache", "jit_step-1-cache"]
    assert open(os.path.join(local, "jit_step-1-cache"), "rb").read() == b"step executable"

    storage.write_bytes(remote, "jit_step-1-cache", b"changed remotely")  # must not be overwritten by the copy
    mirror = storage.DirectoryMirror(local, remote, every_s=3600, skip_existing=True)
    with open(os.path.join(local, "jit_new-3-cache"), "wb") as f:
        f.write(b"compiled by this run")
    assert mirror.close()
    assert storage.read_bytes(remote, "jit_new-3-cache") == b"compiled by this run"
    assert storage.read_bytes(remote, "jit_step-1-cache") == b"changed remotely"


def _without_session_cache():
    """The suite shares one cache (conftest.py); these runs must use their workdir's own."""
    return {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("JAX_COMPILATION_CACHE")}


@pytest.mark.slow
def test_a_restart_loads_its_compiled_step_from_the_workdir(tmp_path, tokenizer_path):
    """A job stopped after step 1 and restarted finds the train step in WORKDIR/compilation_cache: the entry
    is read, not written again. Bug it caught: a relative train.compilation_cache_dir taken relative to the
    working directory instead of the workdir (the cache landed wherever the job was started from, so a pod's
    restarted workers missed it)."""
    saved = _without_session_cache()
    try:
        config = f"tests/small_config.py:{tokenizer_path}"
        args = ["--config.train.num_steps=2", "--config.train.checkpoint_every=1", "--config.train.eval_every=0"]
        restarted = str(tmp_path / "restarted")
        first = run_main(restarted, *args, "--config.train.max_steps_per_run=1", config=config)
        assert first.returncode == 0, first.stderr[-3000:]
        cache = os.path.join(restarted, "compilation_cache")
        steps = [n for n in os.listdir(cache) if n.startswith("jit_train_step-")]
        assert len(steps) == 1, os.listdir(cache)
        exported = [n for n in os.listdir(cache) if n.startswith(exported_step.PREFIX)]
        assert len(exported) == 1, os.listdir(cache)  # the traced step (training/exported_step.py)
        written = os.stat(os.path.join(cache, steps[0])).st_mtime_ns
        second = run_main(restarted, *args, config=config)
        assert second.returncode == 0, second.stderr[-3000:]
        assert [n for n in os.listdir(cache) if n.startswith("jit_train_step-")] == steps
        assert os.stat(os.path.join(cache, steps[0])).st_mtime_ns == written  # loaded, not compiled again
        assert "Train step: the traced program loaded from" in second.stderr  # and not traced again

        # The resumed step equals training it without interruption: test_train's resume tests check that (they
        # run with the suite's shared cache); here the steps of both starts are in one metrics history.
        assert sorted(step_records(restarted)) == [1, 2]
        # Each start records how long its first step took, from the process's start.
        startups = record_list(restarted, "startup")
        assert [r["step"] for r in startups] == [1, 2] and all(0 < r["first_step_s"] < 600 for r in startups)
    finally:
        os.environ.update(saved)
