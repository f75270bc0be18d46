"""SCONE in vLLM: `pip install -e '.[vllm]'` registers this package through vLLM's `vllm.general_plugins` entry point
(setup.py), so `vllm.LLM(model=H)` and vLLM's OpenAI server serve a SCONE export written by
`python -m scone_jax.serving.export --format=hf` with no extra flag (docs/serving.md, "Serving with vLLM").

  register()      the entry point: SconeConfig for config.json's model_type "scone" (no trust_remote_code needed; it
                  checks the export's files as vLLM reads the config), SconeForCausalLM (model.py, imported lazily
                  by vLLM) for its architecture, its engine-settings check (checks.EngineChecks, vLLM's
                  per-architecture config hook), and one-line refusals (checks.refuse_in_one_line)
  model.py        the vLLM model: the family's stock vLLM decoder fed T(token) * multiplier, or an f-gram's row
  token_store.py  each request's last K tokens, read from a token id kept beside each KV cache slot
  checks.py       the export's files and tokenizer checked before the engine starts, one line each

It imports vLLM, torch, transformers, numpy and the export's own host code (scone_jax.hf.remote_code); nothing from
training, nothing that pulls JAX."""
ARCHITECTURE = "SconeForCausalLM"


def register() -> None:
    """vLLM calls this in every process it starts (and may call it twice): every registration is idempotent."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from scone_jax.serving.vllm_plugin.checks import EngineChecks, VllmSconeConfig, refuse_in_one_line

    AutoConfig.register(VllmSconeConfig.model_type, VllmSconeConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "scone_jax.serving.vllm_plugin.model:SconeForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = EngineChecks
    refuse_in_one_line()
