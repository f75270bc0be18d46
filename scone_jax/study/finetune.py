"""The fine-tuning study's runs (tools/bench_finetune.py; issue 55, the paper's Table 4 at this machine's scale): a
pretrained main model fine-tuned on conversations plainly and with SCONE, its f-gram model grown from a larger
pretrained model or trained from scratch.

Arms (every one starts its decoder from the main model's Hugging Face export, model.init_from_hf):
  ft_plain             the main model alone
  ft_scone_pretrained  SCONE, the f-gram model grown from the larger model's export (scone.init_from_hf): its
                       blocks, final norm, own token table and learned positions
  ft_scone_scratch     SCONE, an f-gram model of the larger model's size and architecture started at random
Both SCONE arms read a token table of their own (scone.own_token_embedding: the source's, or a random one) and add
their rows to the token rows through a projection that starts at zero (START "projection": scone.combine='add',
scone.output_projection_init='zeros'; it learns the rows' scale, where the gate mixed raw rows of 26x the token
rows' norm through one scalar: issue 65), or mix them in through scone.gate from g = 0 (START "gate", the first
study's). Either way step 0 of every arm is the plain fine-tune and the two SCONE arms differ in the f-gram model's
initialisation alone. Their f-grams are counted on the rendered training
conversations. A seed sets the data order (data.shuffle_seed) as well as train.seed: the plain arm and the pretrained
arm at equal widths have no random parameter, so train.seed alone would repeat a run. The runs train, export and
score like the quality study's (study.py's run_arm, the main job's
config from configs/finetune_hf.py instead of configs/quality.py), one Study per seed in WORKDIR/seed<N>.
"""
from __future__ import annotations

import os

from scone_jax.config import load_config_file, set_overrides
from scone_jax.hf import derive as hf_derive
from scone_jax.study.runs import REPO
from scone_jax.study.study import Study, _flatten

FT_CONFIG = os.path.join(REPO, "configs", "finetune_hf.py")
ARMS = ("ft_plain", "ft_scone_pretrained", "ft_scone_scratch")
STARTS = ("projection", "gate")  # how the SCONE arms' rows enter at step 0 (module docstring)
SCONE_ARMS = ARMS[1:]
# The study's fine-tuning settings (the paper's gate rate; a chat row of 256 positions holds several conversations).
SEQ_LEN, BATCH = 256, 16
GATE_LEARNING_RATE_MULTIPLIER = 25.0  # configs/finetune_paper.py's: g can reach 1 within the run
NUM_FGRAMS, MAX_LEN = 20_000, 5
# Keys hf/derive.py sets from the checkpoints: the main job derives them again, so they are not on its command line
# (scone.source_model is a JSON object); the scratch arm's f-gram sizes are its own and stay.
_DERIVED = ("model.", "data.tokenizer_path", "data.eos_token", "data.bos_token", "data.add_bos", "scone.source_model")
_SOURCE_SIZES = ("scone.num_layers", "scone.d_model", "scone.num_heads", "scone.d_ff")


class FinetuneStudy(Study):
    """The fine-tuning runs of one seed (module docstring): WORKDIR/seed<N>/<arm>/lr<rate>."""

    def __init__(self, root: str, arms: list[str], tokens: int, rates: list[str], chat_dir: str, main_hf: str,
                 large_hf: str, seed: int, quick: bool, overrides: dict, start: str = "projection"):
        if start not in STARTS:
            raise ValueError(f"start={start!r}: choose among {', '.join(STARTS)}.")
        chat = {"source": "chat", "train_files": os.path.join(chat_dir, "train.jsonl"),
                "eval_files": os.path.join(chat_dir, "validation.jsonl"),
                "chat_template": os.path.join(chat_dir, "chat_template.jinja"), "loss_on": "assistant",
                "overlong": "truncate"}
        quick_settings = {"data.seq_len": 64, "data.global_batch_size": 4} if quick else {}
        super().__init__(root, arms, tokens, tokens, rates, chat, os.path.join(chat_dir, "test.jsonl"), False,
                         {**quick_settings, **overrides})
        self.quick, self.main_hf, self.large_hf, self.seed, self.start = quick, main_hf, large_hf, seed, start
        self.budget = {arm: tokens for arm in arms}

    def config_arg(self, arm: str) -> str:
        return FT_CONFIG

    def config(self, arm: str, rate: str | None = None, extra: dict | None = None, tokenizer=None):
        """The arm's config as the main job derives it (hf/derive.py) from the two exports."""
        config = load_config_file(FT_CONFIG)
        with config.unlocked():
            config.model.init_from_hf = self.main_hf
            config.data.update(self.data)
            config.data.seq_len, config.data.global_batch_size = SEQ_LEN, BATCH
            if arm in SCONE_ARMS:
                s = config.scone
                s.enabled, s.own_token_embedding = True, True
                if self.start == "gate":
                    s.gate, s.gate_learning_rate_multiplier = True, GATE_LEARNING_RATE_MULTIPLIER
                else:
                    s.combine, s.output_projection_init = "add", "zeros"
                s.num_fgrams, s.max_len, s.fgram_capacity = NUM_FGRAMS, MAX_LEN, 4096
                if arm == "ft_scone_pretrained":
                    s.init_from_hf = self.large_hf
                else:  # the larger model's size and kind of block (the main model's: same family), random
                    _, large, _ = hf_derive.config_json(self.large_hf)
                    s.num_layers, s.d_model, s.num_heads, s.d_ff = (large[k] for k in
                                                                     ("num_layers", "d_model", "num_heads", "d_ff"))
            set_overrides(config, self.overrides)
            rows = config.data.global_batch_size * config.data.seq_len
            t = config.train
            t.num_steps = max(1, -(-self.budget[arm] // rows))
            t.warmup_steps = max(1, t.num_steps // 20)
            t.log_every = max(1, min(20, t.num_steps // 10))
            t.eval_every, t.eval_batches = t.num_steps, 0
            t.checkpoint_every, t.keep_checkpoints = max(1, min(200, t.num_steps)), 1
            t.seed = config.data.shuffle_seed = self.seed  # a fine-tune from a checkpoint has few random parameters
            # (none in ft_plain and ft_scone_pretrained at equal widths): a seed is its data order as well
            if rate is not None:
                t.learning_rate = float(rate)
            set_overrides(config, extra or {})
        hf_derive.apply(config)
        return config

    def flags_for(self, config, arm: str) -> list[str]:
        """The main job's command line: every key the study sets on top of configs/finetune_hf.py, less those the
        job derives from the checkpoints itself (_DERIVED; a pretrained source's sizes too)."""
        flat = _flatten(config.to_dict())
        base = _flatten(load_config_file(FT_CONFIG).to_dict())
        derived = _DERIVED + (_SOURCE_SIZES if config.scone.init_from_hf else ())
        return [f"--config.{k}={v}" for k, v in flat.items()
                if base.get(k) != v and (k == "model.init_from_hf" or not k.startswith(derived))]

    def recorded_keys(self, config) -> list[str]:
        """The settings a record names as its overrides (records.py): what tells the arms and studies apart, not
        the files' paths (a copied corpus or checkpoint is the same run)."""
        keys = ["data.seq_len", "data.global_batch_size", "data.loss_on", "data.shuffle_seed", "train.seed"]
        if config.scone.enabled:
            keys += ["scone.num_layers", "scone.d_model", "scone.num_fgrams", "scone.max_len", "scone.gate",
                     "scone.gate_learning_rate_multiplier", "scone.own_token_embedding", "scone.combine",
                     "scone.output_projection_init"]
        return keys + sorted(k for k in self.overrides if k not in keys)
