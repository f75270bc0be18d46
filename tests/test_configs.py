"""Every shipped config loads for each of its variants, builds a model, and the paper-scale
configs have the paper's parameter counts (`pytest -s` prints the table)."""
import glob
import importlib.util
import math
import os
import sys

import pytest
from absl import flags
from flax import nnx
from ml_collections.config_flags import config_flags

from scone_jax import config as config_lib
from scone_jax.hf import derive
from scone_jax.model.accounting import param_counts
from scone_jax.training.state import build_model
from tests.common import REPO

# configs/common.py holds the helpers the paper configs share; it is not a config.
CONFIG_FILES = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "configs", "*.py"))
                      if os.path.basename(p) != "common.py")

# Parameter counts the paper gives, in millions. For the OLMo 0.7B / 1.3B / 1.9B baselines it
# gives only the rounded name; there the number is its formula (see paper_formula).
PAPER_PARAMS_M = {
    ("configs/gpt2_paper.py", "128m"): 128,
    ("configs/gpt2_paper.py", "419m"): 419,
    ("configs/gpt2_paper.py", "589m"): 589,
    ("configs/gpt2_paper.py", "204m"): 204,
    ("configs/gpt2_paper.py", "759m"): 759,
    ("configs/gpt2_paper.py", "1099m"): 1099,
    ("configs/olmo_paper.py", "0.7b"): 707,
    ("configs/olmo_paper.py", "1b"): 1014,
    ("configs/olmo_paper.py", "1.3b"): 1311,
    ("configs/olmo_paper.py", "1.9b"): 1915,
}
PAPER_FFW = {"configs/gpt2_paper.py": None, "configs/olmo_paper.py": 8192}  # None: 4 * d
# Configs that name checkpoints (model.init_from_hf, scone.init_from_hf) not on this machine: their shapes come from
# the config.json files in configs/hf/, as tools/aot_compile.py derives them.
HF_SHAPES = {("configs/finetune_paper.py", "8b"): ("configs/hf/qwen3_4b_base", "configs/hf/qwen3_8b_base"),
             ("configs/finetune_paper.py", "14b"): ("configs/hf/qwen3_4b_base", "configs/hf/qwen3_14b_base")}


def variants_of(path):
    """The module's VARIANTS; a config without them has the single variant None."""
    spec = importlib.util.spec_from_file_location("_config_under_test", os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "VARIANTS", (None,))


CASES = [(path, v) for path in CONFIG_FILES for v in variants_of(path)]


def load(path, variant):
    return config_lib.load_config_file(os.path.join(REPO, path) + (f":{variant}" if variant else ""))


def paper_formula(model_cfg, ffw):
    """The paper's count: per layer 4d^2 + 2*d*ffw, plus the token table and learned positions."""
    d = model_cfg.d_model
    positions = model_cfg.max_seq_len * d if model_cfg.position == "learned" else 0
    return model_cfg.num_layers * (4 * d * d + 2 * d * ffw) + model_cfg.vocab_size * d + positions


def test_all_config_files_are_covered():
    assert {"configs/tiny.py", "configs/gpt2_paper.py", "configs/olmo_paper.py"} <= set(CONFIG_FILES)
    assert {v for p, v in CASES if p == "configs/gpt2_paper.py"} == {"128m", "419m", "589m", "204m", "759m", "1099m"}
    assert {v for p, v in CASES if p == "configs/olmo_paper.py"} == {"0.7b", "1b", "1.3b", "1.9b"}


