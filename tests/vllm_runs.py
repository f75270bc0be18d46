"""Small runs exported for vLLM, shared by tests/test_vllm_*.py and tools/bench_vllm.py: a SCONE run (Llama-style
decoder, GQA, untied head, model.embedding_multiplier=2) and a baseline Llama-style run (multiplier 1: a stock
checkpoint), each written as a bundle and with --format=hf. vLLM's CPU attention takes head sizes of 32, 64 or 128
only, so the heads are 32 wide (d_model 64, 2 heads). The tokenizer is a 300-token byte-level BPE tokenizer.json whose
template adds bos (vLLM and scone_jax tokenize alike); the models have exactly 300 embedding rows. The exports carry a
chat template (CHAT_TEMPLATE) for vLLM's chat endpoint.

`build(root, kind)` makes one in `root/kind` once (a DONE marker; a half-built directory is rebuilt)."""
from __future__ import annotations

import os
import shutil

from tests import hf_models

LLAMA_STYLE = dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=False)
# init_std 0.25: an untrained model whose logits are far from uniform (log-probabilities down to -14; a wrong input
# shows). At 0.5 its activations were so large that fp32 rounding put both vLLM's and our log-probabilities about
# 1e-4 from a float64 reference at position 150-200, in opposite directions on one CPU (1.7e-4 apart); at 0.25 both
# are within 1.5e-5 of it. seq 256: prompts of 200.
# The KV cache the tests' engines reserve: vLLM on CPU otherwise asks for 92% of the machine's memory as free when it
# starts (gpu_memory_utilization), which a machine running other jobs does not have.
KV_BYTES = 1 << 28
# The export's chat template (chat_template.jinja, for vLLM's /v1/chat/completions): bos, then each message's text.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
TINY = dict(d_model=64, num_heads=2, num_kv_heads=1, d_ff=128, num_layers=2, max_seq_len=256, init_std=0.25)


def run_config(tokenizer: str, scone: bool, model: dict, num_fgrams: int = 2000, extract_max_tokens: int = 200_000,
               min_count: int = 2):
    from tests.common import small_config

    config = small_config(**{"vocab_size": hf_models.TOKENIZER_SIZE, **LLAMA_STYLE, **model})
    with config.unlocked():
        config.data.tokenizer_path = tokenizer
        config.data.chat_template = os.path.join(os.path.dirname(tokenizer), "chat_template.jinja")
        config.scone.update(dict(enabled=scone, max_len=4, num_fgrams=num_fgrams, min_count=min_count,
                                 fgram_capacity=256, num_layers=1, extract_max_tokens=extract_max_tokens))
    return config


def build(root: str, kind: str, model: dict | None = None, num_fgrams: int = 2000,
          extract_max_tokens: int = 200_000, min_count: int = 2) -> dict:
    """{'workdir', 'bundle', 'hf'} of the run `kind` ('scone' or 'baseline') under root/kind, built once; `model`
    overrides TINY, and tools/bench_vllm.py asks for more f-grams (min_count=1: the embedded corpus holds 177k
    n-grams seen twice, fewer than its 200k table)."""
    from scone_jax.serving import export, hf_export
    from scone_jax.training import run as run_lib

    base = os.path.join(root, kind)
    paths = {name: os.path.join(base, name) for name in ("run", "bundle", "hf")}
    paths["workdir"] = paths.pop("run")
    if not os.path.exists(os.path.join(base, "DONE")):
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        tokenizer = hf_models.tokenizer_json(os.path.join(base, "tokenizer.json"), "llama")
        with open(os.path.join(base, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)
        settings = dict(TINY, embedding_multiplier=2.0 if kind == "scone" else 1.0, **(model or {}))
        config = run_config(tokenizer, kind == "scone", settings, num_fgrams, extract_max_tokens, min_count)
        run_lib.save_initial_state(config, paths["workdir"], 1)
        export.export(paths["workdir"], paths["bundle"], chunk_rows=1024, batch_rows=1024)  # the hf export's batches
        hf_export.export_hf(paths["workdir"], paths["hf"], batch_rows=1024)
        open(os.path.join(base, "DONE"), "w").close()
    return paths
