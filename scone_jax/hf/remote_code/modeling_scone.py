"""SconeForCausalLM: a stock transformers decoder fed SCONE's input embeddings (scone_jax's docs/method.md §2, §3, §7).

Inside is the family's own model, AutoModelForCausalLM.from_config(config.text_config), its weights stored under
`decoder.` in this directory's safetensors. The f-gram table and vocabulary stay on the host (scone_fgrams.py: memory-
mapped files, read a row at a time). Every forward finds, for each position of input_ids, the longest f-gram ending
there within the row's real tokens (attention_mask: a match never reaches across padding, left or right), gathers its
row and feeds the decoder inputs_embeds = where(matched, row, T(token) * embedding_multiplier); the rows already hold
what scone_jax's decoder received at a matched position (a learned gate included).

With a KV cache, forward sees only the new tokens, so generate hands it, through prepare_inputs_for_generation, the last
K-1 tokens before them with their mask (fgram_window_ids / fgram_window_mask: the window ends with input_ids): matches
that began before the step are found. Called by hand with a non-empty cache, forward needs that window too, and says so.
Per token this costs at most K-1 binary searches over the f-gram keys and one row read: microseconds from RAM.

Load it with AutoModelForCausalLM.from_pretrained(DIRECTORY, trust_remote_code=True) from a local directory; the files
must agree with config.json (one line names the file otherwise).
"""
import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_scone import SconeConfig
from .scone_fgrams import Fgrams, SconeExportError

TORCH_VIEWS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class SconeForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = SconeConfig
    base_model_prefix = "decoder"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: SconeConfig):
        super().__init__(config)
        self.decoder = AutoModelForCausalLM.from_config(config.text_config)
        self.fgrams = None  # scone_fgrams.Fgrams, opened by from_pretrained from the export's directory
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """The decoder's weights as any checkpoint's, then the f-gram files beside config.json (checked first)."""
        directory = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        fgrams = open_fgrams(directory)
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).fgrams = fgrams
        return loaded

    def get_input_embeddings(self):
        return self.decoder.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.decoder.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.decoder.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.decoder.set_output_embeddings(value)

    def fgram_ids(self, window_ids: torch.Tensor, window_mask: torch.Tensor | None, new: int) -> np.ndarray:
        """int64 [B, new]: the longest f-gram ending at each of the window's last `new` positions, -1 where none."""
        if self.fgrams is None:
            raise SconeExportError("This SCONE model has no f-gram table: it was built from a config. Fix: load it "
                                   "with from_pretrained(DIRECTORY, trust_remote_code=True) from its export directory.")
        tokens = window_ids.detach().cpu().numpy()
        real = np.ones(tokens.shape, bool) if window_mask is None else window_mask.detach().cpu().numpy() != 0
        return self.fgrams.matcher.longest(tokens, real)[:, tokens.shape[1] - new:]

    def scone_inputs(self, input_ids, attention_mask=None, window_ids=None, window_mask=None) -> torch.Tensor:
        """The decoder's input for input_ids [B, n]: T(token) * embedding_multiplier, replaced where an f-gram ends by
        its table row. window_ids [B, W >= n] (ending with input_ids) and window_mask give the tokens before them."""
        x = self.decoder.get_input_embeddings()(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        if self.config.fgrams is None:
            return x
        n = input_ids.shape[1]
        if window_ids is None:
            window_ids = input_ids
            if attention_mask is not None and attention_mask.dim() == 2:
                window_mask = attention_mask[:, -n:]
        elif window_ids.shape[1] < n or not torch.equal(window_ids[:, -n:].to(input_ids.device), input_ids):
            raise ValueError("fgram_window_ids must end with input_ids. Fix: pass the sequence's last tokens, "
                             "input_ids included, as generate's prepare_inputs_for_generation does.")
        ids = self.fgram_ids(window_ids, window_mask, n)
        matched = ids >= 0
        if matched.any():
            rows = torch.from_numpy(self.fgrams.table.gather(ids[matched]))
            rows = rows.view(TORCH_VIEWS[self.fgrams.table.dtype]).to(device=x.device, dtype=x.dtype)
            x = x.clone()
            x[torch.from_numpy(matched).to(x.device)] = rows
        return x

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                logits_to_keep=0, fgram_window_ids=None, fgram_window_mask=None, **kwargs):
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("SconeForCausalLM computes its inputs from input_ids (T(token), or an f-gram's row where "
                             "one ends). Fix: pass input_ids, not inputs_embeds.")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
        if past and fgram_window_ids is None and self.config.fgrams is not None:
            raise ValueError("With a non-empty cache, input_ids are only the new tokens, and an f-gram may begin "
                             "before them. Fix: pass fgram_window_ids (the sequence's last K-1 tokens before them and "
                             "input_ids) and fgram_window_mask, or call generate, which does.")
        x = self.scone_inputs(input_ids, attention_mask, fgram_window_ids, fgram_window_mask)
        return self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                            logits_to_keep=logits_to_keep, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """The stock preparation, plus the window: the tokens that a match ending at a new token may reach back to."""
        mask = kwargs.get("attention_mask")
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        new = inputs.get("input_ids")
        if new is not None and self.config.fgrams is not None:
            width = min(input_ids.shape[1], new.shape[1] + int(self.config.fgrams["max_len"]) - 1)
            inputs["fgram_window_ids"] = input_ids[:, -width:]
            inputs["fgram_window_mask"] = mask[:, -width:] if mask is not None and mask.dim() == 2 else None
        return inputs


def open_fgrams(directory: str):
    """The export's Fgrams (None for a model without f-grams), its files checked against its config.json."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise SconeExportError(f"{directory} has no config.json: a SCONE export loads from its local directory. Fix: "
                               "download or copy the whole directory first, and pass its path.")
    with open(path) as f:
        section = json.load(f).get("fgrams")
    return None if section is None else Fgrams(directory, section)
