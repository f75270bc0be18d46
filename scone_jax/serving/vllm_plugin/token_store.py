"""Each scheduled token's window, its request's last K tokens, from a token id kept beside each KV cache slot.

A forward pass of vLLM sees a flat run of tokens from many requests: whole prompts, chunks of prompts, one decoded
token per request, in any mix. The model gets no request ids, but it gets, through the attention metadata, where
each token's keys and values go (slot_mapping) and each request's block table. So the store keeps one token id per
KV cache slot, written in every forward pass for the tokens it computes, at the slots their keys go to; the tokens
before position p of a request then lie at the slots its block table gives positions p-K+1 .. p-1. This is exactly
as correct as the KV cache itself, whatever the scheduler did:
  - chunked prefill: the earlier chunks' tokens were stored when those chunks ran;
  - prefix caching: a cached block holds the same tokens at the same positions (its hash covers them), and their
    ids were stored by the pass that computed its keys and values (a freed block is rewritten before reuse);
  - preemption with recomputation: the recomputed tokens are stored again with their keys and values;
  - n > 1 samples: each sample has its own blocks past the shared prompt.
Positions below 0 are outside the request: a window never reaches across the request's start (docs/method.md §2).
The store lives on the host (numpy int64, 8 bytes a slot: 8 MB for a million cached tokens), as the matcher does.
"""
from __future__ import annotations

import numpy as np


class SlotMismatchError(RuntimeError):
    """The block table and slot_mapping disagree: the store would read other tokens than the request's."""


class TokenStore:
    """Token ids by KV cache slot (-1: never written), grown to the largest slot seen."""

    def __init__(self, window: int, block_size: int):
        self.window, self.block_size = int(window), int(block_size)
        self.ids = np.full(0, -1, np.int64)

    def windows(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_start: np.ndarray,
                block_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store this pass's tokens [n] at `slots` [n], then return (window ids [n, K], real [n, K]): row t holds
        positions p_t-K+1 .. p_t of token t's request (p_t = positions[t], the last column is token t itself), real
        False before the request's start. query_start [R+1] (token offsets of each request, may be padded by
        repeating the last), block_table [R, blocks]."""
        n = len(tokens)
        if n == 0:
            return np.zeros((0, self.window), np.int64), np.zeros((0, self.window), bool)
        tokens, positions, slots = (np.asarray(a, np.int64) for a in (tokens, positions, slots))
        if slots.min() < 0:
            raise SlotMismatchError(f"a scheduled token has no KV cache slot ({int(slots.min())})")
        if slots.max() >= len(self.ids):
            grown = np.full(max(int(slots.max()) + 1, 2 * len(self.ids)), -1, np.int64)
            grown[:len(self.ids)] = self.ids
            self.ids = grown
        self.ids[slots] = tokens
        request = np.searchsorted(np.asarray(query_start, np.int64), np.arange(n), side="right") - 1
        at = positions[:, None] - np.arange(self.window - 1, -1, -1)[None]  # [n, K], the last column is p_t
        real = at >= 0
        at = np.maximum(at, 0)
        blocks = np.asarray(block_table, np.int64)[request[:, None], at // self.block_size]
        window_slots = blocks * self.block_size + at % self.block_size
        if not np.array_equal(window_slots[:, -1], slots):
            t = int(np.argmax(window_slots[:, -1] != slots))
            raise SlotMismatchError(f"token {t} at position {int(positions[t])} goes to slot {int(slots[t])}, but the "
                                    f"block table (block size {self.block_size}) puts it at {int(window_slots[t, -1])}")
        ids = np.where(real, self.ids[np.minimum(window_slots, len(self.ids) - 1)], -1)
        return ids, real & (ids >= 0)
