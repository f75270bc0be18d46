"""The f-gram model grown from a pretrained Hugging Face checkpoint (scone.init_from_hf, hf/fgram_source.py).

Reference: transformers itself. For an f-gram t_1..t_n the f-gram model (before its projection) computes what the
source model computes for those tokens at positions 0..n-1: its hidden states after the final norm. Step 0 of SCONE
fine-tuning equals the plain fine-tune of the main model (scone.gate at g = 0): the same loss and the same gradients
of the decoder's parameters, on a batch with f-grams matched.

Deliberate bugs these tests were run against once (each made the named test fail):
  - the f-gram model's RoPE at positions 1..K instead of 0..K-1: test_the_fgram_model_computes_what_the_source_
    computes[qwen3] (a difference of 3.2); with learned positions over K instead (fgram_block_config setting
    position='learned' for a source too) the source has no tensor for them and the load refuses;
  - SconeModel.fgram_inputs reading the decoder's T instead of the f-gram model's own table:
    test_the_fgram_model_computes_what_the_source_computes[*];
  - fgram_source.placement leaving GPT-2's learned positions whole (wpe [64, d] against the f-gram model's [K, d]):
    test_the_fgram_model_computes_what_the_source_computes[gpt2] (the shape check refuses; slow tier), and in the
    fast tier test_a_gpt2_source_loads_the_first_k_rows_of_its_positions_and_its_tables;
  - source_params counting a GPT-2 source's whole position table, not the K rows it uses:
    test_a_gpt2_sources_count_holds_only_the_k_positions_the_fgram_model_uses (issue 64);
  - the gate starting at 0.5 instead of 0: test_step_zero_equals_the_plain_fine_tune (losses differ);
  - check_tokenizer comparing the tokenizers' sizes only: test_a_source_with_another_tokenizer_is_refused;
  - source_params leaving out the own token table: test_bad_sources_are_refused_in_one_line[capacity];
  - run.build starting a resumed run from the source's weights again (init_state after the restore):
    test_a_run_grown_from_a_source_resumes_and_exports_its_rows (g = 0.0, not the saved 0.5).
"""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from scone_jax import config as config_lib, sharding
from scone_jax.batch import Batch
from scone_jax.model import fgram_model
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.matcher import Matcher
from scone_jax.hf import derive, fgram_source
from scone_jax.hf.checkpoint_dir import HfCheckpointError
from scone_jax.study import finetune
from scone_jax.training import state as state_lib, steps
from tests import hf_models
from tests.test_fgram_matcher import closure, make_vocab, planted_batch

K = 4
WIDE = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=96)  # the source: wider and deeper than the main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (main directory, source directory, the source's transformers model)}, made on first use."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            main, source = str(root / "main"), str(root / "source")
            hf_models.save_checkpoint(main, family, seed=0)
            extra = dict(WIDE) if family != "gpt2" else dict(n_embd=64, n_layer=3, n_inner=96)
            made[family] = (main, source, hf_models.save_checkpoint(source, family, seed=1, **extra))
        return made[family]

    return get


def scone_config(main: str, source: str, **scone):
    """The main checkpoint imported, with an f-gram model grown from `source` (own token table, gate)."""
    config = hf_models.import_config(main)
    with config.unlocked():
        config.scone.update({**dict(enabled=True, init_from_hf=source, gate=True, own_token_embedding=True, max_len=K,
                                    fgram_capacity=64), **scone})
    return config


def built(config, devices: int = 1):
    """(model, spec) of `config` derived and initialised as a fresh run does (its checkpoints read)."""
    derive.apply(config)
    config_lib.validate(config)
    spec = state_lib.state_spec(config, sharding.make_mesh(config.mesh, jax.devices()[:devices]))
    return state_lib.model_of(spec.graphdef, state_lib.init_state(config, spec)), spec


