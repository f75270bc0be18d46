"""A Hugging Face checkpoint we cannot load is refused in one line naming the file (and the tensor) and the fix,
before anything is written or any device is used: in process (hf/derive.py, what every entry point calls first),
and from tools/import_hf.py and `python -m scone_jax.main --config.model.init_from_hf=DIR` with exit status 2.
What real checkpoints carry beside their parameters (a tied head's copy, names without the base model's prefix)
is read past.

Deliberate bugs these tests were run against once (each made the named test fail):
  - _check_tensors comparing only names, not shapes (test_a_bad_checkpoint_is_one_line[shape]);
  - _check_tensors reading past any tensor the family does not know (test_a_bad_checkpoint_is_one_line[unexpected]);
  - derive.apply not comparing the tokenizer's size with the embedding's rows
    (test_a_bad_checkpoint_is_one_line[tokenizer larger than the embedding]: the run would index past the table);
  - import_hf deriving the config after distributed.initialize and make_mesh
    (test_the_import_tool_refuses_before_writing_or_touching_a_device: the bogus platform fails first);
  - import_hf's --config flag defined without catching config_flags' error for a misspelled key of the default
    file (test_the_import_tool_refuses_bad_flags_in_one_line[...d_modl...]: a KeyError traceback, exit 1).
"""
import json
import os
import shutil

import numpy as np
import pytest

from scone_jax.hf import derive, safetensors as st
from scone_jax.hf.checkpoint_dir import HfCheckpointError
from tests import hf_models
from tests.common import run_main, run_tool


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("good"))
    hf_models.save_checkpoint(directory, "llama")
    return directory


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("small"))
    hf_models.save_checkpoint(directory, "llama", vocab_size=256)  # 256 rows for the tokenizer's 300 tokens
    return directory


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    config = json.loads(open(path).read())
    config.update(changes)
    open(path, "w").write(json.dumps(config))


def _rewrite_weights(directory, edit):
    """model.safetensors rewritten with edit({name: array}) applied."""
    path = os.path.join(directory, "model.safetensors")
    file = st.SafetensorsFile(path)
    arrays = edit({name: file.read(name) for name in file.tensors})
    st.write_file(path, [(n, a.dtype, a.shape) for n, a in arrays.items()], arrays.__getitem__, {"format": "pt"})


def _truncate(directory):
    path = os.path.join(directory, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-10])


