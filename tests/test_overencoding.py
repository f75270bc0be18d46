"""Over-Encoding (docs/method.md §8): the host's n-gram ids and the model's input against a plain reference of the
paper's formula (tests/overencoding_reference.py), its parameters' roles and FLOPs, and its config's refusals.

Bugs each test was seen to catch when injected into production code (the docstrings repeat them):
  - the ids' sums in int32 (the arithmetic a GPU kernel might use): wrong ids once V^r x reaches 2^31;
  - Horner's scheme in the wrong order (the newest token weighted V^(i-1), the paper's oldest);
  - n-grams reaching across a document boundary of a packed row (segment ids not compared);
  - the mean over k(n-1) terms instead of 1 + k(n-1); each table's offset one row off; the embedding multiplier
    on T(token) alone;
  - the n-gram tables counted as matmul parameters in the FLOPs (dropped from model/roles.py's EMBEDDING_MODULES);
  - (issue 64) only m checked for coprimality with V, not every table's m + 2s; the projection initialised with
    std 1/sqrt(d) instead of 1/sqrt(width).
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax import config as config_lib
from scone_jax.data.ngram_hash import NgramHasher, ngram_ids
from scone_jax.model import accounting, overencoding, scone
from scone_jax.training import assets, optimizer, run as run_lib, state as state_lib
from tests import method_reference, overencoding_reference as ref
from tests.common import small_config
from tests.scone_batches import host_batch


def oe_config(n=3, k=2, m=1001, **model):
    config = small_config(**model)
    with config.unlocked():
        config.overencoding.update(dict(enabled=True, n=n, k=k, m=m))
    return config


def test_ids_equal_the_paper_formula_in_python_integers():
    """Packed rows of several documents and padding, orders 2..5, a large V and moduli near 2^31: every id equals
    1 + (sum_r x[t-r] V^r) mod M_s in Python's unbounded integers, 0 where the n-gram would leave its row or
    document. Caught: int32 sums (wrong ids from x V^r >= 2^31 on); Horner's scheme in the wrong order (newest
    token weighted V^(i-1)); segment ids not compared (n-grams across documents)."""
    batch = host_batch()
    vocab = 150_001  # x V^r passes 2^31 at r = 1 for tokens above 14,316
    tokens = np.where(batch.segment_ids > 0, batch.inputs * 397 % vocab, 0).astype(np.int32)
    tables = ref.layout(5, 2, 2**31 - 101)
    got = ngram_ids(tokens, batch.segment_ids, tables, vocab)
    want = np.stack([ref.row_ids(tokens[r], batch.segment_ids[r], tables, vocab) for r in range(len(tokens))])
    assert got.dtype == np.int32 and got.shape == (*tokens.shape, 8)
    np.testing.assert_array_equal(got, want)
    assert (want[..., -1] > 0).mean() > 0.3 and (want[..., 0] == 0).any()  # both kinds of position
    assert len(np.unique(batch.segment_ids[0])) >= 3  # several documents (and padding) in a row
    assert (want > 2**30).any()  # ids far beyond int16, near the int32 limit


def test_generated_tokens_get_the_ids_of_the_whole_sequence():
    """NgramHasher.next_ids, fed one token at a time from the last n-1 tokens, gives each new token the id the whole
    sequence has at its position (what generation with a KV cache relies on)."""
    rng = np.random.default_rng(0)
    hasher = NgramHasher(ref.layout(4, 3, 997), 512)
    tokens = rng.integers(0, 512, (3, 20)).astype(np.int32)
    whole = hasher.ids(tokens)
    history = tokens[:, :5]
    np.testing.assert_array_equal(hasher.ids(history), whole[:, :5])
    for t in range(5, 20):
        ids, history = hasher.next_ids(history, tokens[:, t])
        np.testing.assert_array_equal(ids, whole[:, t])
    assert history.shape == (3, 3)


def test_a_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"Token id 512 is outside \[0, 512\) \(model.vocab_size\)"):
        ngram_ids(np.array([[1, 512]]), None, ref.layout(2, 1, 7), 512)


def test_tables_layout_and_size():
    """k(n-1) tables, order-major, moduli m + 2s; one array of every table's M_s + 1 rows padded to 128, of width
    d / (k(n-1)): about m x d parameters, as the key's doc says."""
    config = oe_config(n=3, k=2, m=1001)
    assert overencoding.tables(config.overencoding) == [(2, 1001), (2, 1003), (3, 1005), (3, 1007)]
    assert overencoding.tables(config.overencoding) == ref.layout(3, 2, 1001)
    params = nnx.state(nnx.eval_shape(lambda: state_lib.build_model(config)), nnx.Param)
    assert params["overencoding"]["ngram_tables"]["embedding"].shape == (4096, 16)  # 4,020 rows, padded
    assert params["overencoding"]["projection"]["kernel"].shape == (64, 64)
    assert abs(4020 * 16 - 1001 * 64) / (1001 * 64) < 0.01


