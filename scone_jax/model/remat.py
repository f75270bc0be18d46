"""Rematerialization policies: what one transformer block keeps for its backward pass.

`model.remat` names a policy; `apply(fn, name)` wraps a block's forward function with it.
  none           keep every intermediate (fastest; most memory)
  full           keep only the block's input; the backward pass recomputes the whole block
                 (least memory, about one extra forward pass of FLOPs)
  save_dots      keep the outputs of matmuls against weights (no batch dimensions: the q/k/v,
                 attention-output and MLP projections) and recompute the rest (norms,
                 activations, attention scores): most of full's savings at a fraction of its
                 recompute, the usual choice for large models
  save_qkv_proj  keep only the q/k/v and attention-output projections (named in layers.py
                 with `checkpoint_name`); the MLP is recomputed
Attention scores are never kept by a policy ([B, N, T, T] is what remat is for); fused
attention kernels keep their own small residuals.
"""
from __future__ import annotations

from typing import Callable

import jax

# Names given to saveable intermediates with jax.ad_checkpoint.checkpoint_name in layers.py.
QKV_PROJ_NAMES = ("query_proj", "key_proj", "value_proj", "attention_out")

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names(*QKV_PROJ_NAMES),
}


def check(name) -> None:
    """An unknown policy is a config error listing the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"Unknown model.remat={name!r}; valid policies: {', '.join(POLICIES)}.")


def apply(fn: Callable, name: str, *, in_scan: bool) -> Callable:
    """fn wrapped in jax.checkpoint with the named policy (fn itself for 'none'). Inside a scan
    the loop already keeps XLA from merging the recomputation with the forward pass, so the
    extra barriers of prevent_cse are left out there (JAX's advice for scanned remat)."""
    check(name)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[name], prevent_cse=not in_scan)
