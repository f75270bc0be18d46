"""A config file is held to the declared keys as the command line is (config.check_declared), a run saved
before that still exports (saved_config.run_config), and the values every key's rule refuses (config.validate):
each refused in one line naming the key. Each test names the slip it was seen to catch."""
import logging
import textwrap

import pytest

from scone_jax import config as config_lib, saved_config
from tests.common import run_main, small_config

HEADER = "import ml_collections\nfrom scone_jax.config import base_config\n\n\ndef get_config(arg=None):\n"


def _config_file(tmp_path, body: str, name: str = "mine.py") -> str:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.indent(f"c = base_config()\n{body}\nc.lock()\nreturn c\n", "    "))
    return str(path)


@pytest.mark.parametrize("body,message", [
    ("c.model.num_layrs = 2", "sets model.num_layrs, which is not a config key: model has no field 'num_layrs'. "
                              "Valid keys there: ['attention', "),
    ("c.optim = ml_collections.ConfigDict({'lr': 1e-3})", "sets optim.lr, which is not a config key: config has no "
                                                          "field 'optim'. Valid keys there: ['data', 'engram', 'mesh', "
                                                          "'model', 'overencoding', 'scone', 'train']. Fix: remove it; "
                                                          "only the keys declared"),
    ("c.seed = 1", "sets seed, which is not a config key: config has no field 'seed'."),
])
def test_a_config_file_that_sets_an_undeclared_key_is_refused_naming_it(tmp_path, body, message):
    """Caught: load_config_file without check_declared (the typo loaded, and the run trained with
    model.num_layers' default of 4 blocks)."""
    path = _config_file(tmp_path, body)
    with pytest.raises(ValueError) as refused:
        config_lib.load_config_file(path)
    assert str(refused.value).startswith(f"Config file {path!r} {message}")
    assert "\n" not in str(refused.value)
    if "num_layrs" in body:
        assert "Fix: correct it (model.num_layers?); only the keys declared in scone_jax/config_keys.py are read." \
            in str(refused.value)
    # a config built in code (a test, a tool) is refused by validate the same way
    config = small_config()
    with config.unlocked():
        config.train.sed = 3
    with pytest.raises(ValueError, match=r"^The config sets train\.sed, which is not a config key: .*\(train\.seed\?\)"):
        config_lib.validate(config)


def test_a_group_holds_names_not_keys(tmp_path):
    """data.mixture's component names are the config's own: a config file that sets a group loads. Caught:
    undeclared_keys descending into groups (every mixture refused as 'data.mixture.web')."""
    path = _config_file(tmp_path, "c.data.mixture = {'web': {'files': '/d/w.jsonl', 'weight': 1.0, 'order': 0}}")
    assert config_lib.load_config_file(path).data.mixture.web.files == "/d/w.jsonl"


@pytest.mark.slow  # starts the training CLI
def test_the_training_cli_refuses_a_misspelled_config_file_before_writing(tmp_path):
    """Caught: main.parse_flags without the undeclared-keys check (config_flags loads files itself: the run went
    on to train with 4 blocks, and its export then failed)."""
    path = _config_file(tmp_path, "c.model.num_layrs = 2")
    result = run_main(tmp_path / "run", config=path, devices=1, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = [x for x in result.stderr.splitlines() if "error" in x]
    assert line.startswith(f"scone_jax: error: Config file {path!r} sets model.num_layrs, which is not a config key")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key,value,message", [
    ("train.eps", float("inf"), "train.eps=inf is not valid: it must be > 0 and finite."),
    ("model.rope_theta", float("inf"), "model.rope_theta=inf is not valid: it must be > 0 and finite."),
    ("train.learning_rate", float("nan"), "train.learning_rate=nan is not valid: it must be > 0 and finite."),
    ("train.weight_decay", float("inf"), "train.weight_decay=inf is not valid: it must be >= 0 and finite."),
    ("scone.output_gain_init", float("nan"), "scone.output_gain_init=nan is not valid: it must be finite."),
    ("data.shuffle_seed", -1, "data.shuffle_seed=-1 is not valid: it must be in [0, 2**63) (a seed: "),
    ("train.seed", 2**64, "train.seed=18446744073709551616 is not valid: it must be in [0, 2**63) (a seed: a whole "
                          "number from 0 to 2**63 - 1, what numpy's and JAX's generators both take)."),
    ("train.seed", 2**63, "train.seed=9223372036854775808 is not valid"),
    ("train.num_steps", True, "train.num_steps=True is not valid: it must be >= 1"),  # a bool is no number
])
def test_values_no_rule_allows_are_refused_naming_the_key(key, value, message):
    """inf passed '> 0' and ran to rc 0 (train.eps=inf, model.rope_theta=inf); nan fails no comparison; a negative
    shuffle seed was numpy's 'expected non-negative integer' naming no key; a seed past 63 bits JAX's
    OverflowError; ml_collections lets a config file put True in an integer key. Caught: the finiteness check
    removed (inf and nan accepted), the seeds' rule dropped, `number` taking bools (True trained 1 step)."""
    config = small_config()
    section, name = key.split(".")
    with config.unlocked():
        config[section][name] = value
    with pytest.raises(ValueError) as refused:
        config_lib.validate(config)
    assert str(refused.value).startswith(message)
    largest = small_config()
    with largest.unlocked():
        largest.train.seed, largest.data.shuffle_seed = 2**63 - 1, 2**63 - 1
    config_lib.validate(largest)  # the largest seeds both generators take


