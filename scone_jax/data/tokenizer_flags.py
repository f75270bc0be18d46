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