def reference_tables(model, config):
    """The production tables and projection as the reference reads them: table s is rows offset_s .. offset_s + M_s
    of the one array (offsets from the moduli alone), P_s the s-th block of `width` rows of the projection."""
    layout = ref.layout(config.overencoding.n, config.overencoding.k, config.overencoding.m)
    big = np.asarray(model.overencoding.ngram_tables.embedding[...], np.float64)
    kernel = np.asarray(model.overencoding.projection.kernel[...], np.float64)
    width = config.model.d_model // len(layout)
    offsets = np.cumsum([0] + [modulus + 1 for _, modulus in layout])
    tables = [big[offsets[s]: offsets[s] + modulus + 1] for s, (_, modulus) in enumerate(layout)]
    projections = [kernel[s * width:(s + 1) * width] for s in range(len(layout))]
    return layout, tables, projections


@pytest.mark.parametrize("multiplier", [1.0, 3.0])
def test_inputs_and_losses_equal_the_reference(multiplier):
    """The decoder's input (the mean of T(token) and the projected table rows, times model.embedding_multiplier)
    and the token losses through the whole model equal the plain reference of the paper's formula, on a packed
    batch with the perturbed production parameters. Caught: dividing by k(n-1) instead of 1 + k(n-1); each
    table's offset one row off; the multiplier on T(token) alone (multiplier 3)."""
    from tests.test_method_reference import perturbed_model

    config = oe_config(n=3, k=2, m=1001, embedding_multiplier=multiplier)
    model = perturbed_model(config)
    batch = assets.ngram_hasher(config)(host_batch())
    layout, tables, projections = reference_tables(model, config)
    token_table = np.asarray(model.token_embed.embedding[...], np.float64)
    got = np.asarray(jax.jit(lambda g, s, b: scone.input_embeddings(nnx.merge(g, s), b))(
        *nnx.split(model), jax.tree.map(jnp.asarray, batch.for_device())))
    for r in range(4):
        cols = np.flatnonzero(batch.segment_ids[r] > 0)
        want = ref.input_rows(batch.ngram_ids[r, cols], batch.inputs[r, cols], token_table, tables, projections,
                              multiplier)
        np.testing.assert_allclose(got[r, cols], want, rtol=1e-5, atol=1e-6)

    params = reference_params_of_decoder(model, config)

    def inputs(r, cols):
        ids = ref.row_ids(batch.inputs[r], batch.segment_ids[r], layout, config.model.vocab_size)[cols]
        return ref.input_rows(ids, batch.inputs[r, cols], token_table, tables, projections, multiplier)

    arch = {"num_heads": 4, "norm": "layernorm", "mlp": "gelu", "rope": False, "rope_theta": 0.0}
    want = method_reference.token_losses(params, batch, arch, input_rows=inputs)
    losses = np.asarray(jax.jit(lambda g, s, b: scone.token_losses(nnx.merge(g, s), b))(
        *nnx.split(model), jax.tree.map(jnp.asarray, batch.for_device())))
    assert (want > 0).mean() > 0.5
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-5)


def reference_params_of_decoder(model, config) -> dict:
    """A plain decoder's parameters as tests/method_reference.py reads them (numpy float64, one dict per block)."""
    from tests.test_method_reference import _blocks

    pure = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {"token_embed": pure["token_embed"]["embedding"], "pos_embed": pure["pos_embed"]["embedding"],
            "blocks": _blocks(pure["stack"], config.model.num_layers), "final_norm": pure["stack"]["final_norm"]}


def test_a_decoder_and_a_batch_of_the_other_kind_are_refused():
    """An Over-Encoding decoder without the batch's n-gram ids, or n-gram ids for a plain decoder, would silently run
    another model than the one trained: both refused."""
    config = oe_config()
    model = state_lib.build_model(config)
    batch = host_batch()
    with pytest.raises(ValueError, match="carries no ngram_ids"):
        scone.input_embeddings(model, batch)
    plain = state_lib.build_model(small_config())
    with pytest.raises(ValueError, match="has no n-gram tables"):
        scone.input_embeddings(plain, assets.ngram_hasher(config)(batch))


def decayed_names(config) -> list:
    model = nnx.eval_shape(lambda: state_lib.build_model(config))
    mask = optimizer.decay_mask(nnx.state(model, nnx.Param), config.train.weight_decay)
    return sorted(jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(mask) if v)


