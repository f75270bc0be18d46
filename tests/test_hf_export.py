"""scone_jax -> Hugging Face (serving/hf_export.py, hf/write.py): a run's decoder written as a stock checkpoint of
its family, which transformers opens with no custom code. HF -> scone_jax -> HF gives back bit-identical tensors
(fp32 and bf16, one file or shards); a run trained here (every parameter random, norms and biases included)
gives transformers' logits within 1e-4 of ours; the tokenizer travels; what no family expresses is refused.

Deliberate bugs these tests were run against once (each made the named test fail):
  - write._tensor not transposing kernels back to [out, in]
    (test_a_run_trained_here_gives_transformers_our_logits[llama]: the MLP's kernels have the wrong shape);
  - GPT-2's c_attn written with q and k swapped (test_a_run_trained_here_gives_transformers_our_logits[gpt2]);
  - the exported dtype left at model.param_dtype for an imported bf16 checkpoint
    (test_round_trip_gives_back_bit_identical_tensors[llama-bf16-shards]);
  - _refuse_foreign not looking at the output, or passing any directory with our marker in it
    (test_an_output_holding_other_files_is_refused);
  - run.build starting a resumed run of an imported checkpoint from the checkpoint's weights again instead of its
    own latest state (test_an_imported_checkpoint_fine_tunes_resumes_exactly_and_exports: steps 3-4 differ).
Issue 64's slips no test caught, each now seen to fail the named test:
  - OLMo's head_dim check inverted (a head_dim apart from d/heads dropped: transformers builds a q_proj of
    d/heads per head) (test_a_head_dim_apart_from_d_over_heads_gives_transformers_that_q_proj[olmo]);
  - generation_config.json without eos_token_id (transformers' generate never stops)
    (test_a_run_trained_here_gives_transformers_our_logits[qwen3]);
  - YaRN's beta_fast and beta_slow swapped in the exported config.json and read back swapped
    (test_an_exported_yarn_config_gives_transformers_our_frequencies);
  - the export's rerun leaving a killed write's .safetensors-*.tmp, and model.safetensors written 0600
    (test_a_killed_export_s_temporary_files_go_with_its_rerun, and in the fast tier
    test_temporary_files_are_the_exporter_s_own_and_tensor_files_take_the_umask_s_mode).
"""
import json
import os
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch

from scone_jax.config import base_config
from scone_jax.data.tokenizer import Tokenizer
from scone_jax.serving import bundle, hf_export
from tests import hf_models


def imported(tmp_path, family, **checkpoint):
    """(the source model, its directory, the workdir of the run imported from it at step 0)."""
    hf_dir, workdir = str(tmp_path / "hf"), str(tmp_path / "run")
    model = hf_models.save_checkpoint(hf_dir, family, **checkpoint)
    hf_models.save_run(hf_models.import_config(hf_dir), workdir, devices=1)  # exported on all 8
    return model, hf_dir, workdir


