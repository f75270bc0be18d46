"""tools/aot_compile.py end to end: compiles a small model's train step for a TPU slice
with libtpu (part of the [test] extra, so CI runs these; not skipped when missing)."""
import ast
import os
import re
import subprocess
import sys

import pytest

from tests.common import REPO


# configs/tiny.py shrunk to a 1-layer, 64-wide SCONE model: compiles in ~20 s.
SMALL = ["--config=configs/tiny.py", "--config.model.num_layers=1", "--config.model.d_model=64",
         "--config.model.num_heads=2", "--config.model.d_ff=128", "--config.data.global_batch_size=8",
         "--config.data.seq_len=32", "--config.data.vocab_size=512", "--config.scone.fgram_capacity=64",
         "--config.scone.num_layers=1"]


def aot(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "aot_compile.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def results(stdout: str) -> dict:
    return {k: float(v) for k, v in re.findall(r"^RESULT (\w+) (\S+)$", stdout, re.M)}


@pytest.mark.slow
def test_compiles_the_train_step_for_a_v5e_slice():
    run = aot(*SMALL, "--topology=v5e-4", "--config.mesh.data=2", "--config.mesh.fsdp=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "v5e-4: 4 chips (TPU v5 lite, topology v5e:2x2), mesh {'data': 2, 'fsdp': 2, 'tensor': 1}" in run.stdout
    assert "scan_layers=True, remat=none, attention=auto" in run.stdout
    found = results(run.stdout)
    assert 0 < found["hbm_gib_per_chip"] < 1 and 0 < found["compile_s"] < 120
    assert found["predicted_step_s"] == pytest.approx(found["step_flops"] / 197e12, rel=1e-3)
    assert run.stdout.rstrip().splitlines()[-1].startswith("FITS: ")


@pytest.mark.slow
def test_the_flop_formula_agrees_with_xla_on_the_unscanned_step():
    """XLA counts a scan's body once, so the formula behind MFU is checked on the Python loop."""
    run = aot(*SMALL, "--topology=v5e-4", "--config.model.scan_layers=False")
    assert run.returncode == 0, run.stderr[-3000:]
    flops = re.search(r"FLOPs per chip and step \(model formula\): (\S+); XLA (\S+) ", run.stdout)
    assert abs(float(flops[2]) / float(flops[1]) - 1) < 0.15
    assert results(run.stdout)["step_flops"] == pytest.approx(float(flops[1]), rel=1e-3)


@pytest.mark.slow
def test_a_batch_too_big_for_hbm_does_not_fit():
    # 4096 x 128 tokens of fp32 logits over 8,064 pieces alone are 15.8 GiB: over a v5e's 16 GiB.
    run = aot("--config=configs/tiny.py:baseline", "--topology=v5e-1", "--config.data.global_batch_size=4096")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "the TPU compiler ran out of HBM" in run.stdout
    assert results(run.stdout)["hbm_gib_per_chip"] > 16
    assert run.stdout.rstrip().splitlines()[-1].startswith("DOES NOT FIT on v5e-1; try --config.model.remat=save_dots")


@pytest.mark.slow
def test_a_decode_step_reports_the_kv_cache_of_grouped_heads():
    """--decode_context: one decoding step compiled for a v5e-4 slice over a 1,024-position cache of 2 sequences;
    the cache of 2 layers x 2 key/value heads of 32 (4 query heads) in fp32 is (k, v) 2 x 2 layers x 2 x 1024 x
    2 x 32 x 4 bytes = 2 MiB, 4 MiB with a key/value head per query head, and the compiled step fits."""
    run = aot(*SMALL, "--topology=v5e-4", "--decode_context=1024", "--decode_batch=2", "--config.model.num_heads=4",
              "--config.model.num_kv_heads=2", "--config.model.head_dim=32", "--config.model.num_layers=2",
              "--config.model.vocab_size=512", "--config.model.position=rope", "--config.model.qk_norm=True",
              "--config.model.rope_scaling=llama3", "--config.model.rope_scaling_factor=8.0")
    assert run.returncode == 0, run.stderr[-3000:]
    found = results(run.stdout)
    assert found["kv_cache_gib"] * 1024 == pytest.approx(2.0, rel=1e-5)
    assert found["kv_cache_mha_gib"] * 1024 == pytest.approx(4.0, rel=1e-5)
    assert "(2 layers, 2 key/value heads of 32, float32): 0.002 GiB; with as many key/value heads as query heads (4)" \
        in run.stdout
    assert 2 / 1024 < found["hbm_gib_per_chip"] < 1


def test_a_mesh_that_does_not_divide_the_chips_is_a_clear_error():
    run = aot(*SMALL, "--topology=v5p-8", "--config.mesh.data=3")
    assert run.returncode == 2
    assert "Mesh (data, fsdp, tensor) = (3, 1, 1) does not divide the 4 devices" in run.stderr


def test_an_unknown_slice_lists_the_valid_names():
    run = aot(*SMALL, "--topology=v5p-100")
    assert run.returncode == 2
    assert "Unknown TPU slice 'v5p-100'" in run.stderr
    for name in ("v4-8", "v5p-128", "v5e-256", "v6e-64"):
        assert name in run.stderr


def test_slice_names_map_to_libtpu_topologies():
    # In a subprocess: importing the tool defines absl flags, which must not leak into this one.
    names = ["v4-8", "v4-128", "v5p-128", "v5p-1024", "v5e-1", "v5litepod-16", "v5e-256", "v6e-8", "V6E-64"]
    code = ("import tools.aot_compile as a; "
            f"print([(s.topology_name, s.chips, s.chip_config, s.hbm_bytes >> 30) for s in map(a.parse_slice, {names})])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert ast.literal_eval(out) == [
        ("v4:2x2x1", 4, "megacore", 32), ("v4:4x4x4", 64, "megacore", 32), ("v5p:4x4x4", 64, "default", 95),
        ("v5p:8x8x8", 512, "default", 95), ("v5e:1x1", 1, "default", 16), ("v5e:4x4", 16, "default", 16),
        ("v5e:16x16", 256, "default", 16), ("v6e:2x4", 8, "default", 32), ("v6e:8x8", 64, "default", 32),
    ]


def _tiny_hf_configs(tmp_path) -> tuple[str, str]:
    """config.json files alone (no weights, no tokenizer) of a 2-layer Qwen3 main model of width 48 and a 3-layer
    Qwen3 source of width 64, as transformers writes them."""
    from tests import hf_models

    main, source = tmp_path / "main", tmp_path / "source"
    hf_models.tiny_config("qwen3").save_pretrained(main)
    hf_models.tiny_config("qwen3", hidden_size=64, num_hidden_layers=3, intermediate_size=96).save_pretrained(source)
    return str(main), str(source)


@pytest.mark.slow
def test_a_run_grown_from_a_source_compiles_from_config_json_files_alone(tmp_path):
    """configs/finetune_paper.py's shape of run (main model and f-gram model from Hugging Face config.json files,
    own token table, RoPE, gate) shrunk to tiny Qwen3 configs: compiled for a v5e-4 slice from the two config.json
    files, the directories the config names (/ckpt/...) absent here; the f-gram model's 3 layers of 64 and the
    table's size (200 f-grams x 48 x 2 bytes) printed. Caught: the table sized by the f-gram model's width (64)
    instead of the main model's, whose rows the table holds."""
    main, source = _tiny_hf_configs(tmp_path)
    run = aot("--config=configs/finetune_paper.py", "--topology=v5e-4", f"--hf_config={main}",
              f"--fgram_hf_config={source}", "--config.data.seq_len=32", "--config.data.global_batch_size=8",
              "--config.scone.fgram_capacity=16", "--config.scone.num_fgrams=200", "--config.model.remat=none")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "3 layers of width 64, from " + source in run.stdout, run.stdout
    found = results(run.stdout)
    assert found["table_gb"] == pytest.approx(200 * 48 * 2 / 1e9)
    assert 0 < found["hbm_gib_per_chip"] < 1
    assert run.stdout.rstrip().splitlines()[-1].startswith("FITS: ")


def test_a_checkpoint_directory_missing_here_asks_for_its_config_json():
    """configs/finetune_paper.py names /ckpt/Qwen3-4B-Base, absent on this machine: one line saying to pass
    --hf_config (exit 2), not a compile of the default model's shapes. Caught: from_config_files reading the
    missing directory as a config.json path ("/ckpt has no Qwen3-4B-Base", no word of --hf_config)."""
    run = aot("--config=configs/finetune_paper.py", "--topology=v5p-8")
    assert run.returncode == 2
    assert ("model.init_from_hf='/ckpt/Qwen3-4B-Base' does not exist on this machine. Fix: pass --hf_config=DIR"
            in run.stderr.strip().splitlines()[-1]), run.stderr[-2000:]
