"""Two small runs exported both ways (the bundle, and --format=hf with the remote-code model), shared by
tests/test_hf_scone_export.py: a SCONE run (Llama-style decoder with GQA, untied head, model.embedding_multiplier=2) and
a baseline GPT-2-style run with model.embedding_multiplier=4 (no stock family scales its input, so it goes through the
remote code too). Both read a 300-token tokenizer.json whose template adds bos (so AutoTokenizer and the harness's HF
backend tokenize as our adapter does) and have exactly 300 embedding rows (a random model may pick any row as its next
token; the matcher refuses ids outside the tokenizer)."""
import os

from scone_jax.serving import export, hf_export
from scone_jax.training import run as run_lib
from tests import hf_models
from tests.common import small_config

_CACHE = {}
LLAMA_STYLE = dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=False, num_kv_heads=2)


def run_config(tokenizer: str, scone: bool, **model):
    """init_std 0.5 by default: an untrained model whose logits are far from uniform, so a wrong input shows."""
    config = small_config(**{"init_std": 0.5, "vocab_size": hf_models.TOKENIZER_SIZE, "max_seq_len": 64, **model})
    with config.unlocked():
        config.data.tokenizer_path = tokenizer
        config.scone.update(dict(enabled=scone, max_len=4, num_fgrams=1000, min_count=3, fgram_capacity=64,
                                 num_layers=1, extract_max_tokens=100_000))
    return config


def exports(tmp_path_factory, kind: str) -> dict:
    """{'workdir', 'bundle', 'hf'} of the 'scone' or 'baseline' run, made once per session."""
    if kind not in _CACHE:
        root = tmp_path_factory.mktemp(f"hf_{kind}")
        if "tokenizer" not in _CACHE:
            _CACHE["tokenizer"] = hf_models.tokenizer_json(str(tmp_path_factory.mktemp("tok") / "tokenizer.json"),
                                                           "llama")
        # The baseline's tokens enter at 4 x 0.25: logits of about 10, as the SCONE run's (1e-4 stays a tight bound).
        model = (dict(LLAMA_STYLE, embedding_multiplier=2.0) if kind == "scone" else
                 dict(embedding_multiplier=4.0, init_std=0.25))
        config = run_config(_CACHE["tokenizer"], kind == "scone", **model)
        workdir, bundle, hf = (str(root / name) for name in ("run", "bundle", "hf"))
        run_lib.save_initial_state(config, workdir, 1)
        export.export(workdir, bundle, chunk_rows=64, batch_rows=512)
        meta = hf_export.export_hf(workdir, hf, batch_rows=512)
        _CACHE[kind] = {"workdir": workdir, "bundle": bundle, "hf": hf, "meta": meta}
    return _CACHE[kind]


def remote_files(hf_dir: str) -> list[str]:
    return sorted(name for name in os.listdir(hf_dir) if name.endswith(".py"))