def stored(directory) -> dict:
    """Every tensor of a checkpoint directory (one file or shards), as the safetensors library reads them."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(safetensors.torch.load_file(os.path.join(directory, name)))
    return out


SLOW = pytest.mark.slow  # each builds and saves a whole run: the fast tier keeps one case of each kind
ROUND_TRIPS = [  # (family, transformers overrides, checkpoint dtype, source shard size, export shard bytes)
    pytest.param("llama", {}, torch.bfloat16, "40KB", 60_000, id="llama-bf16-shards"),
    pytest.param("qwen3", dict(tie=True), torch.bfloat16, None, None, marks=SLOW, id="qwen3-tied-bf16"),
    pytest.param("gpt2", {}, torch.float32, None, None, marks=SLOW, id="gpt2-fp32"),
    pytest.param("olmo", dict(tie=True), torch.float32, None, None, marks=SLOW, id="olmo-tied-fp32"),
    pytest.param("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8}},
                 torch.float32, None, None, marks=SLOW, id="llama3.1-fp32"),
]


@pytest.mark.parametrize("family,overrides,dtype,source_shards,export_shards", ROUND_TRIPS)
def test_round_trip_gives_back_bit_identical_tensors(tmp_path, family, overrides, dtype, source_shards, export_shards):
    """HF -> import_hf's run -> --format=hf: the same tensor names, dtypes and bytes; transformers opens the export
    (AutoModelForCausalLM, no custom code) and computes the source model's logits exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, hf_dir, workdir = imported(tmp_path, family, dtype=dtype, shard_size=source_shards, **overrides)
    out = str(tmp_path / "out")
    meta = hf_export.export_hf(workdir, out, **({"max_shard_bytes": export_shards} if export_shards else {}))
    assert meta["family"] == family and meta["dtype"] == {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype]
    want, got = stored(hf_dir), stored(out)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    if export_shards:
        index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
        assert len(set(index["weight_map"].values())) > 1
    config = json.loads(open(os.path.join(out, "config.json")).read())
    original = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    for field in ("architectures", "model_type", "dtype", "vocab_size", "tie_word_embeddings", "rope_parameters",
                  "num_key_value_heads", "head_dim"):
        assert config.get(field) == original.get(field, config.get(field)), field
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens, lengths = hf_models.padded_batch()
    np.testing.assert_array_equal(hf_models.hf_logits(theirs, tokens, lengths),
                                  hf_models.hf_logits(source, tokens, lengths))
    text = "And God said, Let there be light: and there was light."
    ours = Tokenizer.load(os.path.join(hf_dir, "tokenizer.json"))
    assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False).input_ids == list(ours.encode(text))
    assert hf_export.export_hf(workdir, out) == meta  # a finished export again: nothing to do


def scratch_config(tokenizer, sharded=False, **model):
    """A small run of our own with the model keys `model`; `sharded`: its parameters sharded over data 2 x fsdp 2 x
    tensor 2 (all 8 devices), else on whatever devices it is built over."""
    c = base_config()
    c.model.update(dict(vocab_size=512, d_model=48, num_layers=2, num_heads=4, d_ff=80, max_seq_len=32, **model))
    c.data.update(dict(tokenizer_path=tokenizer, seq_len=16, global_batch_size=8, worker_count=0))
    if sharded:
        c.mesh.update(dict(data=2, fsdp=2, tensor=2))
    c.lock()
    return c


LLAMA_STYLE = dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=False)
SCRATCH = [  # (family, model keys)
    pytest.param("gpt2", {}, marks=SLOW, id="gpt2"),
    pytest.param("qwen3", dict(LLAMA_STYLE, qk_norm=True, num_kv_heads=2, head_dim=16, norm_eps=1e-6, rope_theta=1e6),
                 id="qwen3"),
    pytest.param("llama", LLAMA_STYLE, marks=SLOW, id="llama"),
    pytest.param("olmo", dict(LLAMA_STYLE, norm="nonparametric_layernorm", tie_embeddings=True, scan_layers=False),
                 marks=SLOW, id="olmo"),
]


@pytest.mark.parametrize("family,model", SCRATCH)
def test_a_run_trained_here_gives_transformers_our_logits(tmp_path, tokenizer_path, family, model, caplog):
    """A run of our own (a SentencePiece tokenizer, every parameter random) exports as the family its model section
    matches; transformers' model of the export gives our decoder's logits within 1e-4 on a right-padded batch; the
    export logs its progress writing tensors (a line a tenth: MB, MB/s, time left)."""
    from transformers import AutoModelForCausalLM

    workdir, out = str(tmp_path / "run"), str(tmp_path / "out")
    sharded = family == "gpt2"  # its fused c_attn gathered from q, k, v sharded over fsdp and tensor
    config = scratch_config(tokenizer_path, sharded=sharded, **model)
    decoder = hf_models.save_run(config, workdir, devices=None if sharded else 1, randomize_params=True)
    with caplog.at_level("INFO"):
        assert hf_export.export_hf(workdir, out)["family"] == family
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf export: tensors:")]
    assert len(progress) >= 5 and "(100%)" in progress[-1] and "MB/s, ETA 0 s" in progress[-1], progress
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens, lengths = hf_models.padded_batch(vocab=500)
    want = hf_models.our_logits(decoder, tokens, lengths)
    assert np.abs(want).max() > 1
    worst = hf_models.assert_logits_match(hf_models.hf_logits(theirs, tokens, lengths), want, lengths)
    print(f"{family}: max |logit difference| {worst:.1e}")
    tokenizer_config = json.loads(open(os.path.join(out, "tokenizer_config.json")).read())
    assert os.path.exists(os.path.join(out, "tokenizer.model")) and tokenizer_config["eos_token"] == "</s>"
    if family == "qwen3":  # the default config's kind of tokenizer, through the export itself (issue 62)
        from transformers import AutoTokenizer

        ours, auto = Tokenizer.load(tokenizer_path), AutoTokenizer.from_pretrained(out)
        for text in ("In the beginning God created the heaven and the earth.", "  Digits 1234,\n\tand ☃ 日本"):
            assert auto(text).input_ids == [ours.bos_id, *ours.encode(text)]
            assert auto.decode(auto(text).input_ids, skip_special_tokens=True) == text
        assert_generate_stops_at_eos(theirs, ours.eos_id)


