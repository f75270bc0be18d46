"""OLMo-style models of the SCONE paper's main experiments (Yu et al. 2025), at paper scale.

Variants, all d 2048, 16 heads of 128, seq 2048 (the paper names them by parameter count):
  0.7b (12 layers), 1b (18), 1.3b (24), 1.9b (36)
OLMo architecture: RoPE, LayerNorm without scale or bias, no biases, SwiGLU, tied
embeddings, embedding table 50,304 (OLMo's 50,280-token tokenizer padded to a multiple of 128).

MLP width. The paper's ffw is 8192 and it counts the MLP as 2*d*ffw parameters per layer. A
SwiGLU MLP has three d x h matrices, so the same count needs h = 2/3 * 8192 = 5461.3; like
OLMo we round up to a multiple of 128 (TPU matrix units work in 128-wide tiles): h = 5504,
0.8% more MLP parameters. "1b" then has 1,013.7M parameters, against 1,009M from the paper's
formula and 1,014M in its table.

Training follows OLMo-1B's published recipe, as the SCONE paper trains OLMo's way: global
batch 2048 x 2048 tokens (4.2M), AdamW (0.9, 0.95, eps 1e-5, weight decay 0.1), lr 4e-4
after 2000 warmup steps, cosine decay, bf16 compute. Blocks keep only their input for the
backward pass (model.remat='full'): with 'save_dots' or 'none' "1b" needs far more HBM per
chip on a v5p-128 (tools/aot_compile.py; docs/benchmarks.md). num_steps = 50,000 (210B tokens) is our choice: set it to your
token budget / 4.19M.

The data and the tokenizer are yours to supply (the paper uses Dolma and OLMo's tokenizer). The
tokenizer is allenai's gpt-neox-olmo-dolma-v1_5: the tokenizer.json of the Hugging Face repo
allenai/OLMo-1B-hf (https://huggingface.co/allenai/OLMo-1B-hf/resolve/main/tokenizer.json;
nothing is downloaded at run time, so fetch it once). It has exactly 50,280 tokens (added tokens
included), and data.tokenizer_size=50280 refuses a tokenizer of any other size at start (set it
to 0 to train with another one). Special ids by default (data/tokenizer.py): eos = bos =
<|endoftext|>, pad = <|padding|> (OLMo publishes eos 50279, pad 1). Pre-tokenize the text once
with it (the shards record its fingerprint; training refuses shards made with another one):

  python tools/pretokenize.py --format=jsonl --input='/mnt/data/dolma/train/*.jsonl' \
      --tokenizer=/mnt/data/olmo/tokenizer.json --output=/mnt/data/dolma/train --workers=-1
  (and the same for the validation documents into /mnt/data/dolma/valid)

On a v5p-128:

  python launch/tpu.py run --name=scone-v5p --zone=us-east5-a --project=my-project \
      --config=configs/olmo_paper.py:1b --workdir=gs://my-bucket/runs/olmo-1b \
      --config.data.train_files='/mnt/data/dolma/train/tokens-*.arrayrecord' \
      --config.data.eval_files='/mnt/data/dolma/valid/tokens-*.arrayrecord' \
      --config.data.tokenizer_path=/mnt/data/olmo/tokenizer.json

(`python -m scone_jax.main` takes the same flags on one host.) data.*_files are globbed on
each worker's local file system: mount a bucket there (e.g. gcsfuse) to read from GCS.
Expect the log to report 1,013.7M parameters for 1b. Check memory and step time first with
  python tools/aot_compile.py --config=configs/olmo_paper.py:1b --topology=v5p-128

Arguments are `SIZE[,option=value...]`. SCONE variants add an f-gram model to the main model:
  fgram=0.6b|1.8b  the paper's f-gram models: 12 or 36 layers of the main block (d 2048),
                   0.6B / 1.8B parameters without token embeddings (also RATIOx, as for GPT-2)
  fgrams=COUNT     f-grams kept: the paper's 10m (default) or 1b
  capacity=ROWS    f-gram rows per data shard (default 8192: a v5p-128 data shard of the
                   2048 x 2048 batch holds 32 x 2048 tokens)
e.g. --config=configs/olmo_paper.py:1b,fgram=1.8b,fgrams=10m; check it with
  python tools/aot_compile.py --config=configs/olmo_paper.py:1b,fgram=1.8b --topology=v5p-128
"""
import ml_collections

from scone_jax.config import base_config, load_beside

_common = load_beside(__file__, "common.py")
split_variant, enable_scone = _common.split_variant, _common.enable_scone

_LAYERS = {"0.7b": 12, "1b": 18, "1.3b": 24, "1.9b": 36}
VARIANTS = tuple(_LAYERS)

D_MODEL, PAPER_FFW = 2048, 8192
SWIGLU_HIDDEN = 5504  # 2/3 * PAPER_FFW rounded up to a multiple of 128 (see the docstring)


_FGRAM_LAYERS = {"0.6b": 12, "1.8b": 36}  # the paper's f-gram models


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name, options = split_variant(arg, VARIANTS, "configs/olmo_paper.py")
    config = base_config()
    m = config.model
    m.vocab_size = 50304  # OLMo's 50,280 tokens rounded up to a multiple of 128
    m.d_model, m.num_layers, m.num_heads, m.d_ff = D_MODEL, _LAYERS[name], 16, SWIGLU_HIDDEN
    m.max_seq_len = 2048
    m.norm, m.mlp, m.position = "nonparametric_layernorm", "swiglu", "rope"
    m.use_bias, m.tie_embeddings = False, True
    m.dtype, m.remat = "bfloat16", "full"

    d = config.data
    d.source, d.train_files, d.eval_files, d.tokenizer_path = "arrayrecord", "", "", ""
    d.vocab_size = 50280  # a tokenizer trained into the workdir (no tokenizer_path) gets OLMo's size
    d.tokenizer_size = 50280  # OLMo's tokenizer.json exactly (see the docstring); the model pads it to 50,304
    d.seq_len, d.global_batch_size = 2048, 2048

    t = config.train
    t.num_steps, t.warmup_steps = 50_000, 2000
    t.learning_rate, t.weight_decay, t.b1, t.b2, t.eps = 4e-4, 0.1, 0.9, 0.95, 1e-5
    t.log_every, t.eval_every, t.eval_batches = 100, 2000, 50
    t.checkpoint_every, t.keep_checkpoints = 1000, 3

    config.mesh.data, config.mesh.fsdp = 1, -1
    if "fgram" in options:
        size = options["fgram"]
        if size.endswith("x"):
            layers = max(1, round(float(size[:-1]) * _LAYERS[name]))
        elif size in _FGRAM_LAYERS:
            layers = _FGRAM_LAYERS[size]
        else:
            raise ValueError(f"fgram={size!r}: use one of {sorted(_FGRAM_LAYERS)} or a ratio such as 1x.")
        enable_scone(config, fgram_layers=layers, options=options, default_fgrams="10m", default_capacity=8192)
    config.lock()
    return config
