"""The production model and optimizer against tests/method_reference.py, a plain-numpy reading of docs/method.md.

Every other model test compares two of our own paths (naive vs deduplicated, scanned vs loop, export vs
training graph), so a deviation they share passes them all. Here the same parameters go into an
implementation that shares no code with scone_jax/model/, with its own longest-match search.
Bugs each test was seen to catch when injected into production code:
  - the f-gram model without its position embeddings (FgramModel.all_positions skipping pos_embed):
    loss differences of ~1e-1; and permuted f-grams getting the same embedding (test below);
  - T(token) added to the f-gram embedding instead of replaced by it (SconeModel.input_embeddings);
  - model.embedding_multiplier applied to the f-gram rows too, or to T inside the f-gram model;
  - scone.input_multiplier applied after the f-gram model's position embeddings, or to the f-gram rows;
  - scone.output_norm=False leaving the f-gram model's final norm in place, or dropping the decoder's too;
  - weight decay on norms and biases of scanned blocks (the old rank >= 2 mask), on embeddings, or on none.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax import sharding
from scone_jax.serving import export
from scone_jax.training import optimizer, state as state_lib, steps
from tests import method_reference as ref
from tests.common import small_config
from tests.scone_batches import K, device_arrays, planted_grams, production_batch

GPT2 = {}
OLMO = dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, tie_embeddings=False)


def scone_config(main, scan_layers=True, **scone):
    config = small_config(scan_layers=scan_layers, **main)
    config.scone.update(dict(enabled=True, max_len=K, fgram_capacity=48, num_layers=2) | scone)
    return config


def perturbed_model(config, seed=0):
    """The production model with every parameter moved off its initial value (norm scales off 1, biases
    off 0), so a parameter the computation ignores changes the loss."""
    model = state_lib.build_model(config)
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(tree, noisy))
    return model


def _blocks(stack: dict, num_layers: int) -> list:
    blocks = stack["blocks"]
    if 0 in blocks:  # unscanned: one dict per layer
        return [blocks[i] for i in range(num_layers)]
    return [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(num_layers)]  # scanned: [layers, ...]


def reference_params(model, config) -> dict:
    """The production parameters as the reference reads them (numpy float64, one dict per block)."""
    pure = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    dec, fg = pure["decoder"], pure["fgram_model"]
    out = {"token_embed": dec["token_embed"]["embedding"], "blocks": _blocks(dec["stack"], config.model.num_layers),
           "final_norm": dec["stack"]["final_norm"]}
    if "pos_embed" in dec:
        out["pos_embed"] = dec["pos_embed"]["embedding"]
    if "head" in dec:
        out["head"] = dec["head"]["kernel"]
    out["fgram"] = {"pos_embed": fg["pos_embed"]["embedding"], "blocks": _blocks(fg["stack"], config.scone.num_layers)}
    if "final_norm" in fg["stack"]:  # absent without scone.output_norm
        out["fgram"]["final_norm"] = fg["stack"]["final_norm"]
    for name in ("in_proj", "out_proj", "gate"):
        if name in fg:
            out["fgram"][name] = fg[name]
    return out


def arch_of(config) -> dict:
    m = config.model
    return {"num_heads": m.num_heads, "fgram_num_heads": config.scone.num_heads or m.num_heads, "norm": m.norm,
            "mlp": m.mlp, "rope": m.position == "rope", "rope_theta": m.rope_theta}


@pytest.mark.parametrize("main,scone,scan_layers", [
    (GPT2, {}, True),
    pytest.param(GPT2, {"d_model": 32, "num_heads": 2, "d_ff": 48}, False, marks=pytest.mark.slow),  # width projections
    (OLMO, {}, True),
    (OLMO, {"num_layers": 1}, False),
], ids=["gpt2", "gpt2-narrow-fgram-unscanned", "olmo", "olmo-unscanned"])
def test_production_losses_equal_the_method_reference(main, scone, scan_layers):
    config = scone_config(main, scan_layers, **scone)
    model = perturbed_model(config)
    batch, _ = production_batch(num_shards=2, capacity=48)
    got = np.asarray(jax.jit(lambda g, s, b: steps.token_losses(nnx.merge(g, s), b))(
        *nnx.split(model), device_arrays(batch)))
    want = ref.token_losses(reference_params(model, config), batch, arch_of(config), planted_grams(), K)
    matched = batch.fgram_ids >= 0
    assert matched.mean() > 0.2 and (~matched & (batch.loss_mask > 0)).any()  # both kinds of position
    assert len(np.unique(batch.segment_ids[0])) >= 3  # several documents in a row
    assert (want > 0).mean() > 0.5
    # fp32 against float64: a loss sums ~log(vocab) terms through a few d=64 layers; 1e-5 relative is
    # ~30 fp32 ulps, while the bugs in the module docstring move losses by >= 1e-2.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fgram_model_tells_permutations_apart():
    """Two f-grams with the same tokens in another order and the same last token get different
    embeddings: only the f-gram model's own position embeddings (§4) can tell them apart, since
    attention over a set of tokens is order-blind without them."""
    config = scone_config(GPT2, num_layers=1)
    model = perturbed_model(config)
    tokens = jnp.array([[301, 302, 303, 0], [302, 301, 303, 0]], jnp.int32)
    lengths = jnp.array([3, 3], jnp.int32)
    emb = np.asarray(model.fgram_embeddings(tokens, lengths))
    assert np.abs(emb[0] - emb[1]).max() > 1e-2
    params = reference_params(model, config)
    for row in range(2):
        np.testing.assert_allclose(emb[row], ref.fgram_embedding(tuple(np.asarray(tokens[row, :3])), params,
                                                                 arch_of(config)), rtol=1e-5, atol=1e-5)


def test_the_output_gain_experiment_scales_the_method_embedding_and_is_not_decayed():
    """scone.output_gain_init (an experiment on the f-gram rows' scale, docs/quality.md; off by default) multiplies the
    method's f-gram embedding by one learned scalar, which weight decay leaves alone like a norm scale."""
    config = scone_config(GPT2, num_layers=1, output_gain_init=0.25)
    model = perturbed_model(config)
    gain = float(model.fgram_model.output_gain[...])
    assert abs(gain - 0.25) < 0.5 and gain != 0.25  # started at 0.25, moved like every parameter
    tokens = jnp.array([[301, 302, 303, 0]], jnp.int32)
    emb = np.asarray(model.fgram_embeddings(tokens, jnp.array([3], jnp.int32)))
    want = gain * ref.fgram_embedding((301, 302, 303), reference_params(model, config), arch_of(config))
    np.testing.assert_allclose(emb[0], want, rtol=1e-5, atol=1e-6)
    assert "['fgram_model']['output_gain']" not in decayed_names(config)
    assert decayed_names(config) == decayed_names(scone_config(GPT2, num_layers=1))


def losses_with_and_without(config, arch_extra: dict):
    """(production losses, reference losses with `arch_extra`, reference losses without it, params) on the
    test batch: a control must match the reference that applies it, and must change the losses at all."""
    model = perturbed_model(config)
    batch, _ = production_batch(num_shards=2, capacity=48)
    got = np.asarray(jax.jit(lambda g, s, b: steps.token_losses(nnx.merge(g, s), b))(
        *nnx.split(model), device_arrays(batch)))
    params = reference_params(model, config)
    want = ref.token_losses(params, batch, arch_of(config) | arch_extra, planted_grams(), K)
    plain = ref.token_losses(params, batch, arch_of(config), planted_grams(), K)
    return model, got, want, plain, params


def test_the_embedding_multiplier_control_scales_only_the_token_inputs():
    """model.embedding_multiplier (a control of docs/quality.md; 1 in the method) multiplies T(token) where
    it is the decoder's input, and nothing else: not the f-gram rows, not the f-gram model's input T, not
    the tied output head. Against the reference, which scales only its token inputs."""
    config = scone_config(GPT2)
    config.model.embedding_multiplier = 4.0
    _, got, want, plain, _ = losses_with_and_without(config, {"embedding_multiplier": 4.0})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - plain).max() > 1e-2  # the multiplier changes the losses the test compares