def assert_generate_stops_at_eos(model, eos: int, new: int = 12):
    """transformers' greedy generate, with the export's generation_config.json, ends a sequence at the run's eos:
    the model's head row of eos is made that of a token the model picks at step k (k > 1, its first pick there), so
    greedy decoding produces eos at step k (a tie goes to the lower id), and generate must stop there."""
    import torch

    prompt = torch.tensor([[5, 17, 33, 71]])
    free = model.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:]
    assert model.generation_config.eos_token_id == eos
    picks = free.tolist()
    k = next(k for k in range(1, new) if picks[k] > eos and picks[k] not in picks[:k])
    with torch.no_grad():
        model.lm_head.weight[eos] = model.lm_head.weight[picks[k]]
    out = model.generate(prompt, max_new_tokens=new, do_sample=False)[0, 4:].tolist()
    assert out == picks[:k] + [eos], (out, picks)


@pytest.mark.parametrize("family,model", [
    ("olmo", dict(LLAMA_STYLE, norm="nonparametric_layernorm", tie_embeddings=True)),
    ("llama", LLAMA_STYLE),
    ("qwen3", dict(LLAMA_STYLE, qk_norm=True, norm_eps=1e-6)),
])
def test_a_head_dim_apart_from_d_over_heads_gives_transformers_that_q_proj(tmp_path, family, model):
    """model.head_dim 16 with d_model 48 and 4 heads (not 12): the config.json the export writes makes transformers
    build every attention projection at the shapes of the tensors the export writes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from scone_jax.hf import families, write as hf_write

    ours = scratch_config("unused", head_dim=16, num_kv_heads=2, **model).model.to_dict()
    family_ = families.of_model(ours)
    assert family_.model_type == family
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_write.hf_config(family_, ours, "F32", {"bos": 2, "eos": 3, "pad": 0}), f)
    theirs = dict(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path))).named_parameters())
    written = {t.name.format(i=0): t.shape for t in family_.tensors(ours)}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        key = f"model.layers.0.self_attn.{name}.weight"
        assert tuple(theirs[key].shape) == tuple(written[key]), name
    assert tuple(written["model.layers.0.self_attn.q_proj.weight"]) == (64, 48)


def test_an_exported_yarn_config_gives_transformers_our_frequencies(tmp_path):
    """A YaRN run (beta_fast 32, beta_slow 1, as Qwen's releases) exported: transformers reads its config.json into
    the RoPE frequencies and attention factor our model uses, and the import reads the same keys back."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from scone_jax.hf import families, write as hf_write
    from scone_jax.model.rope import Rope

    yarn = dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=64, rope_theta=1e4,
                rope_beta_fast=32.0, rope_beta_slow=1.0)
    config = scratch_config("unused", head_dim=64, num_kv_heads=2, **LLAMA_STYLE, **yarn)
    ours = config.model.to_dict()
    family = families.of_model(ours)
    written = hf_write.hf_config(family, ours, "F32", {"bos": 2, "eos": 3, "pad": 0})
    with open(tmp_path / "config.json", "w") as f:
        json.dump(written, f)
    hf = AutoConfig.from_pretrained(str(tmp_path))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rope = Rope.of(config.model, 64)
    np.testing.assert_allclose(np.asarray(rope.frequencies()), inv_freq.numpy(), rtol=1e-5)
    assert rope.attention_factor == pytest.approx(factor)
    plain = 1e4 ** (-np.arange(32) / 32)
    assert not np.allclose(inv_freq.numpy(), plain) and not np.allclose(inv_freq.numpy(), plain / 4)  # a real ramp
    back = family.model_keys(written, "config.json")
    assert {k: back[k] for k in yarn} == yarn