@pytest.mark.parametrize("path,variant", CASES, ids=[f"{p}:{v}" for p, v in CASES])
def test_config_loads_locked_validates_and_builds(path, variant):
    config = load(path, variant)
    if (path, variant) in HF_SHAPES:
        derive.from_config_files(config, *(os.path.join(REPO, p) for p in HF_SHAPES[path, variant]))
    config_lib.validate(config)
    with pytest.raises(AttributeError):
        config.model.num_layrs = 2  # locked: a typo is an error, not a new field
    if not config.model.vocab_size:  # sized from the tokenizer at run time, as train.py does
        config.model.vocab_size = math.ceil(config.data.vocab_size / 128) * 128
    model = nnx.eval_shape(lambda: build_model(config))  # the decoder, plus the f-gram model if scone.enabled
    counts = param_counts(model)
    print(f"\n{path}:{variant}: {counts['total']:,} parameters ({counts['non_embedding']:,} non-embedding)")
    assert counts["total"] > counts["non_embedding"] > 0

    paper_m = PAPER_PARAMS_M.get((path, variant))
    if paper_m is not None:
        m = config.model
        formula = paper_formula(m, PAPER_FFW[path] or 4 * m.d_model)
        rel = counts["total"] / (paper_m * 1e6) - 1
        print(f"  paper {paper_m:,}M, paper's formula {formula / 1e6:,.1f}M, ours {counts['total'] / 1e6:,.1f}M "
              f"({rel:+.2%})")
        assert abs(rel) < 0.02
        assert abs(formula / (paper_m * 1e6) - 1) < 0.01  # the config has the paper's shapes


@pytest.mark.parametrize("path", [p for p in CONFIG_FILES if variants_of(p) != (None,)])
def test_unknown_variant_lists_the_valid_ones(path):
    with pytest.raises(ValueError, match="7b") as error:
        load(path, "7b")
    for name in variants_of(path):
        assert name in str(error.value)


@pytest.mark.parametrize("path", ["configs/gpt2_paper.py", "configs/olmo_paper.py"])
def test_paper_configs_need_a_size(path):
    with pytest.raises(ValueError, match="valid variants"):
        config_lib.load_config_file(os.path.join(REPO, path))


# (config, main model M, f-gram model M without embeddings): the paper's SCONE settings.
PAPER_SCONE = [
    ("configs/gpt2_paper.py:419m,fgram=0.5x", 419, 170),
    ("configs/gpt2_paper.py:419m,fgram=3x", 419, 1020),
    ("configs/olmo_paper.py:1b,fgram=0.6b", 1014, 604),
    ("configs/olmo_paper.py:1b,fgram=1.8b,fgrams=1b", 1014, 1812),
]


@pytest.mark.parametrize("spec,main_m,fgram_m", PAPER_SCONE)
def test_scone_variants_have_the_papers_sizes(spec, main_m, fgram_m):
    config = config_lib.load_config_file(os.path.join(REPO, spec))
    assert config.scone.enabled
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(config)), nnx.Param)
    main, fgram = param_counts(abstract["decoder"]), param_counts(abstract["fgram_model"])
    print(f"{spec}: main {main['total'] / 1e6:.1f}M (paper {main_m}M), "
          f"f-gram model {fgram['non_embedding'] / 1e6:.1f}M (paper {fgram_m}M)")
    assert abs(main["total"] / 1e6 / main_m - 1) < 0.02
    assert abs(fgram["non_embedding"] / 1e6 / fgram_m - 1) < 0.02
    assert fgram["embedding"] == config.scone.max_len * config.model.d_model  # only its K positions


@pytest.mark.parametrize("spec,match", [
    ("configs/gpt2_paper.py:419m,fgrams=10m", "need fgram="),
    ("configs/gpt2_paper.py:419m,fgram=1x,colour=red", "Unknown option 'colour=red'"),
    ("configs/olmo_paper.py:1b,fgram=5b", "use one of"),
    ("configs/olmo_paper.py:1b,fgram=1x,fgrams=lots", "not a count"),
])
def test_bad_options_are_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        config_lib.load_config_file(os.path.join(REPO, spec))


