"""SconeForCausalLM for vLLM: the family's stock vLLM decoder (config.json's text_config: LlamaForCausalLM,
Qwen3ForCausalLM, ...) fed SCONE's input embeddings (docs/method.md §2, §3, §7).

Each forward pass, on the host: store the scheduled tokens beside their KV cache slots and read back each one's
window of its request's last K tokens (token_store.py), find the longest f-gram ending at each token within that
window (the export's own matcher, scone_jax/hf/remote_code/scone_fgrams.py), gather the matched rows from the
memory-mapped table, and send only those rows to the device: inputs_embeds = where(matched, row, T(token) *
embedding_multiplier). The table is a numpy memmap held as a plain attribute, never a torch parameter or buffer,
so vLLM neither loads it onto the device nor counts it in the model's memory.

Passes without attention metadata (vLLM's profiling and warm-up runs, whose outputs are discarded) get T(token)
alone: there is no request to match within.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.models.utils import AutoWeightsLoader, init_vllm_registered_model, maybe_prefix

from scone_jax.serving.vllm_plugin import checks
from scone_jax.serving.vllm_plugin.token_store import TokenStore

logger = init_logger(__name__)
TORCH_VIEWS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class SconeForCausalLM(nn.Module):
    # The decoder's files only (model.safetensors or its shards): vLLM would otherwise read every *.safetensors of the
    # directory as weights, the f-gram table among them.
    allow_patterns_overrides = ["model*.safetensors"]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.multiplier = float(config.embedding_multiplier)
        text = config.text_config
        self.decoder = init_vllm_registered_model(vllm_config, hf_config=text, prefix=maybe_prefix(prefix, "decoder"),
                                                  architectures=list(text.architectures))
        self.fgrams, self.store = None, None
        if config.fgrams is not None:
            model_config = vllm_config.model_config
            checks.refuse_unsupported(vllm_config)  # EngineChecks refused these before; a worker built otherwise
            self.fgrams = checks.open_export(model_config.model, model_config.tokenizer)
            self.store = TokenStore(self.fgrams.max_len, vllm_config.cache_config.block_size)
            logger.info("SCONE: %d f-grams of up to %d tokens, rows [%d, %d] %s memory-mapped on the host from %s",
                        self.fgrams.table.rows.shape[0], self.fgrams.max_len, *self.fgrams.table.rows.shape,
                        self.fgrams.table.dtype, model_config.model)
        self.make_empty_intermediate_tensors = getattr(self.decoder, "make_empty_intermediate_tensors", None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """T(token) * embedding_multiplier (vLLM's own use, e.g. prompt embeddings; f-grams are forward's job)."""
        x = self.decoder.embed_input_ids(input_ids)
        return x * self.multiplier if self.multiplier != 1.0 else x

    def fgram_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> np.ndarray | None:
        """int64 [n]: the longest f-gram ending at each scheduled token within its request, -1 where none; None
        when the pass has no attention metadata (no requests: profiling, warm-up)."""
        if not is_forward_context_available():
            return None
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batches: not used on CPU; refuse rather than guess
            raise NotImplementedError("SCONE: micro-batched forward passes are not supported")
        if not metadata:
            return None
        layer = next(iter(metadata.values())) if isinstance(metadata, dict) else metadata
        n = int(getattr(layer, "num_actual_tokens", len(input_ids)))
        host = lambda t: t.detach().to("cpu").numpy()  # noqa: E731 (no copy on CPU)
        windows, real = self.store.windows(host(input_ids[:n]), host(positions[:n]), host(layer.slot_mapping[:n]),
                                           host(layer.query_start_loc), host(layer.block_table))
        ids = np.full(len(input_ids), -1, np.int64)
        ids[:n] = self.fgrams.matcher.longest(windows, real)[:, -1]
        return ids

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs):
        if inputs_embeds is None and input_ids is not None:
            inputs_embeds = self.embed_input_ids(input_ids)
            ids = None if self.fgrams is None else self.fgram_ids(input_ids, positions)
            if ids is not None:
                matched = ids >= 0
                if matched.any():
                    rows = torch.from_numpy(self.fgrams.table.gather(ids[matched]))
                    rows = rows.view(TORCH_VIEWS[self.fgrams.table.dtype])
                    where = torch.from_numpy(np.flatnonzero(matched)).to(inputs_embeds.device)
                    inputs_embeds = inputs_embeds.index_copy(
                        0, where, rows.to(device=inputs_embeds.device, dtype=inputs_embeds.dtype))
        elif self.fgrams is not None and input_ids is None:
            raise ValueError("SCONE computes its inputs from token ids. Fix: do not pass prompt embeddings.")
        return self.decoder(None, positions, intermediate_tensors, inputs_embeds=inputs_embeds, **kwargs)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.decoder.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The stock checkpoint's tensors, stored under `decoder.` (serving/hf_remote.py)."""
        return AutoWeightsLoader(self).load_weights(weights)