@pytest.mark.slow
def test_the_tokenizer_of_a_run_of_its_own_opens_with_autotokenizer(tmp_path):
    """A run trained from scratch with a tokenizer.json: tokenizer_config.json names its special tokens, and
    AutoTokenizer encodes as the run did."""
    from transformers import AutoTokenizer

    path = hf_models.tokenizer_json(str(tmp_path / "tokenizer.json"), "llama")
    workdir, out = str(tmp_path / "run"), str(tmp_path / "out")
    config = scratch_config(path, **LLAMA_STYLE)
    config.model.vocab_size = 384
    hf_models.save_run(config, workdir, devices=1, randomize_params=True)
    hf_export.export_hf(workdir, out)
    tokenizer, text = Tokenizer.load(path), "In the beginning God created the heaven and the earth."
    auto = AutoTokenizer.from_pretrained(out)
    assert auto(text, add_special_tokens=False).input_ids == list(tokenizer.encode(text))
    assert (auto.eos_token, auto.bos_token) == ("<|end_of_text|>", "<|begin_of_text|>")
    assert json.loads(open(os.path.join(out, "generation_config.json")).read())["eos_token_id"] == tokenizer.eos_id


@pytest.mark.parametrize("change,named", [
    ({"model.position": "rope"}, "gpt2 needs position='learned' (has 'rope')"),
])
def test_what_no_family_expresses_is_refused_in_one_line(change, named):
    config = base_config()
    for key, value in change.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(ValueError) as e:
        hf_export.plan(config)
    assert named in str(e.value) and "\n" not in str(e.value) and "Fix:" in str(e.value), str(e.value)


@SLOW
def test_an_output_holding_other_files_is_refused(tmp_path):
    """An export never overwrites what it did not write: a bundle, another checkpoint, any file, a file beside a
    finished export of ours; and an export of another step of the run at the same output is refused. Caught: the
    old check passing any directory with our marker in it (a user's file beside it was kept, unnoticed, in what
    transformers would load)."""
    from scone_jax.serving.output_dir import OutputNotFreeError

    _, _, workdir = imported(tmp_path, "gpt2")
    for name, what in ((bundle.META, "holds 'export.json', which a Hugging Face export of scone_jax does not write"),
                       ("config.json", "holds config.json but no scone_export_hf.json")):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        (out / name).write_text("{}")
        with pytest.raises(OutputNotFreeError, match=what):
            hf_export.export_hf(workdir, str(out))
        assert os.listdir(out) == [name]
    out = str(tmp_path / "out")
    meta = hf_export.export_hf(workdir, out)
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("mine")
    with pytest.raises(OutputNotFreeError, match="holds 'notes.txt', which a Hugging Face export"):
        hf_export.export_hf(workdir, out)
    os.remove(os.path.join(out, "notes.txt"))
    marker = json.loads(open(os.path.join(out, hf_export.HF_EXPORT)).read())
    marker["step"] = 7
    with open(os.path.join(out, hf_export.HF_EXPORT), "w") as f:
        json.dump(marker, f)
    with pytest.raises(bundle.BundleError, match=r"differs from this one in \['step'\]"):
        hf_export.export_hf(workdir, out)
    assert meta["step"] == 0