# Qwen3 (the paper's family) in the fast tier; Llama and GPT-2 compile two more models each: slow tier.
@pytest.mark.parametrize("family", ["qwen3", pytest.param("llama", marks=pytest.mark.slow),
                                    pytest.param("gpt2", marks=pytest.mark.slow)])
def test_the_fgram_model_computes_what_the_source_computes(checkpoints, family):
    """Rows of 4, 3, 2 and 1 tokens (right-padded to K): at every real position the f-gram model's hidden state
    before the projection equals transformers' last_hidden_state of the source model for that row (attention mask
    over the padding; positions 0..n-1). Qwen3 with q/k norm and GQA, Llama with its own epsilon, GPT-2 with the
    first K rows of its learned positions."""
    main, source, reference = checkpoints(family)
    config = scone_config(main, source)
    model, _ = built(config)
    block = fgram_model.fgram_block_config(config.model, config.scone)  # the source's kind of block, K positions
    assert (block.d_model, block.num_layers, block.position, block.max_seq_len) == \
        (64, 3, "learned" if family == "gpt2" else "rope", K)
    tokens, _ = hf_models.padded_batch(seed=3, rows=4, length=K)
    lengths = np.array([4, 3, 2, 1])
    ours = np.asarray(model.fgram_model.hidden(model.fgram_inputs(jnp.asarray(tokens)), jnp.asarray(lengths)))
    mask = (np.arange(K)[None] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        base = reference.transformer if family == "gpt2" else reference.model
        want = base(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                    attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
    assert ours.shape == (4, K, 64)
    worst = max(float(np.abs(ours[r, :n] - want[r, :n]).max()) for r, n in enumerate(lengths))
    assert worst < 1e-4 and float(np.abs(want).max()) > 1, worst
    # The rows the export writes: the projection of the last real position's state (g = 0: T(last token) itself).
    rows = np.asarray(model.fgram_embeddings(jnp.asarray(tokens), jnp.asarray(lengths)))
    last = tokens[np.arange(4), lengths - 1]
    np.testing.assert_array_equal(rows, np.asarray(model.decoder.input_tokens(jnp.asarray(last))))


def _matched_batch(seed: int = 0):
    """A packed batch (ids < 300, the tokenizer's) with planted f-grams of 2..4 tokens, through the production
    FgramBatcher; and the same batch without its f-gram arrays (the plain fine-tune's)."""
    rng = np.random.default_rng(seed)
    grams = closure([list(5 + rng.integers(50, size=rng.integers(2, K + 1))) for _ in range(12)])
    tokens, segments = planted_batch(rng, grams, 300, batch=8, length=17)
    segments[:, 0] = np.maximum(segments[:, 0], 1)
    seg_in, seg_out = segments[:, :-1], segments[:, 1:]
    start = np.concatenate([np.ones((8, 1), bool), seg_in[:, 1:] != seg_in[:, :-1]], axis=1)
    positions = np.arange(16)[None] - np.maximum.accumulate(np.where(start, np.arange(16)[None], 0), axis=1)
    plain = Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg_in, positions=positions.astype(np.int32),
                  loss_mask=((seg_in > 0) & (seg_out == seg_in)).astype(np.float32))
    vocab = make_vocab(grams, K, 300)
    scone = FgramBatcher(Matcher(vocab), vocab, num_shards=1, capacity=64)(plain)
    return jax.tree.map(jnp.asarray, scone.for_device()), jax.tree.map(jnp.asarray, plain.for_device())


# How a grown f-gram model starts at the plain fine-tune: the gate at g = 0, or T(token) + P h with P = 0; the
# parameter whose gradient starts the f-gram model learning.
STARTS = {"gate": ({}, ("gate",)),
          "add, zero projection": ({"gate": False, "combine": "add", "output_projection_init": "zeros"},
                                   ("out_proj", "kernel"))}


@pytest.mark.slow  # trains two runs: the fast tier keeps the parity case above
@pytest.mark.parametrize("start", STARTS)
def test_step_zero_equals_the_plain_fine_tune(checkpoints, start):
    """The SCONE run (Qwen3 main + a wider, deeper Qwen3 f-gram model; g = 0, or scone.combine='add' through a
    zero-initialised projection) and the plain fine-tune of the same main checkpoint: the same summed loss, token
    count and gradient of every decoder parameter on a batch where f-grams are matched; the f-gram model's own
    gradients are exactly zero (nothing of it reaches the decoder yet) except the gate's, or the projection's, which
    is how it starts to learn. Caught (add): the projection initialised at init_std (the loss moved)."""
    settings, learner = STARTS[start]
    main, source, _ = checkpoints("qwen3")
    scone_batch, plain_batch = _matched_batch()
    assert int((scone_batch.fgram_slot >= 0).sum()) >= 15
    scone, _ = built(scone_config(main, source, **settings))
    plain, _ = built(hf_models.import_config(main))
    loss, count, grads = nnx.jit(steps.loss_and_grads)(scone, scone_batch)
    plain_loss, plain_count, plain_grads = nnx.jit(steps.loss_and_grads)(plain, plain_batch)
    assert float(count) == float(plain_count) and float(loss) == pytest.approx(float(plain_loss), rel=1e-6)
    ours = nnx.to_flat_state(grads["decoder"])
    theirs = dict(nnx.to_flat_state(plain_grads))
    assert len(ours) == len(theirs)
    for path, g in ours:
        np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(theirs[path].get_value()), rtol=1e-5,
                                   atol=1e-7, err_msg=str(path))
    fgram = dict(nnx.to_flat_state(grads["fgram_model"]))
    assert float(jnp.abs(fgram[learner].get_value()).max()) > 0
    assert all(float(jnp.abs(g.get_value()).max()) == 0 for path, g in fgram.items()
               if path[0] not in ("gate", "out_proj"))