def test_the_tables_are_embeddings_and_the_projection_a_decayed_matrix_counted_in_the_flops():
    """The tables are embeddings (no weight decay, like T; counted as embedding parameters); the projection is a
    weight matrix (decayed like every Linear kernel) whose 2 d^2 FLOPs per token inference counts. Caught: the
    tables dropped from model/roles.py's EMBEDDING_MODULES (counted as matmul parameters: 6 x 65,536 FLOPs per
    token that no matmul does)."""
    config = oe_config()
    decayed = decayed_names(config)
    assert "['overencoding']['projection']['kernel'].value" in decayed
    assert not [name for name in decayed if "ngram_tables" in name]
    model = nnx.state(nnx.eval_shape(lambda: state_lib.build_model(config)), nnx.Param)
    plain = nnx.state(nnx.eval_shape(lambda: state_lib.build_model(small_config())), nnx.Param)
    with_oe, without = accounting.param_counts(model), accounting.param_counts(plain)
    assert with_oe["embedding"] - without["embedding"] == 4096 * 16
    assert with_oe["non_embedding"] - without["non_embedding"] == 64 * 64
    per_token = [accounting.decoder_flops_per_token(config.model, 32, c["non_embedding"]) for c in (with_oe, without)]
    assert per_token[0] - per_token[1] == 6 * 64 * 64  # training; a third of it (2 d^2) at inference
    assert accounting.param_bytes(model) - accounting.param_bytes(plain) == 4 * (4096 * 16 + 64 * 64)


