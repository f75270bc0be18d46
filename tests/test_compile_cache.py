"""The persistent compilation cache (runtime/compile_cache.py): where it lives, how a gs:// cache is
copied, that it heals itself, and that a restarted job loads its traced and compiled step from the workdir
instead of tracing and compiling it (tests/test_exported_step.py checks the traced step's key and its results)."""
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from scone_jax.runtime import compile_cache, storage
from scone_jax.training import exported_step
from tests.common import record_list, run_main, step_records

_JAX_CACHE_FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                    "jax_persistent_cache_min_entry_size_bytes", "jax_persistent_cache_enable_xla_caches")


@pytest.fixture
def new_process(monkeypatch):
    """This process without the suite's session cache (JAX_COMPILATION_CACHE_DIR, conftest.py), which would
    short-circuit the code under test; restored after. Calling it forgets the cache JAX was pointed at and the
    executables it holds in memory, as a new process starts."""
    saved = {name: jax.config.values[name] for name in _JAX_CACHE_FLAGS}
    for name in [name for name in os.environ if name.startswith("JAX_COMPILATION_CACHE")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(compile_cache, "_MIN_COMPILE_S", 0.0)  # the tests' tiny programs get entries too

    def restart():
        jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)
        jax.clear_caches()

    restart()
    yield restart
    jax_cache.reset_cache()
    for name, value in saved.items():
        jax.config.update(name, value)


def two(x):
    return x + 1, x * 2


def three(x):
    return x + 1, x * 2, x * 3


def _entry(directory, function) -> str:
    [name] = [n for n in os.listdir(directory) if n.startswith(f"jit_{function.__name__}-")]
    return os.path.join(directory, name)


def _files(directory) -> dict:
    return {n: os.stat(os.path.join(directory, n)).st_mtime_ns for n in os.listdir(directory)}


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


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


def test_a_cache_directory_under_a_regular_file_is_refused_in_one_line(tmp_path, new_process):
    """A cache path through a regular file (or the file itself) is bad input: one line naming the flag, the path
    and the fix (main.py and tool_main turn ValueError into exit 2), and the cache stays off. Caught: the directory
    created unguarded (NotADirectoryError: a 33-line traceback, exit 1)."""
    (tmp_path / "file").write_text("not a directory")
    for directory in (tmp_path / "file" / "cache", tmp_path / "file"):
        with pytest.raises(ValueError) as error:
            compile_cache.CompileCache(str(directory), flag="--compilation_cache_dir")
        message = str(error.value)
        assert "\n" not in message and str(directory) in message
        assert message.startswith("--compilation_cache_dir: ") and "Fix: point --compilation_cache_dir at" in message
    assert jax.config.jax_compilation_cache_dir is None