def load_common():
    """configs/common.py, loaded by path as the configs load it."""
    spec = importlib.util.spec_from_file_location("_configs_common_under_test", os.path.join(REPO, "configs", "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_count():
    parse_count = load_common().parse_count
    assert [parse_count(t) for t in ("4096", "512k", "2K", "10m", "1.5m", "1b")] == [
        4096, 512_000, 2000, 10_000_000, 1_500_000, 10**9]
    with pytest.raises(ValueError, match="not a count"):
        parse_count("lots")


@pytest.mark.parametrize("how", ["load_config_file", "config_flags absolute", "config_flags relative"])
def test_paper_configs_load_from_any_directory(how, tmp_path, monkeypatch):
    """Configs find configs/common.py next to themselves (ml_collections sets __file__), whatever the
    current directory and sys.path: users pass relative or absolute paths from anywhere."""
    monkeypatch.chdir(tmp_path if how != "config_flags relative" else os.path.join(REPO, "configs"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != os.path.join(REPO, "configs")])
    path = "gpt2_paper.py" if how == "config_flags relative" else os.path.join(REPO, "configs", "gpt2_paper.py")
    if how == "load_config_file":
        config = config_lib.load_config_file(f"{path}:419m,fgram=1x,fgrams=512k")
    else:
        flag_values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", None, flag_values=flag_values)
        flag_values(["prog", f"--config={path}:419m,fgram=1x,fgrams=512k"])
        config = flag_values.config
    assert (config.model.num_layers, config.scone.num_layers, config.scone.num_fgrams) == (12, 12, 512_000)


def test_option_values():
    config = config_lib.load_config_file(os.path.join(REPO, "configs/olmo_paper.py:1b,fgram=1.8b,fgrams=1b,capacity=2k"))
    assert (config.scone.num_layers, config.scone.num_fgrams, config.scone.fgram_capacity) == (36, 10**9, 2000)


def test_paper_shapes():
    gpt2, olmo = load("configs/gpt2_paper.py", "589m"), load("configs/olmo_paper.py", "1b")
    assert (gpt2.model.d_model, gpt2.model.num_layers, gpt2.model.d_ff, gpt2.model.vocab_size) == (1536, 18, 6144, 50257)
    assert (gpt2.data.seq_len, gpt2.data.global_batch_size, gpt2.train.learning_rate) == (1024, 512, 2e-4)
    assert (gpt2.model.position, gpt2.model.mlp, gpt2.model.use_bias, gpt2.model.dtype) == ("learned", "gelu", True, "bfloat16")
    assert (olmo.model.d_model, olmo.model.num_layers, olmo.model.num_heads, olmo.data.seq_len) == (2048, 18, 16, 2048)
    assert (olmo.model.position, olmo.model.mlp, olmo.model.norm, olmo.model.use_bias) == (
        "rope", "swiglu", "nonparametric_layernorm", False)
    assert olmo.model.d_ff % 128 == 0 and abs(3 * olmo.model.d_ff - 2 * 8192) < 128 * 3


def test_paper_configs_pin_their_tokenizers_and_refuse_another(tokenizer_path):
    """GPT-2's tokenizer.json has 50,257 tokens, OLMo's 50,280 (its embedding pads to 50,304); a tokenizer of
    another size (here the tests' 512-piece model) stops the run at start with the fix."""
    from scone_jax.data.tokenizer import Tokenizer
    from scone_jax.training import assets

    tok = Tokenizer.load(tokenizer_path)
    for path, variant, tokens, embedding in (("configs/gpt2_paper.py", "128m", 50257, 50257),
                                             ("configs/olmo_paper.py", "1b", 50280, 50304)):
        config = load(path, variant)
        assert (config.data.tokenizer_size, config.data.vocab_size, config.model.vocab_size) == (
            tokens, tokens, embedding)
        with pytest.raises(ValueError, match=rf"has 512 tokens but data.tokenizer_size={tokens}: the config was made "
                                             r"for another tokenizer. Fix: point data.tokenizer_path at"):
            assets.resolve_vocab_size(config, tok)


@pytest.mark.parametrize("name,non_embedding,total", [
    ("qwen3_4b_base", 3.6e9, 4.0e9), ("qwen3_8b_base", 6.95e9, 8.2e9), ("qwen3_14b_base", 13.2e9, 14.8e9)])
def test_the_qwen3_config_files_have_the_published_sizes(name, non_embedding, total):
    """configs/hf/*/config.json, written from the published configs, give the decoders Qwen's model cards count
    (non-embedding parameters 3.6B, 6.95B, 13.2B; in all 4.0B tied, 8.2B and 14.8B untied). Caught: 14B's
    intermediate_size written as 13824 (Qwen2.5-14B's): 11.0B non-embedding."""
    config = config_lib.base_config()
    derive.from_config_files(config, os.path.join(REPO, "configs", "hf", name))
    counts = param_counts(nnx.eval_shape(lambda: build_model(config)))
    assert counts["total"] - counts["embedding"] - config.model.vocab_size * config.model.d_model * \
        (not config.model.tie_embeddings) == pytest.approx(non_embedding, rel=0.01)
    assert counts["total"] == pytest.approx(total, rel=0.01)
