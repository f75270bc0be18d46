"""tools/bench_table_io.py's flags: each bad value is one line and exit 2 before a file is written (8 of 10 were
tracebacks), and a filesystem without O_DIRECT gets the note evaluate gives instead of an EINVAL traceback."""
import errno
import os
import shutil
import subprocess
import sys

import pytest

from scone_jax.serving import table_files
from tests.common import REPO, run_tool

pytestmark = pytest.mark.slow  # every test here starts a process

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
LEAST = 8 * 4096 * 1024  # --quick: 8 batches of 4,096 rows of the d = 2048 table, a quarter of 4x the budget


@pytest.fixture(scope="module")
def bench():
    """tools/bench_table_io.py as a module (its flags join this process's; no other module defines them)."""
    import importlib

    return importlib.import_module("tools.bench_table_io")


def test_every_bad_value_of_dir_and_ram_bytes_is_one_line(bench, tmp_path):
    """Each value the checks refuse, with the words of its line, before a file is written. Caught (each seen):
    --dir missing or a file (FileNotFoundError / NotADirectoryError tracebacks from mkdtemp), unwritable
    (PermissionError), a negative or tiny --ram_bytes (a traceback from numpy after the raw file was written),
    one beyond the machine's RAM (the raw file written until the disk filled)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    fresh = tmp_path / "measured"
    fresh.mkdir()
    for directory, words in [(tmp_path / "missing", "does not exist. Fix: an existing directory"),
                             (blocker, "is not a directory"), ("/proc/self", "cannot be written")]:
        with pytest.raises(ValueError, match=f"--dir={directory} {words}"):
            bench.checked_dir(str(directory))
    assert bench.checked_dir(str(fresh)) == str(fresh) and bench.checked_dir("")
    for ram, quick, words in [(-1, True, "--ram_bytes=-1 is negative. Fix: the RAM the benchmark may use"),
                              (1, True, f"--ram_bytes=1 is below the {LEAST:,} bytes the benchmark needs with --quick"),
                              (LEAST, False, f"--ram_bytes={LEAST:,} is below the {3 * LEAST:,} bytes the benchmark needs:"),
                              (2 * PHYSICAL, False, f"is more than this machine's {PHYSICAL:,} bytes of RAM")]:
        with pytest.raises(ValueError, match=words):
            bench.checked_ram(str(fresh), ram, quick)
    free = shutil.disk_usage(fresh).free
    if LEAST <= free // 12 + 4096 <= PHYSICAL:  # a budget RAM allows but the disk cannot hold
        with pytest.raises(ValueError, match=f"bytes of files at once on the disk of {fresh}"):
            bench.checked_ram(str(fresh), free // 12 + 4096, True)
    assert bench.checked_ram(str(fresh), 0, True) == 64 << 20 and bench.checked_ram(str(fresh), LEAST, True) == LEAST
    assert os.listdir(fresh) == []


@pytest.mark.parametrize("flags,words", [
    (["--dir=/proc/self"], "--dir=/proc/self cannot be written"),
    (["--quick", "--ram_bytes=-5"], "--ram_bytes=-5 is negative"),
    (["--quick=maybe", "--tensorstore=x"], "flag --quick=maybe"),
    (["--nonsense=1"], "Unknown command line flag 'nonsense'"),
])
def test_the_program_refuses_in_one_line_with_exit_2(flags, words):
    """The checks reach the command line: one line, exit 2. Caught: app.run (a traceback for the checks' ValueError;
    absl's usage dump and exit 1 for a flag that does not parse)."""
    result = run_tool("tools/bench_table_io.py", flags, timeout=120)
    assert result.returncode == 2, (flags, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_table_io: error: ") and words in lines[0], result.stderr


def test_a_filesystem_without_o_direct_gets_evaluates_note_and_buffered_reads(tmp_path):
    """The raw disk figures on a filesystem that refuses O_DIRECT (tmpfs before Linux 6.6; here os.open refuses it
    as such a filesystem does): the note evaluate gives, word for word, then the reads go through the page cache.
    Caught: the raw reads opened with O_DIRECT unconditionally (EINVAL traceback)."""
    data = tmp_path / "raw.bin"
    data.write_bytes(os.urandom(64 * 4096))
    code = f"""
import errno, os, sys
sys.argv = ["bench_table_io"]
import tools.bench_table_io as bench
real_open = os.open
def no_direct(name, flags, *args, **kwargs):
    if flags & os.O_DIRECT:
        raise OSError(errno.EINVAL, "Invalid argument", name)
    return real_open(name, flags, *args, **kwargs)
os.open = no_direct
direct = bench.direct_flag({str(data)!r})
print("flag", direct, "rate", bench.raw_reads_per_s({str(data)!r}, 200, 2, direct=direct) > 0,
      bench.raw_aio_reads_per_s({str(data)!r}, 200, 8, direct=direct) > 0)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["flag", "0", "rate", "True", "True"]
    assert result.stderr.strip() == table_files.no_direct_note(str(data), errno.EINVAL)
