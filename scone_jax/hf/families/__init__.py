"""The supported Hugging Face model families, one module each, and how a checkpoint or a run finds its own."""
from __future__ import annotations

from scone_jax.hf.families.base import Family, HfConfigError
from scone_jax.hf.families.gpt2 import Gpt2
from scone_jax.hf.families.llama import Llama
from scone_jax.hf.families.olmo import Olmo
from scone_jax.hf.families.qwen3 import Qwen3

FAMILIES = {f.model_type: f for f in (Llama(), Qwen3(), Gpt2(), Olmo())}


def of_config(hf: dict, where: str) -> Family:
    """The family of a config.json (its model_type, checked against its architectures entry)."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise HfConfigError(f"{where}: model_type={kind!r} is not supported; supported: {', '.join(FAMILIES)}. Fix: "
                            "use a checkpoint of one of these families.")
    family = FAMILIES[kind]
    architectures = hf.get("architectures") or [family.architecture]
    if architectures != [family.architecture]:
        raise HfConfigError(f"{where}: architectures={architectures!r} is not supported for model_type={kind!r}; "
                            f"supported: [{family.architecture!r}] (a causal language model). Fix: use a checkpoint of "
                            "that class.")
    return family


def of_model(model) -> Family:
    """The family whose architecture our model section matches exactly (qk_norm tells Qwen3 from Llama); HfConfigError
    naming, for each family, what does not fit."""
    misfits = {kind: family.misfit(model) for kind, family in FAMILIES.items()}
    fitting = [kind for kind, problems in misfits.items() if not problems]
    if fitting:
        return FAMILIES[fitting[0]]
    why = "; ".join(f"{kind} needs {', '.join(problems)}" for kind, problems in misfits.items())
    raise HfConfigError(f"The run's model section fits no Hugging Face family: {why}. Fix: export it in the bundle "
                        "format (--format=bundle).")
