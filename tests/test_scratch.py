"""Scratch cleaning (runtime/parent_watch.remove_stale_scratch, run by f-gram extraction and pretokenize at
start): a killed run's scratch is removed, a live run's never, wherever that run is."""
import os
import socket
import tempfile

from scone_jax.runtime import parent_watch


def _pid_of_no_process() -> int:
    """A process id no process can have here (above the kernel's pid_max): a run that is gone."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


def _scratch(parent, name: str):
    path = parent / name
    path.mkdir()
    (path / "corpus.i32").write_bytes(b"\x01\x00\x00\x00" * 4)
    return path


def test_stale_scratch_cleaning_removes_dead_runs_scratch_and_never_a_live_runs(tmp_path):
    """Caught: the host left out of the check (what the code did before names carried it), so the scratch of a
    live run on another machine sharing the directory (or in another container sharing /tmp), whose pid means
    nothing here, was deleted under it; the liveness test inverted (`process_alive(pid)`)."""
    host, gone = socket.gethostname(), _pid_of_no_process()
    assert parent_watch.scratch_name("fgrams") == f"fgrams-{os.getpid()}-{host}-"  # the names made below
    stale = [_scratch(tmp_path, f"fgrams-{gone}-{host}-k1ll3d"),  # a killed run of this host
             _scratch(tmp_path, f"fgrams-{gone}-ab_cd9ef")]  # one of an older version (no host in its name)
    live = [_scratch(tmp_path, f"fgrams-{os.getppid()}-{host}-l1ve0001"),  # a live run of this host
            _scratch(tmp_path, f"fgrams-{gone}-node-7.cluster.example-l1ve0002"),  # a run on another machine
            _scratch(tmp_path, f"tokens-{gone}-{host}-0ther001"),  # another program's
            _scratch(tmp_path, f"fgrams-x{gone}-{host}-0ther002")]  # not a scratch name
    own = tempfile.mkdtemp(dir=tmp_path, prefix=parent_watch.scratch_name("fgrams"))  # this process's, as made

    removed = parent_watch.remove_stale_scratch(str(tmp_path), "fgrams")

    assert sorted(removed) == sorted(str(p) for p in stale) and not any(p.exists() for p in stale)
    for path in live:
        assert (path / "corpus.i32").read_bytes() == b"\x01\x00\x00\x00" * 4, path
    assert os.path.isdir(own)
    assert parent_watch.remove_stale_scratch(str(tmp_path), "fgrams") == []


def test_a_live_run_of_another_user_keeps_its_scratch(tmp_path, monkeypatch):
    """kill(pid, 0) answers EPERM for another user's process: it is alive. Caught: EPERM taken for a dead pid."""
    other_user, real_kill = _pid_of_no_process(), os.kill

    def kill(pid, sig):
        if pid == other_user:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    path = _scratch(tmp_path, f"fgrams-{other_user}-{socket.gethostname()}-l1ve0003")
    assert parent_watch.remove_stale_scratch(str(tmp_path), "fgrams") == [] and path.exists()
