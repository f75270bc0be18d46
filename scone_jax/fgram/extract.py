"""One-machine f-gram extraction, exactly as docs/method.md §1 says, on all cores.

The corpus is read once and spooled to a scratch file (int32, each document
followed by -1), so the K-1 scans re-read it from disk, never from RAM, and a
one-shot iterator works. Scan n counts the n-grams whose (n-1)-prefix and
(n-1)-suffix survived the previous scans: the survivors form a trie in one hash
table (trie.py). Scan n looks up the (n-1)-grams ending at each position once,
stores their ids in a per-position state file for scan n+1, and counts the
n-grams whose two (n-1)-grams (ending at e-1 and at e) were both found. That
per-position walk is one compiled loop per chunk (numba_loops.py), which prefetches
the hash bucket of the position 16 steps ahead so the table's cache misses overlap.

Memory stays bounded: the corpus lives on disk; worker processes count chunks of
`chunk_tokens` and spill sorted runs once they hold `spill_limit` distinct
n-grams (counting.py); the reduce step merges one hash partition at a time. What
grows with the corpus is only the set of n-grams that reach the count threshold,
which every exact method must hold. The threshold is min_count, raised to the
count of the S-th best f-gram found so far once there are S of them: an n-gram
below it can't make the top S, nor can its extensions (their counts are lower).
Counts are exact, so the result does not depend on the number of workers.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
from collections.abc import Callable, Iterable

import numpy as np

from scone_jax.fgram import counting, trie
from scone_jax.fgram.numba_loops import compiled, prefetch
from scone_jax.fgram.vocab import FgramVocab, build_vocab
from scone_jax.runtime import parent_watch

SEPARATOR = -1
_SCRATCH = "fgrams"  # scratch directories are fgrams-<pid>-<host>-<random> (parent_watch.scratch_name)
_AHEAD = 16  # positions between prefetching a bucket and probing it
Progress = Callable[[str, int, "int | None"], None]  # (phase, done tokens, total tokens or None)


def check_extract_args(max_len: int, num_fgrams: int, min_count: int, vocab_size: int) -> None:
    if max_len < 2:
        raise ValueError(f"max_len (K) = {max_len}: f-grams have 2..K tokens, so K must be >= 2 (the paper uses 5).")
    if num_fgrams <= 0:
        raise ValueError(f"num_fgrams (S) = {num_fgrams} must be > 0: it is how many f-grams to keep.")
    if min_count < 1:
        raise ValueError(f"min_count = {min_count} must be >= 1 (the paper uses 5).")
    if not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab_size = {vocab_size} must be the tokenizer's vocabulary size, in [1, 2^31).")


def check_document(index: int | None, doc, vocab_size: int) -> np.ndarray:
    """`doc` as int32 ids, or a clear error naming the document (if `index` is known) and the bad value."""
    doc = np.asarray(doc)
    name = "A document" if index is None else f"Document {index}"
    if doc.ndim != 1 or not (np.issubdtype(doc.dtype, np.integer) or doc.size == 0):
        raise ValueError(f"{name} is {doc.dtype} {doc.shape}; expected a 1-D array of integer token ids.")
    if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
        bad = doc.min() if doc.min() < 0 else doc.max()
        raise ValueError(
            f"{name} holds token id {bad}, outside [0, vocab_size={vocab_size}). Fix: pass the "
            "vocab_size of the tokenizer that produced these ids (or re-tokenize with it)."
        )
    return doc.astype(np.int32)


def _spool(documents: Iterable, vocab_size: int, path: str, progress: Progress | None) -> tuple[int, int]:
    """Writes the documents to `path` as int32 with -1 after each; returns (tokens, documents)."""
    tokens = docs = 0
    pending, held = [], 0
    with open(path, "wb") as out:
        for docs, doc in enumerate(documents, start=1):
            doc = check_document(docs - 1, doc, vocab_size)
            pending += [doc, np.array([SEPARATOR], np.int32)]
            held += len(doc)
            if held >= 1 << 20:
                out.write(np.concatenate(pending).tobytes())
                tokens, pending, held = tokens + held, [], 0
                if progress:
                    progress("read corpus", tokens, None)
        out.write(np.concatenate(pending).tobytes() if pending else b"")
    tokens += held
    if tokens == 0:
        raise ValueError(f"The corpus is empty: {docs} document(s) with 0 tokens in all. Fix: point at real data.")
    return tokens, docs


@compiled
def _chunk_keys(tokens, left, offset, keys, num_buckets, id_of_slot, vocab_size, first, ids, out):
    """Scan n >= 3 over one chunk (tokens, -1 between documents); returns how many keys it wrote to `out`.

    The (n-1)-gram ending at e is (left[e-1] + offset, tokens[e]) in trie.py's key form: left is the
    tokens with offset 0 for n = 3, else the previous scan's (n-2)-gram ids with offset V; it can only
    be a survivor where left[e-1] and left[e] are >= 0. ids[e] = its id (-1: none). out: the keys of
    the n-grams ending at e >= first whose (n-1)-prefix and (n-1)-suffix both survived.
    """
    v, offset = np.uint64(vocab_size), np.uint64(offset)
    written = 0
    ids[0] = -1
    for e in range(1, len(tokens)):
        a = e + _AHEAD
        if a < len(tokens) and left[a - 1] >= 0 and left[a] >= 0:
            key = (np.uint64(left[a - 1]) + offset) * v + np.uint64(tokens[a])
            prefetch(keys, trie.home(key, num_buckets) * trie.WIDTH)
        slot = -1
        if left[e - 1] >= 0 and left[e] >= 0:
            slot = trie.probe(keys, num_buckets, (np.uint64(left[e - 1]) + offset) * v + np.uint64(tokens[e]))
        ids[e] = id_of_slot[slot] if slot >= 0 else -1
        if e >= first and ids[e] >= 0 and ids[e - 1] >= 0:
            out[written] = (np.uint64(ids[e - 1]) + v) * v + np.uint64(tokens[e])
            written += 1
    return written


@compiled
def _pair_keys(tokens, first, vocab_size, out):
    """Scan 2 over one chunk: the keys of the 2-grams ending at e >= first; returns how many."""
    v = np.uint64(vocab_size)
    written = 0
    for e in range(max(first, 1), len(tokens)):
        if tokens[e - 1] >= 0 and tokens[e] >= 0:
            out[written] = np.uint64(tokens[e - 1]) * v + np.uint64(tokens[e])
            written += 1
    return written


def _count_task(task: dict) -> list[str]:
    """Counts scan n's candidates ending in [start, stop) of the spooled corpus; returns spilled runs.

    For n >= 3 it also records the ids of the (n-1)-grams found by the previous
    scan per position in the state file that scan n+1 reads, so no scan looks up
    more than one length.
    """
    n, start, stop, chunk_tokens, v = task["n"], task["start"], task["stop"], task["chunk_tokens"], task["vocab_size"]
    corpus = np.memmap(task["corpus"], dtype=np.int32, mode="r")
    writer = counting.RunWriter(task["run_prefix"], task["spill_limit"])
    if n > 2:
        keys, num_buckets = np.load(task["table"], mmap_mode="r"), task["num_buckets"]
        id_of_slot = np.load(task["id_of_slot"], mmap_mode="r")
        ids = np.empty(chunk_tokens + 2, np.int32)
    out = np.empty(chunk_tokens, np.uint64)
    for chunk in range(start, stop, chunk_tokens):
        # Two tokens of context: the (n-1)-gram ending at chunk-1 needs the state at chunk-2.
        lo, hi = max(0, chunk - 2), min(stop, chunk + chunk_tokens)
        tokens = np.asarray(corpus[lo:hi])
        if n == 2:
            written = _pair_keys(tokens, chunk - lo, v, out)
        else:
            left, offset = tokens, 0
            if n > 3:
                left, offset = np.asarray(np.memmap(task["state_in"], dtype=np.int32, mode="r")[lo:hi]), v
            written = _chunk_keys(tokens, left, offset, keys, num_buckets, id_of_slot, v, chunk - lo, ids, out)
            np.memmap(task["state_out"], dtype=np.int32, mode="r+")[chunk:hi] = ids[chunk - lo : hi - lo]
        writer.add(out[:written])
    return writer.flush()


def _reduce_task(task: tuple[list[str], int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    return counting.reduce_partitions(*task)


@contextlib.contextmanager
def _mapper(num_workers: int):
    """imap_unordered over a spawn pool (safe next to JAX threads), or inline for one worker."""
    if num_workers == 1:
        yield map
        return
    with multiprocessing.get_context("spawn").Pool(num_workers, initializer=parent_watch.exit_with_parent) as pool:
        yield pool.imap_unordered


def _cutoff(levels: list[dict], num_fgrams: int, min_count: int) -> int:
    """max(min_count, count of the S-th best n-gram so far): nothing below it can enter the top S."""
    counts = np.concatenate([level["counts"] for level in levels]) if levels else np.zeros(0, np.int64)
    if len(counts) < num_fgrams:
        return min_count
    return max(min_count, int(np.partition(counts, len(counts) - num_fgrams)[len(counts) - num_fgrams]))


def _decode(keys: np.ndarray, counts: np.ndarray, levels: list[dict], vocab_size: int) -> dict:
    """A level of n-grams from their keys: prefix rows in the previous level, last tokens, token rows."""
    prefix = (keys // np.uint64(vocab_size)).astype(np.int64)
    last = (keys % np.uint64(vocab_size)).astype(np.int32)
    if not levels:
        return {"prefix": prefix, "last": last, "tokens": np.stack([prefix.astype(np.int32), last], 1),
                "counts": counts}
    prefix -= vocab_size + levels[-1]["first_id"]
    tokens = np.concatenate([levels[-1]["tokens"][prefix], last[:, None]], axis=1)
    return {"prefix": prefix, "last": last, "tokens": tokens, "counts": counts}


def _save_trie(levels: list[dict], vocab_size: int, directory: str) -> dict:
    """Writes the table of all levels so far (ids: rows numbered level after level); returns task fields."""
    keys = []
    for i, level in enumerate(levels):
        level["first_id"] = levels[i - 1]["first_id"] + len(levels[i - 1]["last"]) if i else 0
        if i == 0:
            keys.append(trie.pair_keys(level["prefix"], level["last"], vocab_size))
        else:
            keys.append(trie.extend_keys(level["prefix"] + levels[i - 1]["first_id"], level["last"], vocab_size))
    keys = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    table = trie.KeyTable(len(keys))
    slots = table.insert(keys)
    id_of_slot = np.full(table.keys.size + 1, -1, dtype=np.int32)  # + 1: slot -1 (absent) maps to -1
    id_of_slot[slots] = np.arange(len(keys), dtype=np.int32)
    paths = {"table": os.path.join(directory, "table.npy"), "id_of_slot": os.path.join(directory, "id_of_slot.npy")}
    np.save(paths["table"], table.keys)
    np.save(paths["id_of_slot"], id_of_slot)
    return paths | {"num_buckets": table.num_buckets}


def extract_fgrams(
    documents: Iterable[np.ndarray],
    *,
    max_len: int = 5,
    num_fgrams: int,
    min_count: int = 5,
    vocab_size: int,
    tokenizer_fingerprint: str = "",
    num_workers: int | None = None,
    progress: Progress | None = None,
    work_dir: str | None = None,
    chunk_tokens: int = 1 << 20,
    spill_limit: int = 1 << 23,
) -> FgramVocab:
    """The top `num_fgrams` n-grams (2 <= n <= max_len) of `documents`, ranked as docs/method.md §1 says.

    `documents` yields one int32 token array per document (n-grams never cross
    documents); it is read once. Scratch files go to `work_dir` (default: the
    system temp dir) and need ~4 bytes per token plus the spilled runs.
    `num_workers` > 1 (default: all cores) uses spawned processes, so a calling
    script needs the `if __name__ == "__main__":` guard. min_count applies to every
    length, so every f-gram occurs at least min_count times.
    """
    check_extract_args(max_len, num_fgrams, min_count, vocab_size)
    num_workers = num_workers or len(os.sched_getaffinity(0))
    parent_watch.remove_stale_scratch(work_dir or tempfile.gettempdir(), _SCRATCH)  # left by killed runs
    with tempfile.TemporaryDirectory(dir=work_dir, prefix=parent_watch.scratch_name(_SCRATCH)) as tmp, \
            _mapper(num_workers) as mapper:
        corpus = os.path.join(tmp, "corpus.i32")
        tokens_counted, _ = _spool(documents, vocab_size, corpus, progress)
        length = os.path.getsize(corpus) // 4
        per_task = max(chunk_tokens, min(16 * chunk_tokens, -(-length // (2 * num_workers))))
        levels: list[dict] = []
        for n in range(2, max_len + 1):
            state = {"state_in": os.path.join(tmp, f"state-{n - 2}.i32"),
                     "state_out": os.path.join(tmp, f"state-{n - 1}.i32")}
            if n > 2:
                np.memmap(state["state_out"], dtype=np.int32, mode="w+", shape=(length,)).flush()
            common = {"n": n, "vocab_size": vocab_size, "corpus": corpus, "chunk_tokens": chunk_tokens,
                      "spill_limit": spill_limit, **state, **_save_trie(levels, vocab_size, tmp)}
            tasks = [common | {"start": start, "stop": min(length, start + per_task),
                               "run_prefix": os.path.join(tmp, f"run-{n}-{start}")}
                     for start in range(0, length, per_task)]
            runs, done = [], 0
            for task_runs in mapper(_count_task, tasks):
                runs += task_runs
                done += per_task
                if progress:
                    progress(f"count {n}-grams", min(done, length), length)
            if os.path.exists(state["state_in"]):
                os.remove(state["state_in"])
            runs.sort()  # the reduce sums counts, so run order can't matter; sorting keeps it reproducible anyway
            threshold = _cutoff(levels, num_fgrams, min_count)
            groups = counting.group_partitions(runs, spill_limit)
            parts = list(mapper(_reduce_task, [(runs, lo, hi, threshold) for lo, hi in groups]))
            counting.remove_runs(runs)
            keys, counts = counting.merge_counts([k for k, _ in parts], [c for _, c in parts])
            if not len(keys):
                break
            levels.append(_decode(keys, counts, levels, vocab_size))
    if not levels:
        raise ValueError(
            f"No 2-gram occurs min_count={min_count} times in the {tokens_counted} tokens counted. "
            "Fix: lower min_count or give more text."
        )
    return build_vocab(
        [(level["tokens"], level["counts"]) for level in levels],
        num_fgrams=num_fgrams, max_len=max_len, min_count=min_count, tokens_counted=tokens_counted,
        vocab_size=vocab_size, tokenizer_fingerprint=tokenizer_fingerprint,
    )