@pytest.mark.parametrize("start", finetune.STARTS)
def test_the_fine_tuning_studys_scone_arms_start_as_asked_and_validate(checkpoints, tmp_path, start):
    """study/finetune.py's SCONE arms (tools/bench_finetune.py --scone_start): `projection` (the default) adds the rows
    through a zero projection, no gate; `gate` is the first study's start. Both derive and validate as the main job
    does, the plain arm has none of it, and the record names the start. Caught: the arms still starting with the gate
    under the default (combine 'replace' recorded for `projection`)."""
    main, source, _ = checkpoints("gpt2")
    study = finetune.FinetuneStudy(str(tmp_path), list(finetune.ARMS), 4096, ["1e-3"], str(tmp_path), main, source,
                                   0, True, {}, start)
    for arm in finetune.SCONE_ARMS:
        config = study.config(arm, "1e-3")
        config_lib.validate(config)
        s = config.scone
        assert (s.gate, s.combine, s.output_projection_init) == (
            (True, "replace", "normal") if start == "gate" else (False, "add", "zeros")), arm
        assert s.gate_learning_rate_multiplier == (finetune.GATE_LEARNING_RATE_MULTIPLIER if start == "gate" else 1.0)
    plain = study.config("ft_plain", "1e-3")
    assert not plain.scone.enabled
    keys = study.recorded_keys(study.config("ft_scone_pretrained", "1e-3"))
    assert {"scone.combine", "scone.output_projection_init", "scone.gate"} <= set(keys)
    with pytest.raises(ValueError, match="start='add': choose among projection, gate"):
        finetune.FinetuneStudy(str(tmp_path), list(finetune.ARMS), 4096, ["1e-3"], str(tmp_path), main, source, 0,
                               True, {}, "add")


