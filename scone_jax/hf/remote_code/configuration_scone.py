"""SconeConfig: a stock decoder's config (`text_config`, e.g. a LlamaConfig) and what the SCONE input adds to it.

config.json of a SCONE export (written by scone_jax.serving.export --format=hf):
  text_config           the family's own config.json, nested: the decoder inside is that family's stock model
  embedding_multiplier  T(token) is multiplied by it where it is the decoder's input (1 in the method)
  fgrams                null (no f-grams: a baseline whose input scaling no family expresses), or
                        {num_fgrams, max_len, vocab_size, width, dtype, table, vocabulary}: the files scone_fgrams.py
                        reads, beside config.json
"""
from transformers import AutoConfig, PretrainedConfig


class SconeConfig(PretrainedConfig):
    model_type = "scone"

    def __init__(self, text_config=None, embedding_multiplier: float = 1.0, fgrams: dict | None = None, **kwargs):
        if isinstance(text_config, dict):
            values = dict(text_config)
            text_config = AutoConfig.for_model(values.pop("model_type"), **values)
        self.text_config = text_config
        self.embedding_multiplier = float(embedding_multiplier)
        self.fgrams = fgrams
        super().__init__(**kwargs)
