"""A damaged SCONE export is refused when vLLM reads its config.json, before an engine starts, in one line naming the
file and the fix (scone_jax/serving/vllm_plugin/checks.py: ExportRefused out of vllm.LLM(...), the last line of the
server's traceback). Skipped where vLLM does not import.

Deliberate bugs this test was run against once (each patched in by a pytest plugin for one run; the named cases failed):
  - check_table_crc checking nothing: [damaged table] (vLLM went on to start an engine);
  - VllmSconeConfig.from_dict not calling check_export: [missing table] (the engine's worker died instead, with a
    traceback of many lines).
"""
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


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_export_is_refused_in_one_line(exported, tmp_path, case):
    name, damage, says = DAMAGE[case]
    directory = str(tmp_path / "hf")
    shutil.copytree(exported["hf"], directory)
    damage(os.path.join(directory, name))
    with pytest.raises(ExportRefused) as raised:
        vllm.LLM(model=directory, dtype="float32", max_model_len=256, enforce_eager=True,
                 kv_cache_memory_bytes=vllm_runs.KV_BYTES)
    message = str(raised.value)
    assert says in message and "Fix:" in message and "\n" not in message, message
