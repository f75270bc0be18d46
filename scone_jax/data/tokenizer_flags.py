"""The tokenizer flags of the tools that read a corpus (tools/pretokenize.py, tools/extract_fgrams.py):
--tokenizer and the special-id overrides --bos_token/--eos_token/--pad_token, spelled and checked alike in
each, since the ids are part of the fingerprint the training run compares (data/tokenizer.py)."""
from __future__ import annotations

import types

from absl import flags

from scone_jax.data.tokenizer import ROLES, Tokenizer

_FIX = "a SentencePiece .model (tools/train_tokenizer.py makes one) or a Hugging Face tokenizer.json"


def define(what: str) -> types.SimpleNamespace:
    """Define the flags; `what` ends --tokenizer's help (what the tokenizer is used for). The returned
    namespace's load(required) gives the Tokenizer after parsing (None if --tokenizer is empty and not required)."""
    path = flags.DEFINE_string("tokenizer", "", f"SentencePiece .model or Hugging Face tokenizer.json (local or "
                               f"gs://); {what}")
    overrides = {role: flags.DEFINE_string(f"{role}_token", "", f"Like data.{role}_token: a token of the vocabulary "
                                           "('' = the tokenizer's own); pass what the run sets.") for role in ROLES}

    def load(required: bool = True) -> Tokenizer | None:
        if not path.value:
            if required:
                raise ValueError(f"--tokenizer is empty. Fix: pass {_FIX}.")
            return None
        try:
            return Tokenizer.load(path.value, {role: flag.value for role, flag in overrides.items()},
                                  key="--{}_token")
        except FileNotFoundError:
            raise FileNotFoundError(f"--tokenizer={path.value!r} does not exist. Fix: point it at {_FIX}.") from None

    return types.SimpleNamespace(load=load, path=path)


def define_chat(loss_on: bool) -> types.SimpleNamespace:
    """--messages_field and --chat_template (and --loss_on if `loss_on`), as data.* of the same names, for
    --format/--source=chat; fields(tokenizer_path) gives the data config entries they set."""
    field = flags.DEFINE_string("messages_field", "messages", "chat: the JSONL field holding each conversation's "
                                "messages (data.messages_field).")
    template = flags.DEFINE_string("chat_template", "", "chat: a .jinja file, a tokenizer_config.json or a checkpoint "
                                   "directory ('' = beside --tokenizer), as data.chat_template.")
    mask = flags.DEFINE_enum("loss_on", "assistant", ["assistant", "all"], "chat: the tokens the stored loss mask "
                             "trains on, as data.loss_on (the run must set the same).") if loss_on else None

    def fields(tokenizer_path: str) -> dict:
        return {"messages_field": field.value, "chat_template": template.value, "tokenizer_path": tokenizer_path,
                "loss_on": mask.value if mask is not None else "all"}

    return types.SimpleNamespace(fields=fields)
