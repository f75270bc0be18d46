"""runtime/tool_main.py's pieces that the programs' own tests do not reach."""
import os

import pytest

from scone_jax.runtime import tool_main


def test_a_result_write_that_fails_leaves_the_previous_result_and_no_temporary(tmp_path):
    """A write stopped midway (here a value JSON cannot hold; a full disk or a signal alike) keeps the previous
    result whole and leaves nothing beside it. Caught: the `.result-*` temporary left behind."""
    path = tmp_path / "result.json"
    path.write_text('{"perplexity": 12.5}')
    with pytest.raises(TypeError):
        tool_main.write_result(str(path), {"perplexity": object()})
    assert path.read_text() == '{"perplexity": 12.5}' and os.listdir(tmp_path) == ["result.json"]
    tool_main.write_result(str(path), {"perplexity": 11.0})
    assert path.read_text() == '{\n "perplexity": 11.0\n}' and os.listdir(tmp_path) == ["result.json"]


def test_the_handlers_a_program_replaced_are_back_when_it_returns():
    """main_of installs its SIGINT / SIGTERM handlers for the run only: a caller (a test, a program that runs two
    bodies) gets its own back, whether the body returns or fails. Caught: the handlers left in place (found by
    tools/mutate_diff.py: `is not None` flipped, nothing restored, no test failed)."""
    import signal

    def mine(signum, frame):
        del signum, frame

    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        tool_main.main_of(lambda: None, "tool")(["tool"])
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
        with pytest.raises(SystemExit):
            tool_main.main_of(lambda: (_ for _ in ()).throw(ValueError("bad")), "tool")(["tool"])
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