def test_a_checkpoints_unknown_key_is_noted_before_the_check_and_refused_after(caplog):
    """saved_config.run_config on a checkpoint's metadata: without the DECLARED_ONLY flag (saved before config files
    were checked) an unknown key is dropped with one note; with it (every key its writer declared) it is another
    version's key, refused. Caught: the flag read the wrong way round (the pre-check run refused, the other
    version's key dropped)."""
    saved = small_config(num_layers=1).to_dict()
    saved["model"]["num_layrs"] = 2
    with caplog.at_level(logging.WARNING):
        config = saved_config.run_config({"config": saved})
    assert config.model.num_layers == 1 and "num_layrs" not in config.model
    assert [r.getMessage() for r in caplog.records if "num_layrs" in r.getMessage()] == [
        "Note: the run's config sets model.num_layrs, which no scone_jax key declares (a misspelling its config file "
        "made before such keys were refused): the run never read it and trained with the defaults; ignored."]
    with pytest.raises(ValueError, match=r"^The saved config has model\.num_layrs, which this code does not know"):
        saved_config.run_config({"config": saved, saved_config.DECLARED_ONLY: True})
    assert saved_config.run_config({"config": saved, saved_config.DECLARED_ONLY: False}).model.num_layers == 1
    assert saved_config.run_config({"config": small_config().to_dict(), saved_config.DECLARED_ONLY: True}
                                   ).to_dict() == config_lib.resolve(small_config()).to_dict()


@pytest.mark.slow  # exports a run: ~20 s
def test_a_run_saved_with_an_undeclared_key_exports_with_a_note(tokenizer_path, tmp_path, caplog):
    """A run whose config file set `c.model.num_layrs = 2` before such keys were refused trained with the default
    and saved the key in its checkpoint: it exports, with one note naming the key, and the bundle's config has no
    such key. A checkpoint saved since (DECLARED_ONLY) with a key this code does not know is another version's:
    refused. Caught: stored_config refusing every unknown key ('use the scone_jax version that wrote it', though
    it was the same version); run_config ignoring the flag (another version's key dropped silently)."""
    from scone_jax.serving import bundle, export
    from scone_jax.training import run as run_lib

    config = small_config(num_layers=1)
    with config.unlocked():
        config.data.tokenizer_path = tokenizer_path
        config.model.num_layrs = 2  # what a config file could do before the check (no validate on this path)
    workdir = str(tmp_path / "run")
    run_lib.save_initial_state(config, workdir, 1)
    latest = run_lib.Latest.open(workdir)
    assert latest.meta["config"]["model"]["num_layrs"] == 2 and latest.meta[saved_config.DECLARED_ONLY] is False
    with caplog.at_level(logging.WARNING):
        export.export(workdir, str(tmp_path / "export"), chunk_rows=64, batch_rows=512)
    notes = {r.getMessage() for r in caplog.records if "num_layrs" in r.getMessage()}
    assert notes == {"Note: the run's config sets model.num_layrs, which no scone_jax key declares (a misspelling "
                     "its config file made before such keys were refused): the run never read it and trained with "
                     "the defaults; ignored."}
    opened = bundle.Bundle.open(str(tmp_path / "export"))
    assert "num_layrs" not in opened.meta["config"]["model"] and opened.config.model.num_layers == 1
    # the same key in a checkpoint that says its config held declared keys only: another version's
    latest.meta.pop(saved_config.DECLARED_ONLY)
    assert saved_config.run_config(latest.meta).model.num_layers == 1  # saved before the flag existed
    with pytest.raises(ValueError, match=r"The saved config has model\.num_layrs, which this code does not know; "
                       "use the scone_jax version that wrote it"):
        saved_config.run_config({**latest.meta, saved_config.DECLARED_ONLY: True})
    clean = small_config(num_layers=1)
    with clean.unlocked():
        clean.data.tokenizer_path = tokenizer_path
    run_lib.save_initial_state(clean, str(tmp_path / "clean"), 1)
    assert run_lib.Latest.open(str(tmp_path / "clean")).meta[saved_config.DECLARED_ONLY] is True