def test_a_source_with_another_tokenizer_is_refused(checkpoints, tmp_path):
    """A source whose tokenizer.json maps ids to other tokens (Llama's specials in Qwen's place) is refused in one
    line naming both files and the first id that differs; one that is another file with the same id -> token map
    (re-indented JSON) is accepted."""
    main, source, _ = checkpoints("qwen3")
    other = str(tmp_path / "other")
    shutil.copytree(source, other)
    hf_models.tokenizer_json(os.path.join(other, "tokenizer.json"), "llama")
    with pytest.raises(HfCheckpointError) as e:
        derive.apply(scone_config(main, other))
    text = str(e.value)
    assert f"{main}/tokenizer.json (data.tokenizer_path)" in text and f"{other}/tokenizer.json" in text, text
    assert "id 0 is '<|endoftext|>' in the first and '<|end_of_text|>' in the second" in text
    assert "Fix:" in text and "\n" not in text
    spec = json.loads(open(os.path.join(source, "tokenizer.json")).read())
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(spec, f, indent=1)
    assert derive.apply(scone_config(main, other)) is not None


def _short(directory):
    with open(os.path.join(directory, "config.json")) as f:
        spec = json.load(f)
    spec["max_position_embeddings"] = 3
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(spec, f)


# kind: (scone settings, how the source is changed or None, what the line says)
BAD = {
    "positions": ({}, _short, "the source has 3 positions (max_position_embeddings) but f-grams have up to "
                              "scone.max_len=4 tokens"),
    # blocks 3 x 30,880 + final norm 64 + own table 320 x 64 + out_proj 64 x 48 = 116,256 parameters.
    "capacity": ({"max_source_params": 116_255}, None, "would have 116,256 parameters, more than "
                                                        "scone.max_source_params=116,255"),
    "no gate": ({"gate": False}, None, "is set with scone.gate=False and scone.combine='replace', "
                                       "scone.output_projection_init='normal': the run would not start as the plain "
                                       "fine-tune of the main model. Fix: set --config.scone.gate=True"),
    "add without a zero projection": ({"gate": False, "combine": "add"}, None,
                                      "Fix: set --config.scone.gate=True (g = 0 at step 0), or "
                                      "--config.scone.combine=add with --config.scone.output_projection_init=zeros"),
    "no scone": ({"enabled": False}, None, "is set with scone.enabled=False"),
    "width": ({"d_model": 32}, None, "scone.d_model=32 conflicts with"),
}


@pytest.mark.parametrize("kind", BAD)
def test_bad_sources_are_refused_in_one_line(checkpoints, tmp_path, kind):
    main, source, _ = checkpoints("qwen3")
    settings, change, named = BAD[kind]
    if change is not None:
        changed = str(tmp_path / "source")
        shutil.copytree(source, changed)
        change(changed)
        source = changed
    with pytest.raises(ValueError) as e:
        derive.apply(scone_config(main, source, **settings))
    text = str(e.value)
    assert named in text and "Fix:" in text and "\n" not in text, text
    if kind == "capacity":  # one more parameter allowed: accepted, and the count is what the run builds
        config = scone_config(main, source, max_source_params=116_256)
        checkpoint = derive.apply(config) and derive.open_checkpoint(source)
        assert fgram_source.source_params(checkpoint.family, checkpoint.model, config) == 116_256
        model = nnx.eval_shape(lambda: state_lib.build_model(config))
        assert sum(x.size for x in jax.tree.leaves(nnx.state(model.fgram_model, nnx.Param))) == 116_256 + 1  # + g


def test_the_count_holds_a_zero_projection_at_equal_widths(checkpoints):
    """A source as wide as the main model (the main checkpoint itself) under scone.combine='add' with
    scone.output_projection_init='zeros': the run builds a d x d projection, and scone.max_source_params' count
    (source_params) is exactly the f-gram model's parameters, that projection included. Caught: the count leaving
    it out (a source within the bound by that margin would build a model above it)."""
    main, _, _ = checkpoints("qwen3")
    config = scone_config(main, main, gate=False, combine="add", output_projection_init="zeros")
    checkpoint = derive.apply(config) and derive.open_checkpoint(main)
    model = nnx.eval_shape(lambda: state_lib.build_model(config))
    assert model.fgram_model.out_proj is not None and config.scone.d_model == config.model.d_model
    built = sum(x.size for x in jax.tree.leaves(nnx.state(model.fgram_model, nnx.Param)))
    assert fgram_source.source_params(checkpoint.family, checkpoint.model, config) == built


