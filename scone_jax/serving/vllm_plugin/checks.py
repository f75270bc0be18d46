"""A SCONE export's f-gram files and tokenizer, and the engine settings it cannot be served under, checked in the
process that builds the engine and before it starts one: each problem is one line (ExportRefused) naming it and the fix.

When vLLM reads config.json (VllmSconeConfig.from_dict):
  - the table or the vocabulary missing, truncated, or of another shape than config.json's fgrams section says (rows
    that disagree with the vocabulary: their counts differ) (scone_fgrams.Fgrams, shared with the transformers path);
  - the table's bytes against table_crc32 (a damaged file; read once a process: 0.6 s a GB from the page cache, else
    disk speed);
  - the export's own tokenizer.json against tokenizer_sha256 (f-grams are token ids of the run's tokenizer).
When vLLM checks its whole configuration (EngineChecks, vLLM's per-architecture config hook):
  - a tokenizer given apart from the model (--tokenizer) against tokenizer_sha256;
  - prompt embeddings and dual batch overlap, which the model cannot serve correctly (refuse_unsupported).
Exports written before the two fields existed are checked for the rest, with one log line saying so.

An uncaught ExportRefused ends a program (vLLM's server) with its one line and exit status 1, without the traceback
(refuse_in_one_line); in a program that catches it, it is an exception like any other."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
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


_VERIFIED: set = set()  # (table path, size, mtime) whose CRC matched in this process: vLLM reads config.json twice


def check_export(directory: str) -> None:
    """The config.json-time checks of the module docstring on the export `directory` (its own tokenizer)."""
    section = fgrams_section(directory)
    if section is None:
        return
    fgrams = Fgrams(directory, section)
    path = os.path.join(directory, section.get("table", "fgram_table.safetensors"))
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, section.get("table_crc32"))
    if key not in _VERIFIED:
        check_table_crc(fgrams, section, path)
        _VERIFIED.add(key)
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


def refusal(error: BaseException | None) -> ExportRefused | None:
    """The ExportRefused that `error` is or was raised from (vLLM may re-raise what a config hook raised)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ExportRefused):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def refuse_in_one_line() -> None:
    """Make an uncaught ExportRefused end the program with `ExportRefused: MESSAGE` alone on stderr and status 1
    (vLLM's server would print a traceback of some 60 lines above it); any other exception is left to the hook
    before. Idempotent (vLLM may load its plugins twice in one process)."""
    previous = sys.excepthook
    if getattr(previous, "scone_one_line", False):
        return

    def hook(kind, error, traceback):
        refused = refusal(error)
        if refused is None:
            return previous(kind, error, traceback)
        print(f"ExportRefused: {refused}", file=sys.stderr, flush=True)
        os._exit(1)  # the server's engine and loop threads would otherwise print their own shutdown tracebacks

    hook.scone_one_line = True
    sys.excepthook = hook


def refuse_unsupported(vllm_config) -> None:
    """What the plugin cannot serve correctly, refused in one line rather than served with wrong rows: prompt
    embeddings (no token ids to match) and micro-batched passes (dual batch overlap: each micro-batch has its own
    attention metadata, which the model's fgram_ids does not split)."""
    if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
        raise ExportRefused("SCONE matches f-grams on token ids, and prompt embeddings have none. Fix: serve without "
                            "--enable-prompt-embeds.")
    if getattr(vllm_config.parallel_config, "enable_dbo", False):
        raise ExportRefused("SCONE does not support dual batch overlap (micro-batched passes). Fix: serve without "
                            "--enable-dbo.")


class EngineChecks:
    """vLLM's per-architecture config hook (vllm.model_executor.models.config.MODELS_CONFIG_MAP, which register()
    fills for SconeForCausalLM): called with the whole configuration in the process that builds the engine, before
    any engine process starts."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        pass

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model_config = vllm_config.model_config
        section = getattr(model_config.hf_config, "fgrams", None)
        if section is None:  # a SCONE config without f-grams: nothing of SCONE's to check
            return
        refuse_unsupported(vllm_config)
        tokenizer = str(model_config.tokenizer or model_config.model)
        if os.path.realpath(tokenizer) != os.path.realpath(str(model_config.model)):
            try:
                check_tokenizer(str(model_config.model), section, tokenizer)
            except SconeExportError as e:
                raise ExportRefused(str(e)) from None


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
