"""Sampling with a KV cache and per-token f-gram rows: `python -m scone_jax.serving.generate --export=DIR --prompt=...`.

Decoding runs the training model itself: Decoder.decode with a KVCache (model/layers.py) threads the
keys and values of earlier positions through the same attention, blocks and block stack, so this
module only builds the cache, calls the model and samples; tests pin the cached logits to the full
forward pass. At each step the host matches the newest token's longest f-gram over the last K tokens
and sends that one row with the token, so the device never holds the f-gram table. The match is
incremental: the host keeps the trie slots of the f-grams ending at the newest token
(Matcher.match_next), so a new token costs one lookup of its K-1 candidate f-grams and one row
gather: a few microseconds from RAM, one disk read (about 0.1 ms) with --table=disk, since the
next token's row cannot be known ahead. An Over-Encoding or Engram export's n-gram ids come the same way: the host
keeps each row's last n-1 tokens and hashes the n-grams the new token ends (NgramHasher.next_ids,
EngramHasher.next_ids); Engram's convolution reads earlier positions from the cache's engram buffers.
"""
from __future__ import annotations

import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from scone_jax import sharding
from scone_jax.batch import Batch
from scone_jax.data.prompt import prompt_ids
from scone_jax.model import scone, transformer
from scone_jax.runtime import logs, tool_main
from scone_jax.serving import inference

# The KV cache's slots, rounded up to a multiple of this: the one-token step's shapes depend on the cache's
# length only, so prompts whose lengths round to the same size share one compiled step instead of compiling
# their own (a prompt set of 40 lengths compiled 40 steps). Unwritten slots are masked (cached_attention).
CACHE_SLOTS_MULTIPLE = 64

# Each row's key for step i: one compiled function for every call (a jit built per call compiled per call).
_step_keys = jax.jit(jax.vmap(jax.random.fold_in, (0, None)))