@pytest.mark.slow  # builds, saves, restores and exports a run: about a minute on 2 cores
def test_a_run_grown_from_a_source_resumes_and_exports_its_rows(checkpoints, tmp_path):
    """A SCONE run of a Qwen3 main model with its f-gram model from a wider Qwen3 (g set to 0.5, as training would
    move it), saved at step 0: the bundle's table rows are, for each f-gram, (1 - g) T(last token) + g out_proj(h)
    with h transformers' last hidden state of the source for the f-gram and T the main checkpoint's embed_tokens;
    --format=hf writes the same rows; a resume restores the saved state (g = 0.5, not the source's weights read
    again), from a moved copy of the source too, and without the source it is refused naming scone.source_model."""
    from safetensors.numpy import load_file

    from scone_jax.serving import export, hf_export
    from scone_jax.training import checkpoint as checkpoint_lib, run as run_lib
    from tests import serving_run

    main, source, reference = checkpoints("qwen3")
    settings = dict(num_fgrams=200, min_count=3, extract_max_tokens=100_000)
    workdir = str(tmp_path / "run")
    mesh = sharding.make_mesh(hf_models.import_config(main).mesh, jax.devices()[:2])
    run = run_lib.build(scone_config(main, source, **settings), workdir, mesh)
    try:
        model, optimizer = nnx.merge(run.spec.graphdef, run.state)
        model.fgram_model.gate[...] = jnp.asarray(0.5, jnp.float32)
        out_proj = np.asarray(model.fgram_model.out_proj.kernel[...])
        run.save(1, nnx.split((model, optimizer))[1])
        run.checkpointer.wait()
        vocab = run.vocab
    finally:
        run.close()
    bundle_dir, hf_dir = str(tmp_path / "bundle"), str(tmp_path / "hf")
    export.export(workdir, bundle_dir, dtype="float32", chunk_rows=64, batch_rows=512)
    table = serving_run.ram_table(bundle_dir).gather(np.arange(vocab.num_fgrams))
    from scone_jax.hf.safetensors import SafetensorsFile
    embed = SafetensorsFile(os.path.join(main, "model.safetensors")).read("model.embed_tokens.weight", ())
    picks = [0, 1, 2, 50, 100, vocab.num_fgrams - 1]
    for i in picks:
        n = int(vocab.lengths[i])
        tokens = torch.from_numpy(vocab.tokens[i:i + 1, :n].astype(np.int64))
        with torch.no_grad():
            h = reference.model(input_ids=tokens).last_hidden_state[0, n - 1].numpy()
        want = 0.5 * embed[vocab.tokens[i, n - 1]] + 0.5 * (h @ out_proj)
        np.testing.assert_allclose(table[i], want, rtol=1e-4, atol=1e-5, err_msg=f"row {i}")
    hf_export.export_hf(workdir, hf_dir, dtype="float32", batch_rows=512)
    np.testing.assert_array_equal(load_file(os.path.join(hf_dir, "fgram_table.safetensors"))["rows"], table)

    moved = str(tmp_path / "moved")
    shutil.copytree(source, moved)
    resumed = run_lib.build(scone_config(main, moved, **settings), workdir, mesh)
    try:
        assert resumed.step == 1 and float(resumed.model().fgram_model.gate[...]) == 0.5
    finally:
        resumed.close()
    with pytest.raises(checkpoint_lib.CheckpointMismatchError, match="scone.source_model"):
        run_lib.build(scone_config(main, "", **settings), workdir, mesh)


