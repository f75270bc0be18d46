"""The data groups (data.mixture, data.eval_sets) and their command-line shorthand, parsed once by config.resolve:
the shorthand and a config file's group resolve alike, never both at once; a checkpoint or export saved with the
shorthand (before the groups existed) resumes and loads as the same config; serving's --config.data.eval_files
replaces a run's sets."""
import json
import re
import types

import pytest

from scone_jax import config as config_lib
from tests.common import small_config

SHORTHAND = "web=/d/web/*.jsonl,/d/w2.jsonl@0.7;books=/d/books/*.jsonl.gz@0.3"
GROUP = {"web": {"files": "/d/web/*.jsonl,/d/w2.jsonl", "weight": 0.7, "order": 0},
         "books": {"files": "/d/books/*.jsonl.gz", "weight": 0.3, "order": 1}}


def _with(**data):
    config = small_config()
    for key, value in data.items():  # set whole, as a config file does (update() would merge into a group)
        config.data[key] = value
    return config


def _resolved(**data):
    config = _with(**data)
    config_lib.validate(config)
    return config


def test_the_shorthand_resolves_into_the_groups_once_and_stays_resolved():
    config = _resolved(train_files=SHORTHAND, eval_files="a=/d/a.txt;b=/d/b/*.txt")
    assert (config.data.train_files, config.data.eval_files) == ("", "")
    assert config.data.mixture.to_dict() == GROUP and config.data.eval_sets.to_dict() == {"a": "/d/a.txt",
                                                                                          "b": "/d/b/*.txt"}
    before = config.to_dict()
    config_lib.validate(config)  # idempotent: a resolved config resolves to itself
    assert config.to_dict() == before
    plain = _resolved(train_files="/d/a/*.txt", eval_files="/d/e.txt")
    assert (plain.data.train_files, plain.data.eval_files) == ("/d/a/*.txt", "/d/e.txt")
    assert plain.data.mixture.to_dict() == {} and plain.data.eval_sets.to_dict() == {}


@pytest.mark.parametrize("data,message", [
    (dict(mixture=GROUP, train_files=SHORTHAND), "data.train_files='web=/d/web/*.jsonl,/d/w2.jsonl@0.7;"
                                                 "books=/d/books/*.jsonl.gz@0.3' and data.mixture (books, web) are "
                                                 "both set: two ways to give the same data."),
    (dict(mixture=GROUP, train_files="/d/other/*.txt"), "data.train_files='/d/other/*.txt' and data.mixture"),
    (dict(eval_sets={"a": "/d/a.txt"}, eval_files="/d/e.txt"), "data.eval_files='/d/e.txt' and data.eval_sets (a)"),
])
def test_a_group_and_its_string_both_set_are_refused(data, message):
    """A config file's group and a command line's string for the same data: refused naming both, not one of them
    silently dropped. Caught: the check left out of resolve_data (the shorthand's components replaced the config
    file's without a word, and a plain glob list beside a mixture was ignored)."""
    config = _with(**data)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        config_lib.validate(config)
    assert "Fix: set one of them" in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_saved_with_the_shorthand_resumes_with_the_same_command_line():
    """A checkpoint's config from before the groups (data.train_files the shorthand, no data.mixture) compares
    equal to today's resolution of the same flags; another component order is a change, named as data.mixture.
    Caught: resume_changes comparing the saved config unresolved ('data.train_files: 'web=...' -> ''' refused
    every resume of a mixture run made before the change)."""
    config = _resolved(train_files=SHORTHAND)
    old = small_config().to_dict()
    old["data"] = {k: v for k, v in old["data"].items() if k not in ("mixture", "eval_sets")}
    old["data"]["train_files"] = SHORTHAND
    assert config_lib.resume_changes(old, config) == []
    assert config_lib.resume_changes(config.to_dict(), config) == []  # a checkpoint of today's
    old["data"]["train_files"] = "books=/d/books/*.jsonl.gz@0.3;web=/d/web/*.jsonl,/d/w2.jsonl@0.7"
    changes = config_lib.resume_changes(old, config)
    assert len(changes) == 1 and changes[0].startswith("data.mixture: {'books': {'files': '/d/books/*.jsonl.gz', "
                                                       "'weight': 0.3, 'order': 0}")


def test_a_stored_config_of_either_age_loads_as_the_resolved_config():
    """saved_config.stored_config: an export's config from before the groups gets them from its shorthand, and
    today's (its groups in config.json's sorted JSON) merges each group whole. Caught: merge() recursing into a
    group ('The saved config has data.mixture.books, which this code does not know')."""
    from scone_jax import saved_config

    config = _resolved(train_files=SHORTHAND, eval_files="a=/d/a.txt")
    today = saved_config.stored_config(json.loads(config_lib.to_json(config)))
    assert today.to_dict() == config.to_dict()
    old = config.to_dict()
    old["data"] = {k: v for k, v in old["data"].items() if k not in ("mixture", "eval_sets")}
    old["data"].update(train_files=SHORTHAND, eval_files="a=/d/a.txt")
    assert saved_config.stored_config(old).to_dict() == config.to_dict()


def test_evaluations_eval_files_replaces_the_runs_named_sets():
    """serving/evaluate.data_config: --config.data.eval_files on an export whose run had named sets evaluates the
    files given (as before the groups), and a shorthand given there becomes the sets. Caught: the run's
    data.eval_sets kept beside the override (refused as both set)."""
    from scone_jax.serving import evaluate

    served = types.SimpleNamespace(config=_resolved(eval_files="a=/d/a.txt;b=/d/b.txt"))
    data = evaluate.data_config(served, {"data.eval_files": "/d/held_out.txt"}).data
    assert (data.eval_files, data.eval_sets.to_dict()) == ("/d/held_out.txt", {})
    data = evaluate.data_config(served, {"data.eval_files": "c=/d/c.txt"}).data
    assert (data.eval_files, data.eval_sets.to_dict()) == ("", {"c": "/d/c.txt"})
    assert evaluate.data_config(served, {}).data.eval_sets.to_dict() == {"a": "/d/a.txt", "b": "/d/b.txt"}


def test_a_group_named_as_an_override_says_how_to_set_it():
    config = small_config().copy_and_resolve_references()
    with pytest.raises(ValueError, match=re.escape(
            "--config.data.mixture=x: data.mixture is a group of named entries, set whole. Fix: set it in a config "
            "file, or give its shorthand, e.g. --config.data.train_files='web=")):
        config_lib.apply_override(config.unlock(), "data.mixture=x", flag="--config", joint=".")