@SLOW
def test_an_export_stopped_while_writing_is_unfinished_and_a_rerun_completes_it(tmp_path, monkeypatch):
    """An export stopped after it claimed its output (here: the weights' writer raising) leaves a marker that says
    unfinished, and the same command again writes the whole checkpoint, the tensors an uninterrupted export writes.
    Caught: the marker written as complete when the export starts (the rerun returned at once: no weights)."""
    from scone_jax.hf import write as hf_write

    _, _, workdir = imported(tmp_path, "gpt2")
    whole = str(tmp_path / "whole")
    hf_export.export_hf(workdir, whole)
    out = str(tmp_path / "out")
    real = hf_write.write_checkpoint

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_write, "write_checkpoint", stopped)
    with pytest.raises(KeyboardInterrupt):
        hf_export.export_hf(workdir, out)
    assert json.loads(open(os.path.join(out, hf_export.HF_EXPORT)).read())["complete"] is False
    monkeypatch.setattr(hf_write, "write_checkpoint", real)
    hf_export.export_hf(workdir, out)
    assert json.loads(open(os.path.join(out, hf_export.HF_EXPORT)).read())["complete"] is True
    theirs, ours = stored(whole), stored(out)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_progress_logs_a_line_a_tenth_with_rate_and_time_left():
    """runtime/progress.Progress over 1,000 rows in pieces of 30 at 100 rows a second: one line each time another
    tenth is done (10 in all, the last at 100%), each with the rows done, the rate and the time left; a piece that
    crosses several tenths gives one line, and the next comes a tenth later. Caught: the next threshold advanced by
    one tenth per line (a line for every piece after a large one)."""
    from scone_jax.runtime.progress import Progress

    lines, now = [], [0.0]
    progress = Progress("table", 1000, "rows", log=lambda fmt, *args: lines.append(fmt % args), clock=lambda: now[0])
    for _ in range(33):
        now[0] += 0.3
        progress.add(30)
    now[0] += 0.1
    progress.add(10)
    assert len(lines) == 10, lines
    assert lines[0] == "table: 120/1,000 rows (12%), 100.0 rows/s, ETA 9 s"
    assert lines[-1] == "table: 1,000/1,000 rows (100%), 100.0 rows/s, ETA 0 s"
    lines.clear()
    progress = Progress("t", 100, "rows", log=lambda fmt, *args: lines.append(fmt % args), clock=lambda: 1.0)
    for piece in [50] + [5] * 10:
        progress.add(piece)
    assert [line.split("(")[1].split(")")[0] for line in lines] == ["50%", "60%", "70%", "80%", "90%", "100%"]


def test_temporary_files_are_the_exporter_s_own_and_tensor_files_take_the_umask_s_mode(tmp_path):
    """The fast tier's share of the next test: a rerun's clean-up removes only names the exporter gives its
    temporaries (a user's `notes.tmp` or `.safetensors-notes` is not one), and a tensor file is 0644 under umask
    022. Caught: write_file keeping mkstemp's 0600 (the clean-up call left out of the rerun is caught by the next,
    slow, test only)."""
    from scone_jax.hf import safetensors as st

    ours = [".safetensors-123-ab12cd34.tmp", "config.json.tmp", "fgram_table.safetensors.tmp", "tokenizer.json.tmp"]
    theirs = ["notes.tmp", ".safetensors-notes", "model.safetensors"]
    for name in ours + theirs:
        (tmp_path / name).write_text("x")
    hf_export._remove_temporaries(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(theirs)
    old = os.umask(0o022)
    try:
        st.write_file(str(tmp_path / "t.safetensors"), [("a", np.dtype(np.float32), (2,))], lambda _: np.ones(2, np.float32))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "t.safetensors").st_mode & 0o777 == 0o644