def test_a_gpt2_sources_count_holds_only_the_k_positions_the_fgram_model_uses():
    """A GPT-2 source (d 64, 3 blocks, MLP 96, 64 learned positions, 320 rows) under a main model of width 48,
    own token table, K = 4, counted by hand from GPT-2's layout: each block ln_1 2d, c_attn d x 3d + 3d, c_proj
    d x d + d, ln_2 2d, c_fc d x 96 + 96, mlp c_proj 96 x d + d = 29,344; ln_f 2d; the table 320 d; the first K of
    its 64 positions, K d; the out-projection 64 x 48 + 48 (GPT-2 has biases). scone.max_source_params at exactly
    that count accepts the source, one less refuses it. Config only (no weights): the fast tier's. Caught: the
    whole 64-row position table counted (so max_source_params refused a source that fits; issue 64's surviving
    mutant)."""
    from scone_jax.config import base_config
    from scone_jax.hf import families

    hf = json.loads(hf_models.tiny_config("gpt2", n_embd=64, n_layer=3, n_inner=96).to_json_string())
    family = families.of_config(hf, "config.json")
    model = family.model_keys(hf, "config.json")
    assert (model["d_model"], model["num_layers"], model["d_ff"], model["max_seq_len"]) == (64, 3, 96, 64)
    d = 64
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 96 + 96) + (96 * d + d)
    assert block == 29_344
    want = 3 * block + 2 * d + hf_models.VOCAB * d + K * d + (d * 48 + 48)
    config = base_config()
    config.model.update(dict(d_model=48, num_heads=4, vocab_size=hf_models.VOCAB))
    config.scone.update(dict(enabled=True, gate=True, own_token_embedding=True, max_len=K, init_from_hf="/source"))
    assert fgram_source.source_params(family, model, config) == want == 112_016
    config.scone.max_source_params = want
    fgram_source.derive_architecture(config, family, model, "source/config.json")  # fits: accepted
    built_model = nnx.eval_shape(lambda: state_lib.build_model(config))  # the count is what the run builds
    assert sum(x.size for x in jax.tree.leaves(nnx.state(built_model.fgram_model, nnx.Param))) == want + 1  # + g
    config.scone.max_source_params = want - 1  # the derived sizes and architecture stay: derived again, the same
    with pytest.raises(HfCheckpointError, match=f"would have {want:,} parameters, more than "
                                                f"scone.max_source_params={want - 1:,}"):
        fgram_source.derive_architecture(config, family, model, "source/config.json")


def test_a_gpt2_source_loads_the_first_k_rows_of_its_positions_and_its_tables(checkpoints):
    """The fast tier's share of the [gpt2] parity case above (slow: it compiles the model): the f-gram model's
    parameters read from a GPT-2 source, without running it, against transformers' tensors: pos_embed is wpe's
    first K rows, the token table wte. Caught:
    fgram_source.placement leaving GPT-2's learned positions whole (wpe [64, d] against [K, d]: the load refuses
    the shape)."""
    main, source, reference = checkpoints("gpt2")
    config = scone_config(main, source)
    derive.apply(config)
    config_lib.validate(config)
    spec = state_lib.state_spec(config, sharding.make_mesh(config.mesh, jax.devices()[:1]))
    abstract = state_lib.abstract_with_shardings(spec)[0]["fgram_model"]  # what init_state hands the load
    params, _ = fgram_source.load(derive.open_checkpoint(source), abstract, K)
    flat = {path: np.asarray(v.get_value() if hasattr(v, "get_value") else v) for path, v in nnx.to_flat_state(params)}
    wte, wpe = (reference.transformer.wte.weight.detach().numpy(), reference.transformer.wpe.weight.detach().numpy())
    assert wpe.shape == (64, 64)
    np.testing.assert_array_equal(flat[("pos_embed", "embedding")], wpe[:K])
    np.testing.assert_array_equal(flat[("token_embed", "embedding")], wte)
