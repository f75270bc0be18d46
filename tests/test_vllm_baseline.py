"""A baseline run's --format=hf export is a stock checkpoint: vLLM serves it with its own model class, not the SCONE
plugin's, and its greedy tokens are scone_jax's Generator's at temperature 0. Skipped where vLLM does not import.

Deliberate bug this test was run against once (it failed, then was reverted): hf_remote.needed returning True for
every run (the baseline then exported as a SconeForCausalLM with no f-grams): test_a_baseline_export_is_served_stock.
"""
import json
import os

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (docs/serving.md)")

from tests import vllm_runs  # noqa: E402

pytestmark = pytest.mark.slow
NEW = 16


def model_class(model) -> str:
    """In the engine's worker (module level: LLM.apply_model pickles it by name)."""
    return type(model).__name__


def test_a_baseline_export_is_served_stock(tmp_path_factory):
    from scone_jax.data import corpus
    from scone_jax.serving import generate, inference

    exported = vllm_runs.build(str(tmp_path_factory.getbasetemp() / "vllm_runs"), "baseline")
    config = json.load(open(os.path.join(exported["hf"], "config.json")))
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    served = inference.load(exported["bundle"])
    prompts = [np.array([served.tokenizer.bos_id, *served.tokenizer.encode(v)][:n], np.int32)
               for v, n in zip(corpus.kjv_documents("eval", 0.02)[:3], (5, 12, 30))]
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = vllm.LLM(model=exported["hf"], dtype="float32", max_model_len=256, enforce_eager=True,
                   kv_cache_memory_bytes=vllm_runs.KV_BYTES)
    try:
        assert llm.apply_model(model_class) == ["LlamaForCausalLM"]
        outputs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts],
                               vllm.SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    finally:
        llm.llm_engine.engine_core.shutdown()
    generator = generate.Generator(served, temperature=0.0)
    for p, out in zip(prompts, outputs):
        want = generator.generate(p[None], NEW)["tokens"][0][len(p):]
        np.testing.assert_array_equal(out.outputs[0].token_ids, want, err_msg=f"prompt of {len(p)} tokens")
