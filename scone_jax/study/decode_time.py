"""Per-token decode time of exports, timed against each other (tools/bench_finetune.py; the paper's 10.05 against
10.13 ms per token for Qwen3-4B with and without SCONE).

Each export is served as a user serves it (serving/inference.py: the decoder on the device, an f-gram table's rows
from host RAM, the newest token's f-gram matched on the host at every step) and decodes greedily with the KV
cache (serving/generate.py, whose `seconds_per_token` times the one-token steps after the first, so compilation
is left out). On a shared machine one export timed after another measures the load as much as the model, so the
exports take turns, `repeats` rounds of one decode each, and each gets the median of its rounds.
"""
from __future__ import annotations

import statistics

import numpy as np

from scone_jax.data.prompt import prompt_ids
from scone_jax.serving import generate, inference


def ms_per_token(exports: list[str], prompt: str, new_tokens: int = 64, repeats: int = 5) -> list[float]:
    """Median milliseconds per decoded token of each of `exports` (batch of one row, greedy, `new_tokens` after
    `prompt`; at most half a model's positions, the prompt cut to its last tokens to fit), the exports decoding in
    turn within each round."""
    generators, prompts = [], []
    for path in exports:
        served = inference.load(path)
        ids = prompt_ids(served.tokenizer, prompt, served.config.data.add_bos)
        new_tokens = min(new_tokens, served.config.model.max_seq_len // 2)  # a tiny model's few positions
        prompts.append(np.asarray(ids[-(served.config.model.max_seq_len - new_tokens):], np.int32)[None])
        generators.append(generate.Generator(served, temperature=0.0))
    for generator, ids in zip(generators, prompts):
        generator.generate(ids, new_tokens)  # compiles the prompt and one-token steps
    times: list[list[float]] = [[] for _ in exports]
    for _ in range(repeats):
        for i, (generator, ids) in enumerate(zip(generators, prompts)):
            times[i].append(generator.generate(ids, new_tokens)["seconds_per_token"])
    return [1000 * statistics.median(t) for t in times]
