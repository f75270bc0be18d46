"""GPT-2 models of the SCONE paper's WebText experiments (Yu et al. 2025), at paper scale.

Variants (the paper's parameter counts: 4d^2 + 2*d*ffw per layer plus the tied 50,257 x d
token table and 1024 x d positions):
  128m, 419m, 589m     the SCONE main models: d 1024 / 1536 / 1536, 6 / 12 / 18 layers
  204m, 759m, 1099m    the baselines with twice the non-embedding size: 12 / 24 / 36 layers
All: ffw 4d, head size 64, learned positions (1024), LayerNorm, GELU, biases, tied
embeddings, bf16 compute over fp32 master weights; seq 1024 x global batch 512, AdamW
(weight decay 0.1), lr 2e-4 with cosine decay, 152,600 steps = the paper's 80B tokens.

The data and the tokenizer are yours to supply (the paper trains on WebText with GPT-2's
tokenizer). The tokenizer is GPT-2's byte-level BPE: the tokenizer.json of the Hugging Face repo
openai-community/gpt2 (https://huggingface.co/openai-community/gpt2/resolve/main/tokenizer.json;
nothing is downloaded at run time, so fetch it once). It has exactly 50,257 tokens, and
data.tokenizer_size=50257 refuses a tokenizer of any other size at start (set it to 0 to train
with another one). Its one special token <|endoftext|> (50256) is bos, eos and pad (GPT-2's own
convention; data/tokenizer.py). Pre-tokenize the text once with it (the shards record its
fingerprint, and training refuses shards made with another tokenizer):

  python tools/pretokenize.py --input='/mnt/data/webtext/train/*.txt' \
      --tokenizer=/mnt/data/gpt2/tokenizer.json --output=/mnt/data/webtext/train
  (and the same for the validation text into /mnt/data/webtext/valid)

or point source=text at one document per line. On a v5p-128:

  python launch/tpu.py run --name=scone-v5p --zone=us-east5-a --project=my-project \
      --config=configs/gpt2_paper.py:419m --workdir=gs://my-bucket/runs/gpt2-419m \
      --config.data.train_files='/mnt/data/webtext/train/tokens-*.arrayrecord' \
      --config.data.eval_files='/mnt/data/webtext/valid/tokens-*.arrayrecord' \
      --config.data.tokenizer_path=/mnt/data/gpt2/tokenizer.json

(`python -m scone_jax.main` takes the same flags on one host.) data.*_files are globbed on
each worker's local file system: mount a bucket there (e.g. gcsfuse) to read from GCS.
Expect the log to report 418,748,928 parameters for 419m. Check memory and step time before
renting a slice with
  python tools/aot_compile.py --config=configs/gpt2_paper.py:419m --topology=v5p-128
(HBM per chip, FLOPs and the step time at peak; figures in docs/benchmarks.md).

Arguments are `SIZE[,option=value...]`. SCONE variants add an f-gram model to the main model:
  fgram=RATIOx     f-gram model with RATIO x the main model's non-embedding size (same width,
                   RATIO x its layers): the paper uses 0.5x .. 3x, e.g. 419m,fgram=0.5x = 170M
  fgrams=COUNT     f-grams kept (default 10m; the paper's ablations go from 512k to 100m)
  capacity=ROWS    f-gram rows per data shard (default 4096 for a v5p-128 data shard of 8 x 1024
                   tokens; training logs the rows each batch needs, and a batch that needs more is
                   an error naming the value to set)
e.g. --config=configs/gpt2_paper.py:419m,fgram=3x,fgrams=10m. The f-grams are extracted from
data.train_files into the workdir on the first run unless --config.scone.vocab_path names a
vocabulary made by tools/extract_fgrams.py (advised at this scale: it uses all cores).
"""
import ml_collections

from scone_jax.config import base_config, load_beside

_common = load_beside(__file__, "common.py")
split_variant, enable_scone = _common.split_variant, _common.enable_scone

# name -> (d_model, num_layers, fsdp). The two smallest keep parameters and optimizer state
# (16 bytes per parameter, ~3.3 GB at 204M) whole on every chip: plain data parallelism needs
# no weight gathers. The others shard them over all chips (FSDP) to leave HBM for activations.
_SIZES = {
    "128m": (1024, 6, False),
    "419m": (1536, 12, True),
    "589m": (1536, 18, True),
    "204m": (1024, 12, False),
    "759m": (1536, 24, True),
    "1099m": (1536, 36, True),
}
VARIANTS = tuple(_SIZES)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name, options = split_variant(arg, VARIANTS, "configs/gpt2_paper.py")
    d_model, num_layers, fsdp = _SIZES[name]
    config = base_config()
    m = config.model
    m.vocab_size = 50257
    m.d_model, m.num_layers, m.num_heads, m.d_ff = d_model, num_layers, d_model // 64, 4 * d_model
    m.max_seq_len = 1024
    m.norm, m.mlp, m.position, m.use_bias, m.tie_embeddings = "layernorm", "gelu", "learned", True, True
    m.dtype = "bfloat16"

    d = config.data
    d.source, d.train_files, d.eval_files, d.tokenizer_path = "arrayrecord", "", "", ""
    d.vocab_size = 50257  # a tokenizer trained into the workdir (no tokenizer_path) gets GPT-2's size
    d.tokenizer_size = 50257  # GPT-2's tokenizer.json exactly (see the docstring)
    d.seq_len, d.global_batch_size = 1024, 512

    t = config.train
    t.num_steps, t.warmup_steps = 152_600, 2000
    t.learning_rate, t.weight_decay = 2e-4, 0.1
    t.log_every, t.eval_every, t.eval_batches = 100, 2000, 100
    t.checkpoint_every, t.keep_checkpoints = 2000, 3

    if fsdp:
        config.mesh.data, config.mesh.fsdp = 1, -1
    if "fgram" in options:
        ratio = float(options["fgram"].rstrip("x"))
        enable_scone(config, fgram_layers=max(1, round(ratio * num_layers)), options=options,
                     default_fgrams="10m", default_capacity=4096)
    config.lock()
    return config
