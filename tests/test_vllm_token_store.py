"""The vLLM plugin's windows (scone_jax/serving/vllm_plugin/token_store.py) give, for every token vLLM schedules, the
longest f-gram that scone_jax's own Matcher finds at that position of the whole request, whatever the scheduler does:
passes mixing requests, prefill in chunks of any size, decoding one token at a time, requests reusing another's cached
blocks (prefix caching), and requests preempted, their blocks handed to others, then recomputed. A simulated scheduler
drives it (numpy only: no vLLM needed, so the fast tier runs it).

Deliberate bugs this test was run against once (each made it fail, injected into a copy of token_store.py):
  - each window read one slot early (`self.ids[window_slots - 1]`: an off-by-one match position);
  - positions before the request's start not masked (`real = at >= -K`: a match across the request's start);
  - the pass's tokens stored after the windows are read (a prefill chunk's own earlier tokens missing).
Shifting the positions themselves (`at = positions - 1 - ...`) is stopped earlier, by TokenStore's own check that
each window ends at the token's slot (SlotMismatchError).
"""
import numpy as np

from scone_jax.fgram import Matcher, extract_fgrams
from scone_jax.hf.remote_code.scone_fgrams import FgramMatcher
from scone_jax.serving.vllm_plugin.token_store import SlotMismatchError, TokenStore

V, K, BLOCK = 12, 4, 4


def vocabulary(rng):
    docs = [rng.integers(0, V, rng.integers(20, 80)).astype(np.int32) for _ in range(200)]
    return extract_fgrams(docs, max_len=K, num_fgrams=300, min_count=2, vocab_size=V, num_workers=1)


class Scheduler:
    """Requests' tokens, block tables over a pool of blocks, and the number of tokens each has computed."""

    def __init__(self, rng, num_blocks=64):
        self.rng, self.free = rng, list(range(1, num_blocks))  # block 0 stays unused, as vLLM's null block
        self.tokens, self.tables, self.done = {}, {}, {}

    def add(self, name, tokens, share=None, shared_blocks=0):
        """A request; with `share`, its first `shared_blocks` blocks are that request's (a prefix-cache hit)."""
        self.tokens[name] = np.asarray(tokens, np.int64)
        blocks = -(-len(tokens) // BLOCK)
        own = [self.free.pop(self.rng.integers(len(self.free))) for _ in range(blocks - shared_blocks)]
        self.tables[name] = (self.tables[share][:shared_blocks] if share else []) + own
        self.done[name] = shared_blocks * BLOCK

    def preempt(self, name):
        """Free the request's blocks (to be reused) and give it new ones: it recomputes from its start."""
        self.free += self.tables[name]
        self.rng.shuffle(self.free)
        self.add(name, self.tokens[name])

    def step(self, budget):
        """One pass: each unfinished request gets a chunk (1..budget tokens). Returns the pass's arrays and, for each
        token, (request, position)."""
        names = [n for n in self.tokens if self.done[n] < len(self.tokens[n])]
        for name in names:  # a decoded token past the last block gets a new one
            while len(self.tables[name]) * BLOCK < len(self.tokens[name]):
                self.tables[name] = self.tables[name] + [self.free.pop()]
        tokens, positions, slots, starts, table, who = [], [], [], [0], [], []
        width = max(len(t) for t in self.tables.values())
        for name in names:
            take = min(int(self.rng.integers(1, budget + 1)), len(self.tokens[name]) - self.done[name])
            at = np.arange(self.done[name], self.done[name] + take)
            blocks = np.asarray(self.tables[name])
            tokens.append(self.tokens[name][at])
            positions.append(at)
            slots.append(blocks[at // BLOCK] * BLOCK + at % BLOCK)
            starts.append(starts[-1] + take)
            table.append(np.pad(blocks, (0, width - len(blocks))))
            who += [(name, int(p)) for p in at]
            self.done[name] += take
        starts += [starts[-1]] * 2  # padded, as vLLM pads query_start_loc
        return (np.concatenate(tokens), np.concatenate(positions), np.concatenate(slots), np.array(starts),
                np.stack(table)), who


def test_windows_match_as_the_project_matcher_over_whole_requests():
    rng = np.random.default_rng(0)
    vocab = vocabulary(rng)
    ours, plugins = Matcher(vocab), FgramMatcher(vocab.tokens, vocab.lengths, V)
    store = TokenStore(K, BLOCK)
    sched = Scheduler(rng)
    base = rng.integers(0, V, 40)
    sched.add("a", base)
    sched.add("b", rng.integers(0, V, 23))
    want = {}
    checked = 0
    for step in range(60):
        if "c" not in sched.tokens and sched.done["a"] >= 2 * BLOCK:  # "c" reuses a's first blocks, then differs
            sched.add("c", np.concatenate([base[:2 * BLOCK], rng.integers(0, V, 17)]), share="a", shared_blocks=2)
        if step == 6:
            sched.preempt("b")
        if step == 8:
            sched.add("d", rng.integers(0, V, 1))  # a one-token request
        if step % 5 == 4:  # decoding: each finished request gets one more token
            for name in sched.tokens:
                if sched.done[name] == len(sched.tokens[name]):
                    sched.tokens[name] = np.append(sched.tokens[name], rng.integers(0, V))
        if not any(sched.done[n] < len(sched.tokens[n]) for n in sched.tokens):
            continue
        arrays, who = sched.step(budget=7)
        windows, real = store.windows(*arrays)
        got = plugins.longest(windows, real)[:, -1]
        for (name, position), g in zip(who, got):
            tokens = sched.tokens[name]
            want[name] = ours.match(tokens[None], np.ones((1, len(tokens)), np.int32))[0]
            assert g == want[name][position], (step, name, position)
            checked += int(g >= 0)
    assert "c" in sched.tokens and checked > 30  # the prefix was shared; matches were found, not only misses


def test_a_block_table_that_disagrees_with_the_slots_is_refused():
    store = TokenStore(K, BLOCK)
    args = np.array([5, 6]), np.array([0, 1]), np.array([8, 9]), np.array([0, 2]), np.array([[3]])
    try:
        store.windows(*args)
    except SlotMismatchError as e:
        assert "block table" in str(e)
    else:
        raise AssertionError("a mismatch was accepted")
