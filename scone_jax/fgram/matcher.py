"""Longest-match f-gram lookup (docs/method.md §2) over a whole batch in one compiled pass.

The vocabulary is stored as a trie in one hash table (trie.py), keyed by the
prefix's slot, so the slot found at length n is the id needed at length n+1.
Matching walks the positions once (a compiled loop, `_longest_ids`): at each it
probes the 2-gram, then extends the f-grams that ended one position before by the
new token, shortest first. By the closure property the first length that misses
ends the walk, so the last length that matched is the longest match, and most
positions need one or two probes.
Host memory: the table (8 bytes per slot) plus an int32 f-gram id per slot, at
LOAD = 0.6 keys per slot ~ 20 bytes per f-gram, besides the vocabulary's tokens.
"""
from __future__ import annotations

import numpy as np

from scone_jax.fgram import trie
from scone_jax.fgram.numba_loops import compiled
from scone_jax.fgram.vocab import FgramVocab

_FEW_KEYS = 32  # up to this many keys, match_next works in plain Python (faster than numpy calls)


@compiled
def _longest_ids(flat, pair_ok, keys, num_buckets, vocab_size, max_len, fgram_id, out, suffix_out):
    """out[e] = id of the longest f-gram ending at e (-1: none); pair_ok[e]: e-1 and e are in one segment.
    Unless suffix_out is None, also suffix_out[e, j] = id of the (j+2)-gram ending at e, for every j
    below the longest match's length - 1 (the caller fills it with -1 first). numba compiles the
    None case separately, without the branch, so plain matching pays nothing for it.

    Walks the positions once, keeping chain[j] = slot of the (j+2)-gram ending at the previous
    position for j < depth. The (j+3)-gram ending at e is that (j+2)-gram plus token e, so its key
    needs chain[j] only; by closure the first length that misses ends the walk at e.
    """
    v = np.uint64(vocab_size)
    chain = np.empty(max(1, max_len - 1), np.int64)
    depth = 0
    for e in range(len(flat)):
        if not pair_ok[e]:
            out[e], depth = -1, 0
            continue
        token = np.uint64(flat[e])
        found = trie.probe(keys, num_buckets, np.uint64(flat[e - 1]) * v + token)
        matched, j = 0, 0
        while found >= 0:
            extends = chain[j]  # read before it is replaced: the (j+2)-gram ending at e-1
            chain[j] = found
            matched = j + 1
            if j >= depth or j >= max_len - 2:  # no (j+2)-gram ended at e-1, or it has K tokens
                break
            found = trie.probe(keys, num_buckets, (np.uint64(extends) + v) * v + token)
            j += 1
        out[e] = fgram_id[chain[matched - 1]] if matched else -1
        if suffix_out is not None:
            for i in range(matched):
                suffix_out[e, i] = fgram_id[chain[i]]
        depth = matched