def cache_slots(length: int) -> int:
    """The KV cache length for `length` tokens: `length` rounded up to a multiple of CACHE_SLOTS_MULTIPLE."""
    return -(-length // CACHE_SLOTS_MULTIPLE) * CACHE_SLOTS_MULTIPLE


def filtered_logits(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """`logits` [..., V] / temperature, every token outside the top_k (0 = all) and then outside the nucleus of
    top_p set to -inf: the smallest set of the most likely tokens whose probabilities (after top_k) sum to at
    least top_p (the most likely token always stays; ties with the last kept token stay too), as Hugging Face's
    temperature, top-k and top-p warpers apply them in that order."""
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ranked = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above each one
        smallest = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < smallest, -jnp.inf, logits)
    return logits


def sample(logits, key, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Greedy at temperature 0, else a draw from filtered_logits."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p)).astype(jnp.int32)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """The sampling settings' ranges, one line naming the flag and the fix."""
    if temperature < 0:
        raise ValueError(f"--temperature={temperature} is negative. Fix: 0 (greedy) or a positive value.")
    if top_k < 0:
        raise ValueError(f"--top_k={top_k} is negative. Fix: 0 (all tokens) or a positive count.")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top_p={top_p} is not in (0, 1]. Fix: 1 (no nucleus) or e.g. 0.95.")


class Generator:
    """Compiled prefill and one-token step for a batch of equal-length prompts. Each row draws with a key of its own
    (row_keys), so what a row samples does not depend on the rows beside it."""

    def __init__(self, served: inference.Served, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 use_table: bool = True):
        check_sampling(temperature, top_k, top_p)
        self.served, self.use_table = served, use_table
        self.max_len = served.matcher.max_len
        graphdef = served.graphdef

        def run(params, cache, tokens, rows, matched, ngram_ids, keys):
            decoder = nnx.merge(graphdef, params)
            positions = cache.index + jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            batch = Batch(inputs=tokens, positions=positions, fgram_rows=rows, fgram_matched=matched,
                          ngram_ids=ngram_ids)
            h, cache = scone.hidden_states(decoder, batch, cache)
            last = decoder.logits(h[:, -1])
            chosen = jax.vmap(lambda logits, key: sample(logits, key, temperature, top_k, top_p))(last, keys)
            return chosen, last, cache

        self._run = sharding.under_mesh(served.mesh, jax.jit(run, donate_argnums=1))

    def _call(self, cache, tokens, keys, ids=None):
        """Run `tokens` [B, t] after the cached ones; `ids` are their f-gram ids (None: match them here), or with
        Over-Encoding their n-gram ids [B, t, S] (None: the prompt's, hashed here)."""
        if self.served.hasher is not None:
            ids = self.served.hasher.ids(tokens) if ids is None else ids
            return self._run(self.served.params, cache, tokens, None, None, ids, keys)
        if not self.use_table:  # the decoder alone: T(token) everywhere
            return self._run(self.served.params, cache, tokens, None, None, None, keys)
        if ids is None:
            ids = self.served.matcher.match(tokens, np.ones_like(tokens))
        return self._run(self.served.params, cache, tokens, self.served.table.gather(ids), ids >= 0, None, keys)

    def empty_cache(self, batch: int, length: int) -> transformer.KVCache:
        return transformer.init_cache(self.served.config.model, batch, length, self.served.config.get("engram"))

    def generate(self, prompts: np.ndarray, num_tokens: int, seed: int = 0, forced: np.ndarray | None = None,
                 row_keys=None, stop_ids=None) -> dict:
        """Extend token prompts [B, P] by num_tokens. Returns tokens [B, P+n], the logits that chose each
        new token [B, n, V], and the per-token latency of the one-token steps (seconds).
        `forced` [B, n] replaces the samples (teacher forcing: scores a given continuation). Row r draws new token i
        with fold_in(row_keys[r], i) (row_keys: B JAX keys; default split from `seed`). With `stop_ids`, decoding
        ends early once every row has produced one of them (n is then the steps taken; a row's tokens after its
        stop are whatever it drew)."""
        prompts = np.asarray(prompts, np.int32)
        b, p = prompts.shape
        length = p + num_tokens
        if self.served.config.model.position == "learned" and length > self.served.config.model.max_seq_len:
            raise ValueError(f"Prompt ({p}) + {num_tokens} new tokens exceed model.max_seq_len="
                             f"{self.served.config.model.max_seq_len}, the longest sequence the model knows.")
        row_keys = jax.random.split(jax.random.key(seed), b) if row_keys is None else row_keys
        stops = None if stop_ids is None else np.asarray(sorted(stop_ids), np.int32)
        done = np.zeros(b, bool)
        tokens = np.zeros((b, length), np.int32)
        tokens[:, :p] = prompts
        cache = self.empty_cache(b, cache_slots(length))
        new, last, cache = self._call(cache, prompts, _step_keys(row_keys, 0))
        logits = [last]
        start_time, steps = None, 0
        matcher, hasher, ids = self.served.matcher, self.served.hasher, None
        if hasher is not None:  # the last n-1 tokens; each next_ids hands on the next ones
            history = prompts
        elif self.use_table:  # the trie state after the prompt; each match_next hands on the next one
            prefix = matcher.prefix_codes(prompts[:, max(0, p - self.max_len + 1):])
        for i in range(1, num_tokens):
            if i == 2:
                start_time = time.perf_counter()  # step 1 compiled the one-token step
            end = p + i - 1  # position of the token the device is choosing now
            tokens[:, end] = np.asarray(new) if forced is None else forced[:, i - 1]  # waits for the device
            if stops is not None:
                done |= np.isin(tokens[:, end], stops)
                if done.all():
                    length = end + 1
                    break
            if hasher is not None:
                ids, history = hasher.next_ids(history, tokens[:, end])
                ids = ids[:, None]
            elif self.use_table:
                ids, prefix = matcher.match_next(prefix, tokens[:, end])
                ids = ids[:, None]
            new, last, cache = self._call(cache, tokens[:, end:end + 1], _step_keys(row_keys, i), ids)
            logits.append(last)
            steps += i >= 2
        else:
            tokens[:, length - 1] = np.asarray(new) if forced is None else forced[:, -1]
        latency = (time.perf_counter() - start_time) / steps if steps else None
        return {"tokens": tokens[:, :length], "logits": np.stack(jax.device_get(logits), 1), "seconds_per_token": latency}


def sample_text(tok, row, prompt_length: int, prompt: str) -> str:
    """The prompt's ids and the row's new ones (up to eos) decoded together: a tokenizer that drops the leading
    space of a word's first piece (SentencePiece's '\u2581') keeps it at the seam, which decoding the continuation
    on its own lost ('In the beginningof')."""
    text_ids = [int(i) for i in tok.encode(prompt)]  # the prompt without the bos (or eos) it was read after
    new = [int(i) for i in row[prompt_length:]]
    if tok.eos_id in new:
        new = new[: new.index(tok.eos_id)]
    return tok.decode(text_ids + new)


def _define_flags():
    """Command-line flags, defined only when this module runs as a program (modules share absl's registry)."""
    export = inference.define_export_flag()
    prompt = flags.DEFINE_string("prompt", "", "Text to continue.")
    num_tokens = flags.DEFINE_integer("num_tokens", 64, "New tokens per sample.")
    num_samples = flags.DEFINE_integer("num_samples", 1, "Samples drawn together as one batch.")
    temperature = flags.DEFINE_float("temperature", 0.8, "0 = greedy.")
    top_k = flags.DEFINE_integer("top_k", 40, "Sample among the k most likely tokens (0 = all).")
    top_p = flags.DEFINE_float("top_p", 1.0, "Then among the fewest most likely tokens whose probability sums to at "
                               "least top_p (1 = all).")
    seed = flags.DEFINE_integer("seed", 0, "Sampling seed.")
    table, max_table_bytes = inference.define_table_flags()
    return types.SimpleNamespace(
        export=export, prompt=prompt, num_tokens=num_tokens, num_samples=num_samples, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, table=table, max_table_bytes=max_table_bytes)


def run(args):
    logs.quiet_libraries()
    path = args.export.value
    tool_main.require(export=path)
    served = inference.load(path, table=args.table.value, max_table_bytes=args.max_table_bytes.value)
    tok = served.tokenizer
    prompt = prompt_ids(tok, args.prompt.value, served.config.data.add_bos)  # [bos] + ids unless the run had none
    generator = Generator(served, temperature=args.temperature.value, top_k=args.top_k.value, top_p=args.top_p.value)
    out = generator.generate(np.tile(prompt, (args.num_samples.value, 1)), args.num_tokens.value, seed=args.seed.value)
    for row in out["tokens"]:
        print(sample_text(tok, row, len(prompt), args.prompt.value))
    if out["seconds_per_token"] is not None:
        print(f"{1000 * out['seconds_per_token']:.2f} ms/token", file=sys.stderr)


if __name__ == "__main__":
    _args = _define_flags()
    tool_main.run(lambda: run(_args), program="scone_jax.serving.generate")