@SLOW
def test_a_killed_export_s_temporary_files_go_with_its_rerun(tmp_path, monkeypatch):
    """An export killed while writing a tensor file (here: stopped with its clean-up disabled, which leaves what a
    SIGKILL leaves: `.safetensors-<pid>-<random>.tmp`) and while writing a JSON file (`config.json.tmp`): the same
    command again removes both, completes the export, and writes model.safetensors with the mode the umask gives
    its neighbours (0644 under umask 022), not mkstemp's 0600."""
    from scone_jax.hf import write as hf_write

    _, _, workdir = imported(tmp_path, "gpt2")
    out = str(tmp_path / "out")
    real, calls = hf_write._tensor, []

    def killed(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(hf_write, "_tensor", killed)
        m.setattr(os, "unlink", lambda path: None)
        with pytest.raises(KeyboardInterrupt):
            hf_export.export_hf(workdir, out)
    left = [n for n in os.listdir(out) if n.startswith(".safetensors-") and n.endswith(".tmp")]
    assert len(left) == 1 and "model.safetensors" not in os.listdir(out)
    with open(os.path.join(out, "config.json.tmp"), "w") as f:
        f.write('{"half": ')
    old = os.umask(0o022)
    try:
        hf_export.export_hf(workdir, out)
    finally:
        os.umask(old)
    names = os.listdir(out)
    assert not [n for n in names if n.endswith(".tmp")], names
    assert json.loads(open(os.path.join(out, hf_export.HF_EXPORT)).read())["complete"] is True
    modes = {n: os.stat(os.path.join(out, n)).st_mode & 0o777 for n in names}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


@pytest.mark.slow
def test_an_imported_checkpoint_fine_tunes_resumes_exactly_and_exports(tmp_path):
    """tools/import_hf.py -> scone_jax.main (stopped after 2 steps and resumed) == an uninterrupted run, batch for
    batch and parameter for parameter; the run then exports with --format=hf (transformers opens it) and as a
    bundle, like any run."""
    from transformers import AutoModelForCausalLM

    from tests.common import REPO, run_main, run_tool, step_records
    from tests.test_train import final_params

    hf_dir = str(tmp_path / "hf")
    hf_models.save_checkpoint(hf_dir, "qwen3", tie=True)
    flags = ["--config.data.seq_len=16", "--config.data.global_batch_size=8", "--config.train.num_steps=4",
             "--config.train.checkpoint_every=2", "--config.train.eval_every=0", "--config.train.log_every=1",
             "--config.data.worker_count=0"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    result = run_tool("tools/import_hf.py", [f"--hf_dir={hf_dir}", f"--workdir={straight}", *flags])
    assert result.returncode == 0 and "imported the qwen3 checkpoint" in result.stdout, result.stderr[-3000:]
    # The command it prints is the one that resumes it (the default config named, the flags as given).
    assert result.stdout.split("Fine-tune it: ")[1].strip() == " ".join([
        "python -m scone_jax.main", f"--config={os.path.join(REPO, 'configs', 'finetune_hf.py')}", *flags,
        f"--config.model.init_from_hf={hf_dir}", f"--workdir={straight}"])
    shutil.copytree(straight, split)
    main_flags = [f"--config.model.init_from_hf={hf_dir}", *flags]
    done = run_main(straight, *main_flags, config="configs/finetune_hf.py")
    assert done.returncode == 0 and "Resumed from step 0" in done.stderr, done.stderr[-3000:]
    first = run_main(split, *main_flags, "--config.train.max_steps_per_run=2", config="configs/finetune_hf.py")
    second = run_main(split, *main_flags, config="configs/finetune_hf.py")
    assert first.returncode == second.returncode == 0 and "Resumed from step 2" in second.stderr, second.stderr[-3000:]
    a, b = step_records(straight), step_records(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [a[s]["batch_crc"] for s in a] == [b[s]["batch_crc"] for s in a]
    np.testing.assert_allclose([a[s]["loss"] for s in a], [b[s]["loss"] for s in a], rtol=1e-6)
    config = hf_models.import_config(hf_dir)
    from scone_jax.hf import derive
    derive.apply(config)
    for x, y in zip(final_params(config, straight), final_params(config, split)):
        np.testing.assert_array_equal(x, y)
    out = str(tmp_path / "out")
    exported = run_tool("-m scone_jax.serving.export", [f"--workdir={straight}", f"--output={out}", "--format=hf"])
    assert exported.returncode == 0 and "as a qwen3 checkpoint (F32)" in exported.stdout, exported.stderr[-3000:]
    assert AutoModelForCausalLM.from_pretrained(out).config.tie_word_embeddings
    exported = run_tool("-m scone_jax.serving.export", [f"--workdir={straight}", f"--output={tmp_path / 'bundle'}"])
    assert exported.returncode == 0, exported.stderr[-3000:]
