"""What each parameter is, decided by its name: the embedding tables, the weight matrices, and the rest.

Role decides which parameters count as embedding parameters (accounting.py), which are
weight-decayed (training/optimizer.py) and which belong to the f-gram model (whose updates
train.fgram_model_delay_steps holds back and scone.learning_rate_multiplier scales). It is read
from the parameter's path, never from its rank: with scanned layers (model.scan_layers) a norm
scale or a bias is stacked to [layers, d] and looks like a matrix.

  embedding  the tables of nnx.Embed modules named in EMBEDDING_MODULES (token embedding T, the
             decoder's learned positions, the f-gram model's K positions, Over-Encoding's and Engram's
             n-gram tables): not decayed
  matrix     the `kernel` of every nnx.Linear (attention and MLP projections, the f-gram model's
             width projections, Over-Encoding's projection, Engram's W_K and W_V, an untied output head):
             decayed
  other      norm scales, every bias and Engram's depthwise convolution weights: not decayed
"""
from __future__ import annotations

# The last two: model/overencoding.py's and model/engram.py's n-gram tables.
EMBEDDING_MODULES = ("token_embed", "pos_embed", "ngram_tables", "engram_tables")
MATRIX_LEAVES = ("kernel",)


def _names(path) -> list:
    """The module and parameter names along a jax tree path of an nnx state (dictionary keys only: the
    list index of an unscanned block and a Variable's `.value` attribute are not names)."""
    return [k.key for k in path if isinstance(getattr(k, "key", None), str)]


def is_embedding(path) -> bool:
    return any(name in EMBEDDING_MODULES for name in _names(path))


def in_fgram_model(path) -> bool:
    """True for the f-gram model's parameters (model/scone.py's `fgram_model`), in either block layout."""
    return "fgram_model" in _names(path)


def is_gate(path) -> bool:
    """True for scone.gate's scalar g (the f-gram model's `gate`), whose rate scone.gate_learning_rate_multiplier
    scales on top of the f-gram model's."""
    return _names(path)[-2:] == ["fgram_model", "gate"]


def is_decayed(path) -> bool:
    """True for weight matrices (module docstring): the parameters AdamW's weight decay applies to."""
    names = _names(path)
    return bool(names) and names[-1] in MATRIX_LEAVES and not is_embedding(path)