def test_heal_removes_the_entries_jax_cannot_read_and_the_files_of_dead_writers(tmp_path, new_process):
    """Empty entries and entries cut short (a full disk) go, so do `.tmp-<pid>` files of processes that are gone;
    whole entries, other files, a live writer's file and XLA's directories stay. Caught: heal without reading the
    entries back (the cut-short one kept), and one that removed every temporary file (a live writer's too)."""
    cache = tmp_path / "cache"
    compile_cache.CompileCache(str(cache))
    jax.jit(two).lower(jnp.ones(4)).compile()
    whole = open(_entry(cache, two), "rb").read()
    (cache / "jit_empty-1-cache").write_bytes(b"")
    (cache / "jit_cut-2-cache").write_bytes(whole[: len(whole) // 2])
    (cache / "jit_cut-2-atime").write_bytes(bytes(8))
    (cache / ".lockfile").write_bytes(b"")
    (cache / "xla_gpu_per_fusion_autotune_cache_dir").mkdir()
    dead, alive = _dead_pid(), os.getppid()
    (cache / f"{exported_step.PREFIX}a.tmp-{dead}").write_bytes(b"half written")
    (cache / f"{exported_step.PREFIX}b.tmp-{alive}").write_bytes(b"being written")
    (cache / f"{exported_step.PREFIX}c").write_bytes(b"an exported step")
    removed = ["jit_cut-2-cache", "jit_empty-1-cache", f"{exported_step.PREFIX}a.tmp-{dead}"]
    assert compile_cache.heal(str(cache)) == removed
    assert compile_cache.heal(str(cache)) == []
    assert open(_entry(cache, two), "rb").read() == whole


def test_an_entry_cut_short_costs_one_recompile_not_every_start(tmp_path, new_process):
    """JAX never overwrites an entry, so one a full disk cut short would be recompiled at every start: a start
    removes it, compiles once and writes it whole, and the next start loads it. Caught: CompileCache without heal
    (the damaged entry stayed and every start compiled)."""
    cache, x = str(tmp_path / "cache"), jnp.arange(4.0)
    compile_cache.CompileCache(cache)
    jax.jit(two)(x)
    path = _entry(cache, two)
    whole = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(whole[:100])

    new_process()
    compile_cache.CompileCache(cache)
    np.testing.assert_array_equal(jax.jit(two)(x)[1], 2 * np.arange(4.0))
    assert compile_cache.heal(cache) == [] and os.path.getsize(path) > 100  # written whole again

    new_process()
    compile_cache.CompileCache(cache)
    before = _files(cache)
    jax.jit(two)(x)
    assert _files(cache) == before  # loaded: nothing written


def test_an_entry_holding_another_program_is_a_miss_that_replaces_it(tmp_path, new_process):
    """A cache entry that reads but holds another program (a copied file) made JAX fail on every start with an
    AssertionError: it is a miss now, compiled afresh, and its entry replaced so the next start loads it.
    Caught: compile() that compiled again without removing the entry (JAX loaded the same one and failed again)."""
    cache, x = str(tmp_path / "cache"), jnp.arange(4.0)
    compile_cache.CompileCache(cache)
    jax.jit(two).lower(x).compile()
    jax.jit(three).lower(x).compile()
    shutil.copyfile(_entry(cache, three), _entry(cache, two))
    foreign = open(_entry(cache, two), "rb").read()

    new_process()
    compile_cache.CompileCache(cache)
    with pytest.raises(AssertionError):  # what JAX does with it
        jax.jit(two).lower(x).compile()
    jax.clear_caches()
    got = compile_cache.compile(jax.jit(two).lower(x))(x)
    np.testing.assert_array_equal(got[1], 2 * np.arange(4.0))
    assert len(got) == 2 and open(_entry(cache, two), "rb").read() != foreign

    new_process()
    compile_cache.CompileCache(cache)
    before = _files(cache)
    assert len(compile_cache.compile(jax.jit(two).lower(x))(x)) == 2
    assert _files(cache) == before  # loaded: nothing written


@pytest.mark.slow  # starts the GCS emulator
def test_a_gs_cache_is_found_by_the_next_start_which_sends_back_only_new_entries(bucket, tmp_path, new_process):
    """A gs:// cache through the emulator, start after start in this process (the suite's own cache unset). The
    first start's entry is copied back; a damaged copy of it is not copied in, so the next start compiles it once
    and sends it back whole; a third start loads it and sends nothing (an entry changed remotely stays as it is).
    The local copies go at close, and one a killed process left goes at start. Caught: JAX's keys holding the
    local copy's path (a new one at each start, so nothing copied in was ever found); the mirror sending back the
    entries it had copied in."""
    remote, x = f"{bucket}/runs/compile_cache", jnp.arange(4.0)
    with compile_cache.CompileCache(remote) as cache:
        local = jax.config.jax_compilation_cache_dir
        assert os.path.basename(local).startswith(f"scone_jax_compile_cache-{os.getpid()}-")
        jax.jit(two)(x)
        [name] = [n for n in os.listdir(local) if n.startswith("jit_two-")]
        whole = open(os.path.join(local, name), "rb").read()
    assert not os.path.exists(local) and jax.config.jax_compilation_cache_dir is None and cache.directory == remote
    assert storage.read_bytes(remote, name) == whole

    storage.write_bytes(remote, name, whole[: len(whole) // 2])  # cut short
    storage.write_bytes(remote, "jit_other-1-cache", open(__file__, "rb").read())  # not an entry JAX can read
    left = os.path.join(os.path.dirname(local), f"scone_jax_compile_cache-{_dead_pid()}-abc")
    os.makedirs(left)
    new_process()
    with compile_cache.CompileCache(remote):
        local = jax.config.jax_compilation_cache_dir
        assert not os.path.exists(left)
        assert os.listdir(local) == []  # both were damaged
        jax.jit(two)(x)
    assert storage.read_bytes(remote, name) != whole[: len(whole) // 2]  # sent back: the next start copies it in

    storage.write_bytes(remote, "jit_other-1-cache", whole)  # readable now: copied in
    new_process()
    with compile_cache.CompileCache(remote):
        local = jax.config.jax_compilation_cache_dir
        assert sorted(os.listdir(local)) == sorted(["jit_other-1-cache", name])
        storage.write_bytes(remote, "jit_other-1-cache", b"changed remotely")
        before = _files(local)
        jax.jit(two)(x)
        assert _files(local) == before  # found: nothing compiled or written
    assert storage.read_bytes(remote, "jit_other-1-cache") == b"changed remotely"


def _without_session_cache():
    """The suite shares one cache (conftest.py); these runs must use their workdir's own."""
    return {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("JAX_COMPILATION_CACHE")}


@pytest.mark.slow
def test_a_restart_loads_its_compiled_step_from_the_workdir_and_heals_a_damaged_cache(tmp_path, tokenizer_path):
    """A job stopped after step 1 and restarted finds the train step in WORKDIR/compilation_cache: the entry
    is read, not written again. Then the cache is damaged as a full disk and a copied file leave it (an entry cut
    short, an empty one, a dead writer's temporary file, another program's executable under the train step's
    name): the third start runs without a traceback, and leaves every entry readable, the train step's its own.
    Bugs it caught: a relative train.compilation_cache_dir taken relative to the working directory instead of the
    workdir (the cache landed wherever the job was started from, so a pod's restarted workers missed it); the
    exported step's first compile not through compile_cache.compile (JAX's `AssertionError: (63, 68)`, exit 1)."""
    saved = _without_session_cache()
    try:
        config = f"tests/small_config.py:{tokenizer_path}"
        args = ["--config.train.num_steps=3", "--config.train.checkpoint_every=1", "--config.train.eval_every=0"]
        restarted = str(tmp_path / "restarted")
        first = run_main(restarted, *args, "--config.train.max_steps_per_run=1", config=config)
        assert first.returncode == 0, first.stderr[-3000:]
        cache = os.path.join(restarted, "compilation_cache")
        steps = [n for n in os.listdir(cache) if n.startswith("jit_train_step-")]
        assert len(steps) == 1, os.listdir(cache)
        exported = [n for n in os.listdir(cache) if n.startswith(exported_step.PREFIX)]
        assert len(exported) == 1, os.listdir(cache)  # the traced step (training/exported_step.py)
        written = os.stat(os.path.join(cache, steps[0])).st_mtime_ns
        second = run_main(restarted, *args, "--config.train.max_steps_per_run=1", config=config)
        assert second.returncode == 0, second.stderr[-3000:]
        assert [n for n in os.listdir(cache) if n.startswith("jit_train_step-")] == steps
        assert os.stat(os.path.join(cache, steps[0])).st_mtime_ns == written  # loaded, not compiled again
        assert "Train step: the traced program loaded from" in second.stderr  # and not traced again

        train_step = os.path.join(cache, steps[0])
        [other] = sorted(n for n in os.listdir(cache) if n.endswith("-cache") and n != steps[0])[:1]
        shutil.copyfile(os.path.join(cache, other), train_step)
        foreign = open(train_step, "rb").read()
        with open(os.path.join(cache, other), "r+b") as f:
            f.truncate(len(foreign) // 2)
        open(os.path.join(cache, "jit_empty-0-cache"), "wb").close()
        temporary = f"{exported[0]}.tmp-{_dead_pid()}"
        open(os.path.join(cache, temporary), "wb").close()
        third = run_main(restarted, *args, config=config)
        assert third.returncode == 0 and "Traceback" not in third.stderr, third.stderr[-3000:]
        assert f"{other}, jit_empty-0-cache, {temporary}" in third.stderr  # what heal removed, in one line
        assert "Compilation cache: the program loaded from" in third.stderr  # the foreign one: a miss
        assert compile_cache.heal(cache) == [] and open(train_step, "rb").read() != foreign
        assert other in os.listdir(cache)  # compiled again and written whole

        # The resumed step equals training it without interruption: test_train's resume tests check that (they
        # run with the suite's shared cache); here the steps of all starts are in one metrics history.
        assert sorted(step_records(restarted)) == [1, 2, 3]
        # Each start records how long its first step took, from the process's start.
        startups = record_list(restarted, "startup")
        assert [r["step"] for r in startups] == [1, 2, 3] and all(0 < r["first_step_s"] < 600 for r in startups)
    finally:
        os.environ.update(saved)


@pytest.mark.slow
def test_the_job_refuses_a_cache_under_a_regular_file_with_exit_2(tmp_path, tokenizer_path):
    """`train.compilation_cache_dir` through a regular file: one line naming the key and the fix, exit 2, before
    any work. Caught: the directory created unguarded (a NotADirectoryError traceback, exit 1)."""
    saved = _without_session_cache()
    try:
        (tmp_path / "file").write_text("not a directory")
        run = run_main(str(tmp_path / "run"), f"--config.train.compilation_cache_dir={tmp_path / 'file' / 'cache'}",
                       config=f"tests/small_config.py:{tokenizer_path}")
    finally:
        os.environ.update(saved)
    lines = [line for line in run.stderr.splitlines() if not line[:1] in "IWD"]  # absl's log lines aside
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("scone_jax: error: train.compilation_cache_dir: ") and "Fix: point" in lines[0]
