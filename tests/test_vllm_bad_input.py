"""A damaged SCONE export, a tokenizer other than the run's, or an engine setting the plugin cannot serve is refused
before an engine starts, in one line naming the problem and the fix (scone_jax/serving/vllm_plugin/checks.py:
ExportRefused out of vllm.LLM(...); vLLM's server ends with that line alone, status 1). Skipped where vLLM does not
import.

Deliberate bugs this test was run against once (each patched in by a pytest plugin for one run; the named cases failed):
  - check_table_crc checking nothing: [damaged table] (vLLM went on to start an engine);
  - VllmSconeConfig.from_dict not calling check_export: [missing table] (the engine's worker died instead, with a
    traceback of many lines);
  - register() leaving MODELS_CONFIG_MAP alone: [another tokenizer given apart] and [prompt embeddings] (the engine
    started, and its worker died with a traceback);
  - refuse_in_one_line not installed: test_the_server_refuses_in_one_line (a traceback of 60 lines above the line).
"""
import subprocess
import sys
import json
import os
import shutil

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (docs/serving.md)")

from scone_jax.serving.vllm_plugin.checks import ExportRefused  # noqa: E402
from tests import vllm_runs  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return vllm_runs.build(str(tmp_path_factory.getbasetemp() / "vllm_runs"), "scone")  # built once a session


def fewer_rows(path):
    """The table with its last row dropped: rows that no longer match the vocabulary."""
    from safetensors.torch import load_file, save_file

    rows = load_file(path)["rows"]
    save_file({"rows": rows[:-1].contiguous()}, path, metadata={"format": "pt"})


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        value = f.read(1)[0]
        f.seek(-100, os.SEEK_END)
        f.write(bytes([value ^ 0x40]))


def other_tokenizer(path):
    data = json.load(open(path))
    data["model"]["vocab"] = {k + ("x" if v == 100 else ""): v for k, v in data["model"]["vocab"].items()}
    json.dump(data, open(path, "w"))


DAMAGE = {
    "missing table": ("fgram_table.safetensors", os.remove, "fgram_table.safetensors cannot be read"),
    "missing vocabulary": ("fgram_vocab.safetensors", os.remove, "fgram_vocab.safetensors cannot be read"),
    "rows that disagree with the vocabulary": ("fgram_table.safetensors", fewer_rows, "belongs to another export"),
    "damaged table": ("fgram_table.safetensors", flip_a_byte, "is damaged: its rows have CRC32"),
    "another tokenizer": ("tokenizer.json", other_tokenizer, "holds another tokenizer.json than the run's"),
}


def refused(directory, **settings) -> str:
    with pytest.raises(ExportRefused) as raised:
        vllm.LLM(model=directory, dtype="float32", max_model_len=256, enforce_eager=True,
                 kv_cache_memory_bytes=vllm_runs.KV_BYTES, **settings)
    message = str(raised.value)
    assert "Fix:" in message and "\n" not in message, message
    return message


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_export_is_refused_in_one_line(exported, tmp_path, case):
    name, damage, says = DAMAGE[case]
    directory = str(tmp_path / "hf")
    shutil.copytree(exported["hf"], directory)
    damage(os.path.join(directory, name))
    assert says in refused(directory)


def test_another_tokenizer_given_apart_is_refused_before_an_engine_starts(exported, tmp_path):
    """vLLM's --tokenizer (LLM(tokenizer=...)) naming a tokenizer other than the run's: refused by the engine-settings
    check in this process; the export's own tokenizer given that way is served."""
    other = tmp_path / "other"
    shutil.copytree(exported["hf"], other, ignore=shutil.ignore_patterns("*.safetensors"))
    other_tokenizer(str(other / "tokenizer.json"))
    message = refused(exported["hf"], tokenizer=str(other))
    assert f"The tokenizer at {other} holds another tokenizer.json than the run's" in message


def test_prompt_embeddings_are_refused_before_an_engine_starts(exported):
    assert "prompt embeddings have none" in refused(exported["hf"], enable_prompt_embeds=True)


def test_the_server_refuses_in_one_line(exported, tmp_path):
    """vLLM's OpenAI server given a damaged export: status 1, the refusal its last line, and no traceback."""
    directory = str(tmp_path / "hf")
    shutil.copytree(exported["hf"], directory)
    flip_a_byte(os.path.join(directory, "fgram_table.safetensors"))
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", directory,
                           "--host", "127.0.0.1", "--port", "1", "--dtype", "float32", "--max-model-len", "256"],
                          capture_output=True, text=True, timeout=600)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1, lines[-20:]
    assert lines[-1].startswith("ExportRefused: ") and "is damaged: its rows have CRC32" in lines[-1], lines[-5:]
    assert not any(line.startswith("Traceback") for line in lines), lines
