"""Named held-out sets (data/eval_sets.py): how data.eval_files is read, the refusals, and the training
loop's per-set evaluation against each set evaluated alone."""
import json
import math
import os
import re

import numpy as np
import pytest

from scone_jax import config as config_lib
from scone_jax.data import eval_sets
from tests.common import small_config


def test_unnamed_values_are_one_set_and_named_ones_are_the_sets():
    assert eval_sets.parse("") is None and eval_sets.parse("/d/a/*.txt,/d/b.txt") is None
    assert eval_sets.parse("web=/d/web/*.jsonl,/d/w2.jsonl; books = /d/books/*.jsonl.gz;") == {
        "web": "/d/web/*.jsonl,/d/w2.jsonl", "books": "/d/books/*.jsonl.gz"}
    config = small_config()
    config.data.eval_files = "/d/a/*.txt,/d/b.txt"
    config_lib.validate(config)
    assert eval_sets.configs(config.data) == {"": config.data} and config.data.eval_files == "/d/a/*.txt,/d/b.txt"
    config.data.eval_files = "web=/d/web/*.jsonl,/d/w2.jsonl; books = /d/books/*.jsonl.gz;"
    config_lib.validate(config)
    assert config.data.eval_files == "" and config.data.eval_sets.to_dict() == {
        "web": "/d/web/*.jsonl,/d/w2.jsonl", "books": "/d/books/*.jsonl.gz"}
    per_set = eval_sets.configs(config.data)
    assert list(per_set) == ["books", "web"]  # name order
    assert [(c.eval_files, dict(c.eval_sets)) for c in per_set.values()] == [
        ("/d/books/*.jsonl.gz", {}), ("/d/web/*.jsonl,/d/w2.jsonl", {})]


@pytest.mark.parametrize("value,message", [
    ("web=/a;web=/b", "the set name 'web' is used twice"),
    ("web=/a;books=", "the set 'books' names no files"),
    ("web=/a;/b/*.txt", "'/b/*.txt' has no name, but other sets do"),
    ("average=/a;web=/b", "the set name 'average' is reserved"),
])
def test_bad_set_lists_are_refused_before_anything_runs(value, message):
    config = small_config()
    config.data.eval_files = value
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        config_lib.validate(config)
    assert "Fix:" in str(e.value)


@pytest.mark.slow
def test_training_evaluates_each_named_set_as_alone_and_logs_the_average(tmp_path, tokenizer_path):
    from scone_jax import sharding
    from scone_jax.data import corpus
    from scone_jax.training import checkpoint, state as state_lib, train
    from scone_jax.data.tokenizer import Tokenizer
    from tests.common import record_list, training_graph_eval

    held_out = corpus.kjv_documents("eval", 0.02)
    files = {"train": corpus.kjv_documents("train", 0.02)[:2000], "first": held_out[:20], "second": held_out[20:50]}
    for name, docs in files.items():
        (tmp_path / f"{name}.txt").write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n")
    config = small_config()
    config.data.update(dict(source="text", train_files=str(tmp_path / "train.txt"), tokenizer_path=tokenizer_path,
                            eval_files=f"first={tmp_path / 'first.txt'};second={tmp_path / 'second.txt'}"))
    config.train.update(dict(num_steps=2, eval_every=2, eval_batches=0, checkpoint_every=2))
    workdir = str(tmp_path / "run")
    train.run(config, workdir)

    records = {name: record_list(workdir, f"eval/{name}") for name in ("first", "second", "average")}
    assert all(len(r) == 1 and r[0]["step"] == 2 for r in records.values()), records
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    state, _ = ckpt.restore(2, state_lib.abstract_with_shardings(spec))
    ckpt.close()
    tokenizer = Tokenizer.load(tokenizer_path)
    for name in ("first", "second"):
        alone_config = config.copy_and_resolve_references()
        with alone_config.unlocked():
            alone_config.data.eval_files, alone_config.data.eval_sets = str(tmp_path / f"{name}.txt"), {}
        alone = training_graph_eval(alone_config, tokenizer, state, mesh)
        got = records[name][0]
        assert got["tokens"] == alone["tokens"] > 500
        np.testing.assert_allclose(got["loss"], alone["loss"], rtol=1e-6)
        text_bytes = sum(len(line.encode()) for line in (tmp_path / f"{name}.txt").read_text().splitlines())
        np.testing.assert_allclose(got["bits_per_byte"], alone["loss"] * alone["tokens"] / math.log(2) / text_bytes,
                                   rtol=1e-6)
    average = records["average"][0]
    for key in ("loss", "perplexity", "bits_per_byte"):
        np.testing.assert_allclose(average[key], (records["first"][0][key] + records["second"][0][key]) / 2,
                                   rtol=1e-9)
    assert json.dumps(average)  # plain numbers in metrics.jsonl