def test_the_fgram_input_multiplier_experiment_scales_only_the_fgram_models_token_inputs():
    """scone.input_multiplier (an experiment of docs/quality.md; 1 in the method) multiplies T(t_i) where it is the
    f-gram model's input, before its position embeddings, and nothing else: not the decoder's token inputs, not
    the f-gram rows. Against the reference, which scales only T inside its f-gram embedding."""
    config = scone_config(GPT2)
    config.scone.input_multiplier = 4.0
    extra = {"fgram_input_multiplier": 4.0}
    model, got, want, plain, params = losses_with_and_without(config, extra)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - plain).max() > 1e-2  # the multiplier changes the losses the test compares
    # The export's path (SconeModel.fgram_embeddings, the table's rows) scales the same way.
    emb = np.asarray(model.fgram_embeddings(jnp.array([[301, 302, 303, 0]], jnp.int32), jnp.array([3], jnp.int32)))
    np.testing.assert_allclose(emb[0], ref.fgram_embedding((301, 302, 303), params, arch_of(config) | extra),
                               rtol=1e-5, atol=1e-5)


def test_the_output_norm_experiment_drops_only_the_fgram_models_final_norm():
    """scone.output_norm=False (an experiment of docs/quality.md; on in the method) makes the f-gram embedding the
    f-gram model's last residual stream, without its final norm; the decoder keeps its own. Against the reference,
    which skips only the f-gram model's norm, in the training losses and in the export's rows."""
    config = scone_config(GPT2, output_norm=False)
    model = perturbed_model(config)
    assert model.fgram_model.stack.final_norm is None and model.decoder.stack.final_norm is not None
    batch, _ = production_batch(num_shards=2, capacity=48)
    got = np.asarray(jax.jit(lambda g, s, b: steps.token_losses(nnx.merge(g, s), b))(
        *nnx.split(model), device_arrays(batch)))
    params = reference_params(model, config)
    arch = arch_of(config) | {"fgram_output_norm": False}
    np.testing.assert_allclose(got, ref.token_losses(params, batch, arch, planted_grams(), K), rtol=1e-5, atol=1e-5)
    gram = (301, 302, 303)
    emb = np.asarray(model.fgram_embeddings(jnp.array([[*gram, 0]], jnp.int32), jnp.array([3], jnp.int32)))[0]
    np.testing.assert_allclose(emb, ref.fgram_embedding(gram, params, arch), rtol=1e-5, atol=1e-5)
    # The rows differ from the normed ones: a unit LayerNorm on the same residual stream moves them.
    unit = {"scale": np.ones(emb.shape), "bias": np.zeros(emb.shape)}
    normed = ref.fgram_embedding(gram, params | {"fgram": params["fgram"] | {"final_norm": unit}}, arch_of(config))
    assert np.abs(normed - emb).max() > 1e-1