def _damage_header(directory):
    path = os.path.join(directory, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[9:14] = b"\xff\xfe!!!"
    open(path, "wb").write(bytes(data))


BROKEN = {  # kind: (how to break a good checkpoint, what the line says)
    "no config.json": (lambda d: os.remove(os.path.join(d, "config.json")), "has no config.json"),
    "no weights": (lambda d: os.remove(os.path.join(d, "model.safetensors")),
                   "has no weights: neither model.safetensors nor model.safetensors.index.json"),
    "model_type": (lambda d: _edit_config(d, model_type="mistral"),
                   "model_type='mistral' is not supported; supported: llama, qwen3, gpt2, olmo"),
    "architectures": (lambda d: _edit_config(d, architectures=["LlamaForSequenceClassification"]),
                      "architectures=['LlamaForSequenceClassification'] is not supported for model_type='llama'; "
                      "supported: ['LlamaForCausalLM']"),
    "shape": (lambda d: _edit_config(d, intermediate_size=96),
              "tensor model.layers.0.mlp.down_proj.weight has shape [48, 80] but config.json implies [48, 96]"),
    "dtype": (lambda d: _edit_config(d, dtype="bfloat16"), "is F32 but config.json's dtype='bfloat16' says BF16"),
    "missing": (lambda d: _rewrite_weights(d, lambda a: {k: v for k, v in a.items() if k != "model.norm.weight"}),
                "lacks tensor model.norm.weight"),
    "unexpected": (lambda d: _rewrite_weights(d, lambda a: {**a, "model.layers.0.self_attn.rotary_emb.inv_freq":
                                                            np.ones(8, np.float32)}),
                   "holds tensor model.layers.0.self_attn.rotary_emb.inv_freq, which a llama model of its "
                   "config.json has no place for"),
    "truncated": (_truncate, "not a valid safetensors file"),
    "damaged header": (_damage_header, "has a header that is not JSON"),
}


def broken(good, tmp_path, kind) -> str:
    directory = str(tmp_path / "broken")
    shutil.copytree(good, directory)
    BROKEN[kind][0](directory)
    return directory


@pytest.mark.parametrize("kind", [*BROKEN, "tokenizer larger than the embedding"])
def test_a_bad_checkpoint_is_one_line(good, small_vocab, tmp_path, kind):
    if kind in BROKEN:
        directory, named = broken(good, tmp_path, kind), BROKEN[kind][1]
    else:
        directory, named = small_vocab, "has 300 tokens but the checkpoint"
    with pytest.raises(HfCheckpointError) as e:
        derive.apply(hf_models.import_config(directory))
    text = str(e.value)
    assert named in text and directory in text and "Fix:" in text and "\n" not in text, text


def test_what_real_checkpoints_carry_beside_the_parameters_is_read_past(good, tmp_path):
    """A tied model's file that keeps lm_head.weight, and a file saved from the base model (no 'model.' prefix),
    load as the checkpoint they are."""
    directory = broken(good, tmp_path, "no config.json")  # a copy; config.json restored below
    shutil.copyfile(os.path.join(good, "config.json"), os.path.join(directory, "config.json"))
    _edit_config(directory, tie_word_embeddings=True)
    _rewrite_weights(directory, lambda a: {k.removeprefix("model."): v for k, v in a.items()})
    checkpoint = derive.apply(hf_models.import_config(directory))
    assert checkpoint.model["tie_embeddings"] and checkpoint.names["model.norm.weight"] == "norm.weight"
    assert "lm_head.weight" not in checkpoint.names  # present in the file, read past


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*BROKEN, "tokenizer larger than the embedding"])
def test_the_import_tool_refuses_before_writing_or_touching_a_device(good, small_vocab, tmp_path, kind):
    """tools/import_hf.py: exit 2 and one line; the workdir never made; and JAX's platform set to one that does
    not exist, so touching a device would have failed first with another message."""
    directory = broken(good, tmp_path, kind) if kind in BROKEN else small_vocab
    named = BROKEN[kind][1] if kind in BROKEN else "has 300 tokens but the checkpoint"
    workdir = str(tmp_path / "run")
    result = run_tool("tools/import_hf.py", [f"--hf_dir={directory}", f"--workdir={workdir}"],
                      env={"JAX_PLATFORMS": "no_such_platform"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("import_hf: error: ") and named in lines[-1], \
        result.stderr[-2000:]
    assert not os.path.exists(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["no weights", "shape", "truncated"])
def test_the_training_job_refuses_a_bad_checkpoint_before_writing(good, tmp_path, kind):
    """python -m scone_jax.main --config.model.init_from_hf=DIR: exit 2 and one line, nothing in the workdir."""
    directory = broken(good, tmp_path, kind)
    workdir = str(tmp_path / "run")
    result = run_main(workdir, f"--config.model.init_from_hf={directory}", config="configs/finetune_hf.py")
    assert result.returncode == 2 and BROKEN[kind][1] in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert not os.path.exists(workdir) or not os.listdir(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("flag,named", [
    ("--config.model.d_modl=3", "Unknown config key 'model.d_modl': model has no field 'd_modl'"),
    ("--config=configs/nope.py", "Config file 'configs/nope.py' not found"),
    ("", "pass --hf_dir"),
])
def test_the_import_tool_refuses_bad_flags_in_one_line(good, tmp_path, flag, named):
    """A misspelled key of the default config file (config_flags applies it when the flag is defined), a missing
    config file, a missing --hf_dir: one line, exit 2, not a traceback."""
    args = [f"--workdir={tmp_path / 'run'}", *([flag] if flag else [])] + ([f"--hf_dir={good}"] if flag else [])
    result = run_tool("tools/import_hf.py", args)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.startswith("import_hf: error: ") and named in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def _digest(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.mark.slow
def test_a_workdir_that_is_the_checkpoint_or_holds_a_users_config_json_is_refused_before_writing(good, tmp_path):
    """import_hf --hf_dir=D --workdir=D (also D/.), and scone_jax.main with model.init_from_hf=D --workdir=D: exit 2,
    one line, D byte for byte as it was; a workdir holding a config.json no run wrote: the same. Bug it caught:
    import_hf exited 0 after writing its config.json over D's (transformers could no longer load D)."""
    directory = str(tmp_path / "hf")
    shutil.copytree(good, directory)
    before = _digest(directory)
    for workdir in (directory, f"{directory}/."):
        result = run_tool("tools/import_hf.py", [f"--hf_dir={directory}", f"--workdir={workdir}"])
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and lines[-1] == (
            f"import_hf: error: --workdir={workdir} names the same path as --hf_dir={directory}: writing it would "
            "destroy that; nothing was written. Fix: pass another path for --workdir."), result.stderr[-2000:]
        assert _digest(directory) == before
    result = run_main(directory, f"--config.model.init_from_hf={directory}", config="configs/finetune_hf.py")
    assert result.returncode == 2 and "--workdir=" + directory + " names the same path as model.init_from_hf=" in \
        result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert _digest(directory) == before

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text('{"my": "settings"}')
    result = run_tool("tools/import_hf.py", [f"--hf_dir={directory}", f"--workdir={workdir}"])
    assert result.returncode == 2 and "holds a config.json that is not a scone_jax run's" in \
        result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert os.listdir(workdir) == ["config.json"] and (workdir / "config.json").read_text() == '{"my": "settings"}'


@pytest.mark.parametrize("key,path", [("model.init_from_hf", "gs://bucket/Qwen3-0.6B"),
                                      ("scone.init_from_hf", "hf://Qwen/Qwen3-0.6B")])
def test_a_remote_checkpoint_path_is_reported_as_remote(good, key, path):
    """A gs:// or hf:// path is named as what it is, with the fix (copy it locally). Bug it caught: os.path.abspath
    made 'gs://b/x' the local 'gs:/b/x' before the URL check, so the line blamed a missing local directory."""
    config = hf_models.import_config(good)
    config.unlock()
    section, name = key.split(".")
    config[section][name] = path
    if section == "scone":
        config.scone.update(dict(enabled=True, gate=True))
    with pytest.raises(HfCheckpointError) as e:
        derive.apply(config)
    scheme = path.split("://")[0]
    assert str(e.value).startswith(f"{key}={path!r} is a remote path ({scheme}://), and remote checkpoints are not "
                                   "supported") and "Fix: copy it to local disk first" in str(e.value), str(e.value)
    assert "not a directory" not in str(e.value)


def _with_seq_len(config, seq_len: int):
    config.unlock()
    config.data.seq_len = seq_len
    return config


def test_a_sequence_longer_than_gpt2s_positions_gets_advice_that_works(tmp_path):
    """GPT-2's learned positions are the checkpoint's (max_position_embeddings 64 here): data.seq_len=80 is refused
    with advice to shorten the sequence, and following it validates. Bug it caught: the advice 'raise max_seq_len',
    which derive then refused as a conflict with the checkpoint (checked below)."""
    from scone_jax import config as config_lib

    directory = str(tmp_path / "gpt2")
    hf_models.save_checkpoint(directory, "gpt2")
    config = _with_seq_len(hf_models.import_config(directory), 80)
    derive.apply(config)
    with pytest.raises(ValueError) as e:
        config_lib.validate(config)
    assert "Fix: data.seq_len=64 or less" in str(e.value) and "raise max_seq_len" not in str(e.value), str(e.value)
    followed = _with_seq_len(hf_models.import_config(directory), 64)
    derive.apply(followed)
    config_lib.validate(followed)
    raised = _with_seq_len(hf_models.import_config(directory), 80)
    raised.model.max_seq_len = 80  # the old advice
    with pytest.raises(HfCheckpointError, match="model.max_seq_len=80 conflicts with"):
        derive.apply(raised)
