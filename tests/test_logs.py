"""The CLIs' console filter (runtime/logs.py): our lines as they are, libraries' warnings as one
line, and none of the echoes of a failed checkpoint write that the run already reports."""
import logging

from scone_jax.runtime import logs


def _record(name, level, msg, pathname="/site-packages/lib/x.py"):
    return logging.LogRecord(name, level, pathname, 1, msg, None, None)


def test_failed_save_echoes_are_dropped_and_other_library_records_kept_as_one_line():
    """The gather case was seen in CI: a failed save also logged '_GatheringFuture exception was
    never retrieved' twice (its future names no orbax frame), which the earlier filter let through."""
    quiet = logs._QuietLibraries()
    ours = _record("absl", logging.INFO, "step 3 loss 2.5", "/work/scone_jax/training/train.py")
    assert quiet.filter(ours) and ours.getMessage() == "step 3 loss 2.5"
    assert not quiet.filter(_record("absl", logging.INFO, "saving"))
    assert not quiet.filter(_record("absl", logging.ERROR, "write failed", "/x/orbax/checkpoint/a.py"))
    assert not quiet.filter(_record("asyncio", logging.ERROR, "Task exception was never retrieved\nfuture: <Task "
                                    "finished coro=<f() done, defined at /x/orbax/checkpoint/b.py:3>>"))
    assert not quiet.filter(_record("asyncio", logging.ERROR, "_GatheringFuture exception was never retrieved\n"
                                    "future: <_GatheringFuture finished exception=ValueError('File too large')>"))
    other = _record("asyncio", logging.ERROR, "Task exception was never retrieved\nfuture: <Task finished "
                    "coro=<mine() defined at /home/u/tool.py:9>>")
    assert quiet.filter(other) and other.getMessage() == "Task exception was never retrieved"
    warning = _record("grain", logging.WARNING, "slow worker\ndetails")
    assert quiet.filter(warning) and warning.getMessage() == "slow worker"


def test_the_log_file_keeps_what_the_console_leaves_out(tmp_path):
    """--log_dir's file gets the libraries' INFO lines and whole multi-line messages, while the console
    filter drops or shortens them. Bug it caught: the file handler ran after the console's filter, which
    shortens the record itself, so the file got first lines only."""
    import io

    root = logging.getLogger()
    console = logging.StreamHandler(io.StringIO())
    console.addFilter(logs._QuietLibraries())
    root.addHandler(console)
    level = root.level
    root.setLevel(logging.INFO)
    path = logs.write_full_log(str(tmp_path / "logs"))
    file_handler = root.handlers[0]
    try:
        library = logging.getLogger("orbax_like_library")
        library.info("Finished saving checkpoint to /ckpt/7")
        library.warning("slow worker\nsecond line of details")
        logging.getLogger("absl").handle(_record("absl", logging.INFO, "step 3 loss 2.5",
                                                 "/work/scone_jax/training/train.py"))
    finally:
        root.removeHandler(file_handler)
        file_handler.close()
        root.removeHandler(console)
        root.setLevel(level)
    shown = console.stream.getvalue()
    assert "Finished saving" not in shown and "second line" not in shown and "slow worker" in shown
    written = open(path).read()
    assert "Finished saving checkpoint to /ckpt/7" in written
    assert "slow worker\nsecond line of details" in written and "step 3 loss 2.5" in written