def test_the_gate_mixes_token_and_fgram_inputs_and_the_export_bakes_it_into_the_table():
    """scone.gate (docs/training.md; off in the method): the decoder's input at a matched position is
    (1 - g) T(token) + g f, T(token) its own input there (model.embedding_multiplier included) and g one learned
    scalar that starts at 0. Against the reference (ref.matched_input) in the training losses at g = 0.3, at
    g = 0 (the baseline's: no f-gram reaches the decoder) and at g = 1 (the method's), and in the export's table
    rows, which are what the decoder receives, so serving's replacement stays exact. Caught: the gate as a
    multiplier on f added to T (T + g f); g starting at 1; the export's rows without the gate (f alone, or
    mixed with T without the embedding multiplier)."""
    config = scone_config(GPT2, gate=True)
    config.model.embedding_multiplier = 2.0
    arch = arch_of(config) | {"embedding_multiplier": 2.0}
    assert float(state_lib.build_model(config).fgram_model.gate[...]) == 0.0
    model = perturbed_model(config)
    batch, vocab = production_batch(num_shards=2, capacity=48)
    losses = jax.jit(lambda g, s, b: steps.token_losses(nnx.merge(g, s), b))
    mesh = sharding.make_mesh(config.mesh)
    rows = 8 * -(-vocab.num_fgrams // 8)  # whole rows per device
    for g in (0.3, 0.0, 1.0):
        model.fgram_model.gate[...] = jnp.asarray(g, jnp.float32)
        got = np.asarray(losses(*nnx.split(model), device_arrays(batch)))
        params = reference_params(model, config)
        want = ref.token_losses(params, batch, arch, planted_grams(), K)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        plain = {**params, "fgram": {k: v for k, v in params["fgram"].items() if k != "gate"}}
        if g == 0.0:
            np.testing.assert_allclose(want, ref.token_losses(params, batch, arch, (), K), rtol=1e-9, atol=1e-9)
        elif g == 1.0:
            np.testing.assert_allclose(want, ref.token_losses(plain, batch, arch, planted_grams(), K), rtol=1e-9,
                                       atol=1e-9)
        else:
            assert np.abs(want - ref.token_losses(plain, batch, arch, planted_grams(), K)).max() > 1e-2
            assert np.abs(want - ref.token_losses(params, batch, arch, (), K)).max() > 1e-2
            table = np.asarray(export.embed_fn(model, mesh, "float32")(*export.batch_inputs(vocab, 0, rows, mesh)))
            for i in range(vocab.num_fgrams):
                gram = tuple(int(t) for t in vocab.tokens[i, : vocab.lengths[i]])
                np.testing.assert_allclose(table[i], ref.matched_input(gram, params, arch), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 17 s on 2 cores: the fast tier keeps the gate's case of matched_inputs
def test_the_additive_control_keeps_the_token_input_and_a_zero_projection_starts_as_the_plain_decoder():
    """scone.combine='add' (docs/training.md; 'replace' in the method): the decoder's input at a matched position is
    T(token) + f, T(token) its own input there (model.embedding_multiplier included). Against the reference
    (ref.matched_input) in the training losses and in the export's table rows (an f-gram model of another width, so
    through its projection). With scone.output_projection_init='zeros' the projection starts at 0, so at step 0 the
    losses are the plain decoder's and no gradient reaches the f-gram model's blocks, while the projection's is not
    zero (it learns from step 1); at equal widths the setting makes that projection. Caught: matched positions
    replaced by T(token) + f without the embedding multiplier; the export's rows without the token's input (f
    alone); the zero init ignored (out_proj at init_std), or no projection made at equal widths."""
    narrow = dict(combine="add", d_model=32, num_heads=2, d_ff=48)
    config = scone_config(GPT2, **narrow)
    config.model.embedding_multiplier = 2.0
    arch = arch_of(config) | {"embedding_multiplier": 2.0, "combine": "add"}
    model = perturbed_model(config)
    batch, vocab = production_batch(num_shards=2, capacity=48)
    losses = jax.jit(lambda g, s, b: steps.token_losses(nnx.merge(g, s), b))
    got = np.asarray(losses(*nnx.split(model), device_arrays(batch)))
    params = reference_params(model, config)
    want = ref.token_losses(params, batch, arch, planted_grams(), K)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - ref.token_losses(params, batch, arch | {"combine": "replace"}, planted_grams(), K)).max() > 1e-2
    mesh = sharding.make_mesh(config.mesh)
    rows = 8 * -(-vocab.num_fgrams // 8)  # whole rows per device
    table = np.asarray(export.embed_fn(model, mesh, "float32")(*export.batch_inputs(vocab, 0, rows, mesh)))
    for i in range(vocab.num_fgrams):
        gram = tuple(int(t) for t in vocab.tokens[i, : vocab.lengths[i]])
        np.testing.assert_allclose(table[i], ref.matched_input(gram, params, arch), rtol=1e-5, atol=1e-5)

    config = scone_config(GPT2, combine="add", output_projection_init="zeros")  # at the main width: a d x d P
    model = state_lib.build_model(config)
    assert not np.asarray(model.fgram_model.out_proj.kernel[...]).any()
    params = reference_params(model, config)
    got = np.asarray(losses(*nnx.split(model), device_arrays(batch)))
    plain = ref.token_losses(params, batch, arch_of(config), (), K)  # no f-gram reaches the decoder
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    graphdef, weights, rest = nnx.split(model, nnx.Param, ...)
    device = device_arrays(batch)
    grads = jax.grad(lambda w: steps.token_losses(nnx.merge(graphdef, w, rest), device).sum())(weights)
    fgram = nnx.to_pure_dict(grads)["fgram_model"]
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(fgram["stack"])), "the blocks learn from f = 0"
    assert np.abs(np.asarray(fgram["out_proj"]["kernel"])).max() > 1e-4


@pytest.mark.parametrize("combine", ["replace", "add"])
def test_token_rms_rows_enter_at_the_token_inputs_scale(combine):
    """scone.row_scale='token_rms' (docs/training.md; 'raw' in the method): each f-gram embedding is rescaled to the
    RMS of the token input it meets (T(token) x model.embedding_multiplier) before it replaces or joins it. Against
    the reference in the training losses and the export's table rows, whose RMS under replacement is the token
    input's. Caught: the RMS taken of T without the embedding multiplier; the rescaling left out of the export's
    rows (training and serving then differ)."""
    config = scone_config(GPT2, row_scale="token_rms", combine=combine)
    config.model.embedding_multiplier = 3.0
    arch = arch_of(config) | {"embedding_multiplier": 3.0, "row_scale": "token_rms", "combine": combine}
    model = perturbed_model(config)
    batch, vocab = production_batch(num_shards=2, capacity=48)
    got = np.asarray(jax.jit(lambda g, s, b: steps.token_losses(nnx.merge(g, s), b))(*nnx.split(model),
                                                                                     device_arrays(batch)))
    params = reference_params(model, config)
    want = ref.token_losses(params, batch, arch, planted_grams(), K)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - ref.token_losses(params, batch, arch | {"row_scale": "raw"}, planted_grams(), K)).max() > 1e-2
    mesh = sharding.make_mesh(config.mesh)
    rows = 8 * -(-vocab.num_fgrams // 8)
    table = np.asarray(export.embed_fn(model, mesh, "float32")(*export.batch_inputs(vocab, 0, rows, mesh)))
    for i in range(vocab.num_fgrams):
        gram = tuple(int(t) for t in vocab.tokens[i, : vocab.lengths[i]])
        np.testing.assert_allclose(table[i], ref.matched_input(gram, params, arch), rtol=1e-5, atol=1e-5)
        if combine == "replace":
            token = params["token_embed"][gram[-1]] * 3.0
            assert np.sqrt(np.mean(table[i] ** 2)) == pytest.approx(np.sqrt(np.mean(token ** 2)), rel=1e-4)


@pytest.mark.slow  # 10-13 s: the fast tier stays under 5 minutes
def test_the_output_ramp_moves_matched_inputs_from_the_token_to_the_fgram_row_by_the_step():
    """scone.output_ramp_steps=W (docs/training.md; off in the method): the input at a matched position is
    (1 - r) T(token) + r f, r = min(1, step / W) set by the production train step (r of the update made from
    optimizer step s is (s + 1) / W), kept in the model's state and baked into the export's rows. Against the
    reference at the r the train step left after 1, 2 and 5 updates (W = 4: 1/4, 1/2, 1), in the losses and the
    table rows. Caught: r from the optimizer's step without the + 1 (0 at the first update: no gradient reaches the
    f-gram model); r not clipped at 1; the ramp left out of the export's rows; r counted as a trained parameter."""
    config = scone_config(GPT2, output_ramp_steps=4)
    config.model.embedding_multiplier = 2.0
    t = config.train
    t.warmup_steps, t.num_steps = 1, 8
    arch = arch_of(config) | {"embedding_multiplier": 2.0}
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    model = perturbed_model(config)
    assert float(model.fgram_model.ramp[...]) == 0.0
    assert "ramp" not in nnx.to_pure_dict(nnx.state(model, nnx.Param))["fgram_model"]
    opt = nnx.Optimizer(model, optimizer.make_optimizer(config), wrt=nnx.Param)
    state = jax.device_put(nnx.state((model, opt)), spec.shardings)
    host, vocab = production_batch(num_shards=sharding.num_batch_shards(mesh), capacity=48)
    train = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    losses = jax.jit(lambda g, s, b: steps.token_losses(nnx.merge(g, s), b))
    rows = 8 * -(-vocab.num_fgrams // 8)
    for done, r in ((1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0), (5, 1.0)):
        state, _ = train(state, sharding.global_batch(jax.tree.map(np.asarray, host), mesh))
        trained = state_lib.model_of(spec.graphdef, state)
        assert float(trained.fgram_model.ramp[...]) == pytest.approx(r), done
        if done not in (1, 2, 5):
            continue
        params = reference_params(trained, config)
        want = ref.token_losses(params, host, arch | {"ramp": r}, planted_grams(), K)
        got = np.asarray(losses(*nnx.split(trained), device_arrays(host)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        table = np.asarray(export.embed_fn(trained, mesh, "float32")(*export.batch_inputs(vocab, 0, rows, mesh)))
        for i in range(0, vocab.num_fgrams, 7):
            gram = tuple(int(t) for t in vocab.tokens[i, : vocab.lengths[i]])
            np.testing.assert_allclose(table[i], ref.matched_input(gram, params, arch | {"ramp": r}), rtol=1e-5,
                                       atol=1e-5)


# --- AdamW -----------------------------------------------------------------------------------------------

def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x, np.float64) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _layer_free(path: str) -> str:
    """A parameter's name without the layer index of unscanned blocks or the `.value` attribute."""
    return path.replace(".value", "").replace("['blocks'][0]", "['blocks']").replace("['blocks'][1]", "['blocks']")


def decayed_names(config) -> list:
    model = nnx.eval_shape(lambda: state_lib.build_model(config))
    mask = optimizer.decay_mask(nnx.state(model, nnx.Param), config.train.weight_decay)
    return sorted({_layer_free(jax.tree_util.keystr(p)) for p, on in jax.tree_util.tree_leaves_with_path(mask) if on})


def _names(prefix, modules):
    return [f"{prefix}{m}['kernel']" for m in modules]


ATTN = ["['attn']['key']", "['attn']['out']", "['attn']['query']", "['attn']['value']"]
GELU_MLP = ["['mlp']['down']", "['mlp']['up']"]
SWIGLU_MLP = ["['mlp']['down']", "['mlp']['gate']", "['mlp']['up']"]


@pytest.mark.parametrize("scan_layers", [True, False])
def test_weight_decay_covers_exactly_the_weight_matrices(scan_layers):
    """The decayed parameters, by name, for each model kind and both layouts (model/roles.py): every
    Linear kernel, never an embedding table, a norm scale or a bias."""
    gpt2 = scone_config(GPT2, scan_layers)
    assert decayed_names(gpt2) == sorted(
        _names("['decoder']['stack']['blocks']", ATTN + GELU_MLP)
        + _names("['fgram_model']['stack']['blocks']", ATTN + GELU_MLP))
    narrow = scone_config(GPT2, scan_layers, d_model=32, num_heads=2)
    assert set(decayed_names(narrow)) - set(decayed_names(gpt2)) == {
        "['fgram_model']['in_proj']['kernel']", "['fgram_model']['out_proj']['kernel']"}
    olmo = scone_config(OLMO, scan_layers)
    assert decayed_names(olmo) == sorted(
        ["['decoder']['head']['kernel']"]
        + _names("['decoder']['stack']['blocks']", ATTN + SWIGLU_MLP)
        + _names("['fgram_model']['stack']['blocks']", ATTN + SWIGLU_MLP))
    baseline = small_config(scan_layers=scan_layers)
    assert decayed_names(baseline) == sorted(_names("['stack']['blocks']", ATTN + GELU_MLP))


def test_a_model_without_weight_matrices_is_refused_when_decay_is_on():
    params = {"token_embed": {"embedding": jnp.zeros((4, 2))}, "norm": {"scale": jnp.ones((3, 2))}}
    with pytest.raises(ValueError, match="no parameter is a weight matrix.*weight_decay=0"):
        optimizer.decay_mask(params, 0.1)
    assert not any(jax.tree.leaves(optimizer.decay_mask(params, 0.0)))


@pytest.mark.slow  # a whole train step of both models against the reference: ~30 s each
@pytest.mark.parametrize("main,scan_layers,delay,multiplier,fgram_factor", [
    (GPT2, True, 0, 1.0, 1.0), (GPT2, True, 0, 3.0, 3.0), (OLMO, False, 3, 0.5, 0.5 / 3)],
    ids=["gpt2", "gpt2-fgram-lr-x3", "olmo-unscanned-fgram-delay-lr-x0.5"])
def test_train_step_equals_a_hand_written_adamw_step(main, scan_layers, delay, multiplier, fgram_factor):
    """The production train step (mean-loss gradients, clipping, warmup-cosine schedule, moments, decay
    mask) from a state after 3 steps with non-zero moments equals ref.adamw_step on the same gradients:
    step 4. The f-gram model's update is scone.learning_rate_multiplier times its AdamW update, and with
    train.fgram_model_delay_steps = 3 also 1/3 (step 4 = D + 1 of the ramp). Seen to catch: the factor on
    the decoder too; the ramp starting at 0 instead of after the delay; the ramp one step late (optax's count
    taken for the step: 0 at step 4); the multiplier on the whole model, or left out of the delayed schedule."""
    config = scone_config(main, scan_layers, learning_rate_multiplier=multiplier)
    t = config.train
    t.weight_decay, t.grad_clip_norm, t.warmup_steps, t.num_steps = 0.5, 0.05, 2, 6  # clipping active
    t.fgram_model_delay_steps = delay
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    model = perturbed_model(config)
    count, rng = 3, np.random.default_rng(0)
    params0 = _flat(nnx.state(model, nnx.Param))
    mu0 = {k: rng.normal(0, 1e-3, v.shape) for k, v in params0.items()}
    nu0 = {k: rng.uniform(0, 1e-5, v.shape) for k, v in params0.items()}

    opt = nnx.Optimizer(model, optimizer.make_optimizer(config), wrt=nnx.Param)
    state = nnx.state((model, opt))

    def seeded(path, x):
        key = jax.tree_util.keystr(path)
        for name, values in (("['mu']", mu0), ("['nu']", nu0)):
            if name in key:
                return jnp.asarray(values[key.split(name, 1)[1]], x.dtype)
        return jnp.full_like(x, count) if key.endswith("['count'].value") or key == "[1]['step'].value" else x

    state = jax.tree_util.tree_map_with_path(seeded, state)
    batch = device_arrays(production_batch(num_shards=sharding.num_batch_shards(mesh), capacity=48)[0])

    grads = _flat(nnx.grad(lambda m: steps.token_losses(m, batch).sum() / batch.loss_mask.sum())(model))
    state = jax.device_put(state, spec.shardings)
    new_state, metrics = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)(
        state, sharding.global_batch(jax.tree.map(np.asarray, batch), mesh))
    got = _flat(nnx.state(state_lib.model_of(spec.graphdef, new_state), nnx.Param))

    decayed = {k for k in params0 if k.endswith("['kernel'].value")}  # the weight matrices, by the test's own rule
    hp = {"lr": t.learning_rate, "warmup": t.warmup_steps, "total": t.num_steps, "min_ratio": t.min_lr_ratio,
          "b1": t.b1, "b2": t.b2, "eps": t.eps, "weight_decay": t.weight_decay, "clip": t.grad_clip_norm,
          "fgram_delay": delay, "fgram_lr_multiplier": multiplier}
    assert multiplier * ref.delayed_factor(count + 1, delay) == pytest.approx(fgram_factor)
    want, _, _, lr, grad_norm = ref.adamw_step(params0, grads, mu0, nu0, count, decayed, hp)
    assert grad_norm > 2 * t.grad_clip_norm  # the clip is exercised
    assert abs(float(metrics["learning_rate"]) - lr) < 1e-9 and 0 < lr < t.learning_rate
    np.testing.assert_allclose(float(metrics["grad_norm"]), grad_norm, rtol=1e-4)
    fgram_norm = np.sqrt(sum((g * g).sum() for name, g in grads.items() if name.startswith("['fgram_model']")))
    assert 0 < fgram_norm < grad_norm
    np.testing.assert_allclose(float(metrics["fgram/model_grad_norm"]), fgram_norm, rtol=1e-4)
    for name in params0:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
        moved = np.abs(want[name] - params0[name]).max()
        assert moved > 1e-6, name