class Matcher:
    """Built once from a vocabulary; `match` is read-only, so one Matcher can serve many threads."""

    def __init__(self, vocab: FgramVocab):
        self.max_len = vocab.max_len
        self.vocab_size = vocab.vocab_size
        self.tokenizer_fingerprint = vocab.tokenizer_fingerprint
        self.table = trie.KeyTable(vocab.num_fgrams)
        rows_by_slot = []
        for n in range(2, vocab.max_len + 1):
            rows = np.flatnonzero(vocab.lengths == n)
            tokens = vocab.tokens[rows, :n]
            if n == 2:
                keys = trie.pair_keys(tokens[:, 0], tokens[:, 1], self.vocab_size)
            else:
                prefix = self._slots_of(tokens[:, :-1])
                self._check_closed(vocab, rows, prefix, "prefix")
                keys = trie.extend_keys(prefix, tokens[:, -1], self.vocab_size)
            rows_by_slot.append((self.table.insert(keys), rows))
        for n in range(3, vocab.max_len + 1):
            rows = np.flatnonzero(vocab.lengths == n)
            self._check_closed(vocab, rows, self._slots_of(vocab.tokens[rows, 1:n]), "suffix")
        # One extra entry, -1, so that slot -1 (no match) maps to id -1 without a branch.
        self.fgram_id = np.full(self.table.keys.size + 1, -1, dtype=np.int32)
        for slots, rows in rows_by_slot:
            self.fgram_id[slots] = rows

    def _slots_of(self, grams: np.ndarray) -> np.ndarray:
        """Slots of n-gram rows [m, n] already in the table; -1 where a row (or one of its prefixes) is not."""
        slots = self.table.lookup(trie.pair_keys(grams[:, 0], grams[:, 1], self.vocab_size))
        missing = slots < 0
        for j in range(2, grams.shape[1]):
            slots = self.table.lookup(trie.extend_keys(np.maximum(slots, 0), grams[:, j], self.vocab_size))
            missing |= slots < 0
        return np.where(missing, -1, slots)

    @staticmethod
    def _check_closed(vocab: FgramVocab, rows: np.ndarray, slots: np.ndarray, part: str) -> None:
        if (slots < 0).any():
            row = int(rows[np.argmax(slots < 0)])
            raise ValueError(
                f"The vocabulary is not closed under sub-n-grams: the {part} of f-gram {row} {vocab.fgram(row)} "
                "is no f-gram, so longest-match by probing n = 2, 3, ... would be wrong. Use a vocabulary "
                "built by extract_fgrams (whose counts guarantee closure)."
            )

    @property
    def nbytes(self) -> int:
        """Host memory of the index (the table and the slot-to-id map), without the vocabulary tokens."""
        return self.table.nbytes + self.fgram_id.nbytes

    def match(self, tokens: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
        """int32 [B, T]: id of the longest f-gram ending at each position inside its segment, else -1.

        Segment id 0 marks padding, which never matches; an f-gram never spans two
        segments (documents) nor two rows.
        """
        return self._match(tokens, segment_ids, suffixes=False)[0]

    def match_with_suffixes(self, tokens: np.ndarray, segment_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """match(), and int32 [B, T, K-1]: [b, t, j] = id of the (j+2)-token f-gram ending at (b, t)
        inside its segment, else -1. Every suffix of the longest match is an f-gram (closure), so
        row [b, t] lists them all up to the longest; the walk finds them anyway (dedup.py reads
        f-grams' prefixes here instead of matching them again)."""
        return self._match(tokens, segment_ids, suffixes=True)

    def _match(self, tokens, segment_ids, suffixes: bool):
        tokens, segment_ids = np.asarray(tokens), np.asarray(segment_ids)
        if tokens.ndim != 2 or tokens.shape != segment_ids.shape:
            raise ValueError(f"tokens {tokens.shape} and segment_ids {segment_ids.shape} must both be [B, T].")
        suffix_ids = np.full((*tokens.shape, self.max_len - 1), -1, np.int32) if suffixes else None
        if tokens.size == 0:
            return np.full(tokens.shape, -1, np.int32), suffix_ids
        flat, segments = tokens.ravel(), segment_ids.ravel()
        self._check_range(flat, segments != 0, tokens.shape)
        pair_ok = np.empty(flat.shape, dtype=bool)
        pair_ok[0] = False
        np.equal(segments[1:], segments[:-1], out=pair_ok[1:])
        pair_ok &= segments != 0
        pair_ok[:: tokens.shape[1]] = False  # a row never continues the previous one
        ids = np.empty(flat.shape, np.int32)
        _longest_ids(flat, pair_ok, self.table.keys, self.table.num_buckets, self.vocab_size, self.max_len,
                     self.fgram_id, ids, None if suffix_ids is None else suffix_ids.reshape(-1, self.max_len - 1))
        return ids.reshape(tokens.shape), suffix_ids

    def prefix_codes(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The half of a match of the token after `context` [B, L] that does not need that token.

        Returns (codes uint64 [B, m], valid bool [B, m]) with m = min(L, K-1): column j stands for the
        context's last j+1 tokens as the prefix of a (j+2)-gram (trie.py: the token itself for j = 0,
        else V + the slot of that f-gram; invalid where it is no f-gram). Decoding computes it once
        for the prompt; match_next then returns the next prefix with each match.
        The context is one document (no segment boundaries)."""
        context = np.asarray(context)
        m = min(context.shape[1], self.max_len - 1)
        codes = np.zeros((context.shape[0], m), np.uint64)
        valid = np.zeros((context.shape[0], m), bool)
        if m == 0:
            return codes, valid
        self._check_range(context.ravel(), np.ones(context.size, bool), context.shape)
        codes[:, 0], valid[:, 0] = context[:, -1], True
        for n in range(2, m + 1):
            slots = self._slots_of(context[:, -n:])
            codes[:, n - 1] = np.maximum(slots, 0).astype(np.uint64) + np.uint64(self.vocab_size)
            valid[:, n - 1] = slots >= 0
        return codes, valid

    def match_next(self, prefix: tuple[np.ndarray, np.ndarray], tokens: np.ndarray):
        """(ids int32 [B], next prefix): the longest f-gram ending at `tokens` [B] right after the context
        that `prefix` stands for (from prefix_codes or the previous match_next), else -1, equal to
        match() over context + token at the end; and the prefix codes of context + token, which are
        the slots just looked up, so decoding walks the trie once per token. A token outside the
        tokenizer's vocabulary (a row of the model's padded embedding, which sampling may pick) ends and
        starts no f-gram: its match is -1 and the next prefix holds nothing."""
        codes, valid = prefix
        tokens = np.asarray(tokens)
        known = (tokens >= 0) & (tokens < self.vocab_size)
        if not known.all():
            ids, (next_codes, next_valid) = self.match_next((codes, valid & known[:, None]), np.where(known, tokens, 0))
            next_valid[~known] = False
            return np.where(known, ids, -1).astype(np.int32), (next_codes, next_valid)
        b, m = codes.shape
        if b * m <= _FEW_KEYS:  # also every empty context (m = 0)
            return self._match_next_few(codes, valid, tokens)
        keys = (codes * np.uint64(self.vocab_size) + tokens.astype(np.uint64)[:, None]).ravel()
        slots = np.where(valid, self.table.lookup(keys).reshape(b, m), -1)
        hit = slots >= 0
        # Closure: the longest hit is the match; column m (-1) stands for "none".
        longest = np.where(hit.any(axis=1), m - 1 - np.argmax(hit[:, ::-1], axis=1), m)
        ids = self.fgram_id[np.concatenate([slots, np.full((b, 1), -1)], axis=1)[np.arange(b), longest]]
        width = min(m + 1, self.max_len - 1)
        next_codes, next_valid = np.empty((b, width), np.uint64), np.ones((b, width), bool)
        next_codes[:, 0] = tokens
        next_codes[:, 1:] = np.maximum(slots[:, :width - 1], 0).astype(np.uint64) + np.uint64(self.vocab_size)
        next_valid[:, 1:] = hit[:, :width - 1]
        return ids, (next_codes, next_valid)

    def _match_next_few(self, codes, valid, tokens):
        """match_next for a handful of keys (a few sequences decoding) in plain Python integers: the
        vectorized path's ~30 numpy calls cost more than the lookups themselves."""
        v, lookup, fgram_id = self.vocab_size, self.table.lookup_one, self.fgram_id
        keep = min(codes.shape[1] + 1, self.max_len - 1) - 1  # prefix columns handed on after the token
        ids, next_codes, next_valid = [], [], []
        for row_codes, row_valid, token in zip(codes.tolist(), valid.tolist(), tokens.tolist()):
            slots = [lookup(c * v + token) if ok else -1 for c, ok in zip(row_codes, row_valid)]
            ids.append(next((int(fgram_id[s]) for s in reversed(slots) if s >= 0), -1))
            next_codes.append([token] + [s + v if s >= 0 else 0 for s in slots[:keep]])
            next_valid.append([True] + [s >= 0 for s in slots[:keep]])
        return (np.array(ids, np.int32),
                (np.array(next_codes, np.uint64).reshape(len(ids), keep + 1),
                 np.array(next_valid, bool).reshape(len(ids), keep + 1)))

    def _check_range(self, flat: np.ndarray, real: np.ndarray, shape) -> None:
        bad = real & ((flat < 0) | (flat >= self.vocab_size))
        if bad.any():
            where = np.unravel_index(int(np.argmax(bad)), shape)
            raise ValueError(
                f"Token id {flat[np.argmax(bad)]} at {tuple(int(i) for i in where)} is outside [0, "
                f"{self.vocab_size}), the vocabulary of tokenizer {self.tokenizer_fingerprint!r} that the "
                "f-grams were built with. Fix: tokenize with that tokenizer, or re-extract f-grams for yours."
            )