@pytest.mark.parametrize("settings,message", [
    ({"scone.enabled": True}, "overencoding.enabled and scone.enabled are both set"),
    ({"overencoding.n": 1}, "overencoding.n=1 is not valid: it must be >= 2"),
    ({"overencoding.k": 0}, "overencoding.k=0 is not valid: it must be >= 1"),
    ({"overencoding.m": 1000}, "overencoding.m=1000 gives table 0 the modulus m + 2*0 = 1,000, which shares the "
                                "factor 8 with model.vocab_size=512"),
    ({"overencoding.m": 1000, "model.vocab_size": 0}, "overencoding.m=1000 is even, and model.vocab_size"),
    ({"overencoding.k": 3}, "model.d_model=64 does not split into the k(n-1) = 3 x 2 = 6 tables"),
    ({"overencoding.m": 2**31 - 3}, "gives moduli up to 2,147,483,651, beyond the int32 ids"),
    ({"model.init_from_hf": "/ckpt"}, "a Hugging Face checkpoint has no n-gram tables"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    """Each refusal names the key and the fix (main.py turns it into one line and exit 2 before anything is written:
    tests/test_overencoding_serving.py runs one). Caught: m checked against the tokenizer's size only after it
    loads (an even m with model.vocab_size 0 passed validation)."""
    config = oe_config()
    with config.unlocked():
        for key, value in settings.items():
            section, name = key.split(".")
            config[section][name] = value
    with pytest.raises(ValueError) as raised:
        config_lib.validate(config)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    if "coprime" in str(raised.value) and "e.g. overencoding.m=" in str(raised.value):
        fix = int(str(raised.value).rsplit("overencoding.m=", 1)[1].rstrip("."))
        assert all(math.gcd(fix + 2 * s, config.model.vocab_size or 128) == 1 for s in range(4))


def oldest_token_collisions(n, k, m, vocab, table):
    """Groups of oldest tokens whose term x V^(n-1) mod M is the same in table `table` (so an order-n n-gram's id
    cannot tell them apart), in Python integers from docs/method.md §8's formula: none where M is coprime with V
    and V <= M (the term is then one-to-one), some where they share a factor."""
    modulus = m + 2 * table
    seen = {}
    for x in range(vocab):
        seen.setdefault(x * vocab ** (n - 1) % modulus, []).append(x)
    return [group for group in seen.values() if len(group) > 1]


@pytest.mark.parametrize("vocab,modulus,factor", [(32_000, 100_005, 5), (50_304, 100_005, 3)])
def test_every_tables_modulus_must_be_coprime_with_the_vocabulary(vocab, modulus, factor):
    """n = 3, k = 4, m = 100,001: m is coprime with V = 32,000 and with 50,304, but tables 2 and 7 (moduli 100,005
    and 100,015) share 5 with 32,000, and tables 2 and 5 share 3 with 50,304: in them an n-gram's oldest tokens x and
    x + M/g always collide. Refused in one line naming the modulus; the 8 moduli m, m + 2, ... cover every residue
    of 3, 5 and 7, so no m avoids it and the fix is a vocabulary size, checked here to work. With k = 2 (4 tables)
    an m exists and is suggested; near the int32 limit, the nearest m that fits (from below where none above
    does). Caught: the live bug of issue 64, only m checked against V (both passed); the suggestion's search
    stopping short of the largest m that fits."""
    assert oldest_token_collisions(3, 4, 100_001, vocab, table=2)  # the reason: real collisions
    assert not oldest_token_collisions(3, 4, 100_001, vocab, table=0)
    config = oe_config(n=3, k=4, m=100_001)  # d_model 64: 8 tables of width 8
    with config.unlocked():
        config.model.vocab_size = vocab
    with pytest.raises(ValueError) as raised:
        config_lib.validate(config)
    message = str(raised.value)
    assert f"modulus m + 2*2 = {modulus:,}, which shares the factor {factor} with model.vocab_size={vocab}" in message
    assert "\n" not in message and "No m avoids it" in message
    new_vocab, new_m = (int(x) for x in re.search(r"model.vocab_size=(\d+) with overencoding.m=(\d+)\.$",
                                                  message).groups())
    assert new_vocab >= vocab and new_vocab % 128 == 0
    with config.unlocked():
        config.model.vocab_size, config.overencoding.m = new_vocab, new_m
    config_lib.validate(config)
    assert all(math.gcd(m, new_vocab) == 1 for _, m in overencoding.tables(config.overencoding))

    config = oe_config(n=3, k=2, m=100_001)
    with config.unlocked():
        config.model.vocab_size = 32_000
    with pytest.raises(ValueError, match=r"modulus m \+ 2\*2 = 100,005, which shares the factor 5 .* e\.g\. "
                                         r"overencoding\.m=100007\.$"):
        config_lib.validate(config)
    with config.unlocked():
        config.overencoding.m = 100_007
    config_lib.validate(config)

    top = 2**31 - 1  # the largest int32 id: m = 2^31 - 4 and 2^31 - 2 fit, share 2 with V; m + 2 = 2^31 - 1 fits too
    config = oe_config(n=2, k=2, m=top - 3)
    with pytest.raises(ValueError, match=rf"e\.g\. overencoding\.m={top - 2}\.$"):
        config_lib.validate(config)
    assert overencoding.coprime_m(top - 1, 2, 128) == top - 2  # m + 2 past the int32 ids: the largest that fits
    assert overencoding.coprime_m(top - 2, 2, 5 * 128) == top - 6  # top - 2 and top - 4 give a multiple of 5: below


def test_a_resume_that_changes_n_k_or_m_is_refused_naming_the_key(tmp_path, tokenizer_path):
    """The tables' layout and the ids' meaning follow n, k and m (STATE keys): a resume with another value of any
    is refused naming it, before anything in the workdir changes; the same settings resume."""
    config = oe_config()
    with config.unlocked():
        config.data.tokenizer_path = tokenizer_path
    workdir = str(tmp_path / "run")
    run_lib.save_initial_state(config, workdir, 1)
    from scone_jax.training import checkpoint

    ckpt = checkpoint.Checkpointer(f"{workdir}/checkpoints")
    try:
        newest = (1, ckpt.read_checkpoint_meta(1))
        identity = newest[1]["train_data"]
        run_lib.check_resume(ckpt, newest, config, (), identity)  # the same settings: accepted
        for key, value in (("n", 4), ("k", 1), ("m", 1003)):
            changed = config.copy_and_resolve_references()
            changed.overencoding[key] = value
            with pytest.raises(checkpoint.CheckpointMismatchError, match=f"overencoding.{key}: "):
                run_lib.check_resume(ckpt, newest, changed, (), identity)
    finally:
        ckpt.close()
    plain = small_config()  # a run without the tables ignores their settings, as one without SCONE ignores scone.*
    changed = plain.copy_and_resolve_references()
    changed.overencoding.m = 1003
    assert config_lib.resume_changes(plain.to_dict(), changed) == []


def test_the_projection_starts_at_std_one_over_sqrt_width_and_the_tables_at_init_std():
    """docs/method.md §8: the projection N(0, 1/sqrt(width)), width = d / k(n-1), so a projected row starts at a
    token row's scale; the tables N(0, model.init_std). d 256 over 8 tables (width 32): 1/sqrt(32) = 0.177 against
    1/sqrt(d) = 0.0625; 65,536 draws measure a std to about 0.3%, the test allows 3%. Caught: the projection
    initialised with 1/sqrt(d) (issue 64's surviving mutant)."""
    config = oe_config(n=3, k=4, m=1001, d_model=256, num_heads=4, init_std=0.02)
    oe = overencoding.OverEncoding(config.model, config.overencoding, nnx.Rngs(0))
    kernel = np.asarray(oe.projection.kernel[...], np.float64)
    assert kernel.shape == (256, 256)
    assert kernel.std() == pytest.approx(1 / math.sqrt(32), rel=0.03) and abs(kernel.mean()) < 0.01
    tables = np.asarray(oe.ngram_tables.embedding[...], np.float64)
    assert tables.shape[1] == 32 and tables.std() == pytest.approx(0.02, rel=0.03)
