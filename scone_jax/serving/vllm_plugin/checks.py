"""A SCONE export's f-gram files and tokenizer, checked when vLLM reads its config.json, in the process that builds the
engine and before it starts one: each problem is one line (ExportRefused) naming it and the fix.

  - the table or the vocabulary missing, truncated, or of another shape than config.json's fgrams section says (rows
    that disagree with the vocabulary: their counts differ) (scone_fgrams.Fgrams, shared with the transformers path);
  - the table's bytes against table_crc32 (a damaged file; read once: 0.6 s a GB from the page cache, else disk speed);
  - the tokenizer vLLM will use against tokenizer_sha256 (f-grams are token ids of the run's tokenizer).
Exports written before these two fields existed are checked for the rest, with one log line saying so."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib

from scone_jax.hf.remote_code.configuration_scone import SconeConfig
from scone_jax.hf.remote_code.scone_fgrams import Fgrams, SconeExportError

logger = logging.getLogger(__name__)
_FIX = "Fix: copy the export directory again, whole, from where scone_jax.serving.export wrote it."
CHUNK = 64 << 20


def fgrams_section(directory: str) -> dict | None:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f).get("fgrams")


def open_export(directory: str, tokenizer: str | None = None) -> Fgrams:
    """The table and matcher of the export `directory`, its files checked against config.json (shapes and sizes)."""
    section = fgrams_section(directory)
    fgrams = Fgrams(directory, section)
    check_tokenizer(directory, section, tokenizer or directory)
    return fgrams


def check_export(directory: str) -> None:
    """Every check of the module docstring on the export `directory` (its own tokenizer)."""
    section = fgrams_section(directory)
    if section is None:
        return
    fgrams = Fgrams(directory, section)
    check_table_crc(fgrams, section, os.path.join(directory, section.get("table", "fgram_table.safetensors")))
    check_tokenizer(directory, section, directory)


def check_table_crc(fgrams: Fgrams, section: dict, path: str) -> None:
    want = section.get("table_crc32")
    if want is None:
        logger.warning("SCONE: %s has no table_crc32 (an export older than this check): the table's bytes are not "
                       "verified", path)
        return
    rows = fgrams.table.rows.reshape(-1).view("u1") if fgrams.table.rows.size else b""
    crc = 0
    for start in range(0, len(rows), CHUNK):
        crc = zlib.crc32(rows[start:start + CHUNK], crc)
    if f"{crc:08x}" != want:
        raise SconeExportError(f"{path} is damaged: its rows have CRC32 {crc:08x}, config.json's fgrams.table_crc32 "
                               f"says {want}. {_FIX}")


def check_tokenizer(directory: str, section: dict, tokenizer: str) -> None:
    want = section.get("tokenizer_sha256")
    if want is None:
        return
    path = os.path.join(tokenizer, "tokenizer.json")
    try:
        with open(path, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        got = None
    if got != want:
        found = "has no tokenizer.json" if got is None else "holds another tokenizer.json than the run's"
        raise SconeExportError(f"The tokenizer at {tokenizer} {found}: the f-grams of {directory} are token ids of the "
                               "run's tokenizer. Fix: serve with the export's own tokenizer (no --tokenizer), or "
                               "re-export the run.")


class ExportRefused(RuntimeError):
    """SconeExportError as vLLM's caller sees it: not a ValueError, which vLLM's pydantic ModelConfig would wrap in a
    validation report of several lines; the message is the one line."""


class VllmSconeConfig(SconeConfig):
    """SconeConfig that checks its export when vLLM (through AutoConfig) reads config.json from a directory."""

    def __init__(self, **kwargs):  # its own __init__: transformers would otherwise generate a dataclass one
        super().__init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        directory = kwargs.get("name_or_path")
        if config_dict.get("fgrams") is not None and directory and os.path.isdir(str(directory)):
            try:
                check_export(str(directory))
            except SconeExportError as e:
                raise ExportRefused(str(e)) from None
        return super().from_dict(config_dict, **kwargs)
