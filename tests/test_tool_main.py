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