def test_a_path_with_an_equals_sign_read_as_a_set_says_so_and_how_to_write_it(tmp_path, monkeypatch, tokenizer_path):
    """'run=3.txt' is the set 'run' of the files '3.txt' (NAME=GLOBS names a set). When that whole text is also a
    file, it is refused saying so and how to write the path ('./run=3.txt', which is that file); when the set's
    files match nothing, the held-out set's refusal names the set and the same fix. Caught: parse without its
    whole-path check (the set 'run' of 3.txt evaluated silently, here another file); open_set not called by
    HeldOut (a bare 'No files match the pattern 3.txt')."""
    from scone_jax.data.tokenizer import Tokenizer
    from scone_jax.training import evaluation

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run=3.txt").write_text("In the beginning God created the heaven and the earth.\n")
    (tmp_path / "3.txt").write_text("And the earth was without form, and void.\n")
    config = small_config()
    config.data.update(dict(source="text", eval_files="run=3.txt"))
    with pytest.raises(ValueError) as refused:
        config_lib.validate(config)
    assert str(refused.value) == (
        "data.eval_files: 'run=3.txt' names the set 'run' of the files '3.txt' (NAME=GLOBS names a set), but it is "
        "also a path. Fix: to give a path that contains '=', write it with its directory (a set's name has no '/'), "
        "e.g. './run=3.txt'.")
    config.data.eval_files = "./run=3.txt"
    config_lib.validate(config)
    assert config.data.eval_files == "./run=3.txt" and config.data.eval_sets.to_dict() == {}
    config.data.eval_files = "held=out.txt"  # no such file: a set whose files match nothing
    config_lib.validate(config)
    with pytest.raises(FileNotFoundError) as missing:
        evaluation.HeldOut(config.data, Tokenizer.load(tokenizer_path))
    assert str(missing.value).startswith("The held-out set 'held' (data.eval_sets, or NAME=GLOBS in data.eval_files) "
                                         "of the files 'out.txt': No files match the pattern 'out.txt'.")
    assert str(missing.value).endswith("If held=out.txt was one path, to give a path that contains '=', write it "
                                       "with its directory (a set's name has no '/'): './held=out.txt'.")


def test_a_set_name_that_is_not_a_string_is_refused_in_one_line():
    """A config file's data.eval_sets with a number for a name. Caught: the isinstance(name, str) check removed (re's
    TypeError 'expected string or bytes-like object, got int', a traceback). The mixture's: tests/test_mixture.py."""
    config = small_config()
    with config.unlocked():
        config.data.eval_sets = {1: "/d/a.txt"}
    with pytest.raises(ValueError) as refused:
        config_lib.validate(config)
    assert str(refused.value) == ("data.eval_sets: the set 1 is '/d/a.txt'. Fix: a name (a string) of letters, "
                                  "digits, _ . - and its comma-separated globs, e.g. config.data.eval_sets = "
                                  "{'web': '/d/web/*.jsonl'}.")
