"""Engram (docs/method.md §9): the host's ids, one layer's gate, convolution and residual update, where the decoder
runs it, and cached decoding against a plain reference of the paper's formulas (tests/engram_reference.py); its
parameters' roles, FLOPs and bytes, and its config's refusals.

Bugs each test was seen to catch when injected into production code (the docstrings repeat them):
  - the products in int32 (what a GPU kernel might use): wrong ids once x m passes 2^31;
  - the XOR replaced by a sum; the multipliers paired with the tokens newest-last instead of newest-first;
  - n-grams reaching across a document boundary of a packed row (segment ids not compared);
  - the gate without its 1/sqrt(d); the gate from the raw hidden state (no RMSNorm); the convolution's taps
    j apart instead of j x dilation; the convolution reaching into the previous document; the residual v~ dropped
    from Y; the Engram run after its block instead of before;
  - cached decoding not writing a step's RMSNorm(v~) into the cache (the next tokens' taps read zeros);
  - the tables dropped from model/roles.py's EMBEDDING_MODULES (counted as matmul parameters, weight-decayed).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax import config as config_lib
from scone_jax.batch import Batch
from scone_jax.data import engram_hash
from scone_jax.data.engram_hash import EngramHasher
from scone_jax.model import accounting, engram, scone, transformer
from scone_jax.training import assets, optimizer, state as state_lib
from tests import engram_reference as ref
from tests.common import small_config
from tests.scone_batches import host_batch

TINY = dict(enabled=True, layers="1", n=3, heads=2, head_width=8, rows=101, compress_tokens=False)


def engram_config(**settings):
    config = small_config()
    with config.unlocked():
        config.engram.update({**TINY, **settings})
    return config


def test_ids_equal_the_paper_hash_in_python_integers():
    """Packed rows of several documents and padding, orders 2..4, a large V and moduli near 2^31: every id equals
    (x_t m_0 XOR x_{t-1} m_1 XOR ...) mod M in Python's unbounded integers, a token before the document PAD = V.
    Caught: int32 products (x m passes 2^31 for every token); a sum instead of the XOR; the multipliers paired
    newest-last; segment ids not compared (n-grams across documents)."""
    batch = host_batch()
    vocab = 150_001
    tokens = np.where(batch.segment_ids > 0, batch.inputs * 397 % vocab, 0).astype(np.int32)
    heads = [(order, m) for order, m in zip((2, 2, 3, 4), ref.moduli(2**31 - 200, 4))]
    mults = engram_hash.multipliers(7, 1, 4, vocab)
    got = engram_hash.engram_ids(tokens, batch.segment_ids, heads, mults, vocab)
    want = np.stack([ref.row_ids(tokens[r], batch.segment_ids[r], heads, mults, vocab) for r in range(len(tokens))])
    assert got.dtype == np.int32 and got.shape == (*tokens.shape, 4)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(batch.segment_ids[0])) >= 3 and (want > 2**30).any()


def test_tokenizer_compression_equals_the_papers_normaliser():
    """§2.2: tokens whose texts normalise alike share a canonical id (case, accents, NFKC forms, leading and repeated
    whitespace), control tokens and byte pieces keep their own, ids past the tokenizer's keep theirs; the hasher
    hashes the canonical ids. Caught: no lower case; accents kept (NFD without dropping the marks); every empty
    decoding (<s>, </s>, <unk> in SentencePiece) merged into one."""
    texts = ["", "", "The", " the", "the", "THE", "\u00e9t\u00e9", "ete", "\ufb01", "fi", "a  b", " a\tb ", "\ufffd", "  ",
             " ", "x"]
    spellings = ["<s>", "</s>", "The", "\u2581the", "the", "THE", "\u00e9t\u00e9", "ete", "\ufb01", "fi", "a  b",
                 "a\tb", "<0xE3>", "\u2581\u2581", "\u2581", "x"]
    got = engram_hash.compression(texts, spellings, 20)
    want = ref.canonical_ids(texts, spellings, 20)
    np.testing.assert_array_equal(got, want)
    assert want[:16] == [0, 1, 2, 2, 2, 2, 3, 3, 4, 4, 5, 5, 6, 7, 7, 8] and want[16:] == [9, 10, 11, 12]
    heads, mults = [(2, 101), (3, 103)], engram_hash.multipliers(0, 1, 3, 20)
    hasher = EngramHasher([heads], [mults], 20, got)
    tokens = np.array([[2, 3, 4, 6, 8, 16, 0, 5]])
    np.testing.assert_array_equal(hasher.ids(tokens)[0],
                                  ref.row_ids(np.asarray(want)[tokens[0]], np.ones(8, int), heads, mults, 20))


def test_multipliers_are_odd_bounded_and_pinned():
    """Odd, at most (2^63 - 1) / (V + 1) (so x m never overflows int64), different per layer and seed, and pinned:
    an exported model's ids must not change with a library update (they come from SHA-256, not a random stream)."""
    vocab = 50_000
    mults = engram_hash.multipliers(0, 1, 3, vocab)
    assert all(m % 2 == 1 and 0 < m <= (2**63 - 1) // (vocab + 1) for m in mults)
    assert len({*mults, *engram_hash.multipliers(0, 2, 3, vocab), *engram_hash.multipliers(1, 1, 3, vocab)}) == 9
    assert engram_hash.multipliers(0, 1, 1, 512) == [engram_hash.multipliers(0, 1, 3, 512)[0]]
    assert engram_hash.multipliers(0, 1, 2, 512) == [9923283430183077, 4694023145926361]


def test_heads_are_distinct_primes_from_rows_on():
    """Per layer, (n-1) x heads heads, order-major, each a prime >= engram.rows used once over all layers."""
    config = engram_config(layers="0,1", rows=100)
    layer_heads = engram.heads(config.engram)
    assert layer_heads == [[(2, 101), (2, 103), (3, 107), (3, 109)], [(2, 113), (2, 127), (3, 131), (3, 137)]]
    assert [m for layer in layer_heads for _, m in layer] == ref.moduli(100, 8)
    params = nnx.state(nnx.eval_shape(lambda: state_lib.build_model(config)), nnx.Param)
    assert params["engram"][0]["engram_tables"]["embedding"].shape == (512, 8)  # 420 rows, padded to 128s


def test_generated_tokens_get_the_ids_of_the_whole_sequence():
    """EngramHasher.next_ids, fed one token at a time from the last n-1 tokens, gives each new token the id the whole
    sequence has at its position (what generation with a KV cache relies on), the first ones included."""
    config = engram_config(layers="0,1", n=4)
    hasher = assets.ngram_hasher(config)
    assert isinstance(hasher, EngramHasher)
    tokens = np.random.default_rng(0).integers(0, 512, (3, 20)).astype(np.int32)
    whole = hasher.ids(tokens)
    assert whole.shape == (3, 20, 12)
    history = tokens[:, :1]
    np.testing.assert_array_equal(hasher.ids(history), whole[:, :1])
    for t in range(1, 20):
        ids, history = hasher.next_ids(history, tokens[:, t])
        np.testing.assert_array_equal(ids, whole[:, t])
    assert history.shape == (3, 3)


def perturbed_layer(config, seed=0):
    """The decoder's Engram layer with every parameter random (the convolution and norm scales too)."""
    model = state_lib.build_model(config)
    module = model.engram[0]
    rng = np.random.default_rng(seed)
    for path, leaf in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        scale = 1.0 if "scale" in path else 0.5
        leaf[...] = jnp.asarray(rng.normal(1.0 if "scale" in path else 0.0, scale, leaf[...].shape), jnp.float32)
    return model, module


def reference_layer(module, config, h, ids, segments):
    """The reference's h + Y of one row with the first Engram layer's parameters: head s's table is rows
    offset .. offset + M_s of the one array, the offsets summed from the moduli alone."""
    big = np.asarray(module.engram_tables.embedding[...], np.float64)
    moduli = [m for _, m in engram.heads(config.engram)[0]]
    offsets = np.cumsum([0] + moduli)
    tables = [big[off: off + m] for off, m in zip(offsets, moduli)]
    scales = [np.asarray(n.scale[...], np.float64) for n in (module.hidden_norm, module.key_norm, module.conv_norm)]
    return ref.layer(h, ids, segments, tables, np.asarray(module.key.kernel[...], np.float64),
                     np.asarray(module.value.kernel[...], np.float64), scales,
                     np.asarray(module.conv_weights[...], np.float64), config.engram.dilation or config.engram.n,
                     config.model.norm_eps)


@pytest.mark.parametrize("kernel_size,dilation", [(4, 0), (3, 2)])
def test_one_layer_equals_the_reference(kernel_size, dilation):
    """h + Y of one Engram layer, with random tables, projections, norm scales and convolution, on packed rows of
    several documents, equals the float64 reference of §2.3. Caught: no 1/sqrt(d) in the gate; the gate from the raw
    hidden state; taps j apart instead of j x dilation (dilation 3 = n by default, and 2); taps into the previous
    document; the residual v~ dropped from Y."""
    config = engram_config(kernel_size=kernel_size, dilation=dilation)
    model, module = perturbed_layer(config)
    batch = assets.ngram_hasher(config)(host_batch())
    rng = np.random.default_rng(3)
    h = rng.normal(0, 1.0, (*batch.inputs.shape, config.model.d_model)).astype(np.float32)
    got = np.asarray(module(jnp.asarray(h), jnp.asarray(batch.ngram_ids), jnp.asarray(batch.segment_ids)))
    for r in range(3):
        want = reference_layer(module, config, h[r], batch.ngram_ids[r], batch.segment_ids[r])
        np.testing.assert_allclose(got[r], want, rtol=2e-4, atol=2e-4)
    v = np.asarray(module.gated_values(jnp.asarray(h), jnp.asarray(batch.ngram_ids)))
    assert np.abs(got - h - v).max() > 0.1  # the convolution contributes


def test_the_convolution_starts_at_zero_so_y_is_the_gated_value():
    """As the paper initialises it: the convolution's weights are 0, so at step 0 Y = SiLU(0) + v~ = v~ exactly; the
    table rows start at model.init_std, as T's (docs/method.md §9). Caught: rows at the demo's N(0, 1)."""
    config = engram_config()
    module = state_lib.build_model(config).engram[0]
    assert not np.asarray(module.conv_weights[...]).any()
    assert abs(float(np.std(module.engram_tables.embedding[...])) / config.model.init_std - 1) < 0.05
    batch = assets.ngram_hasher(config)(host_batch())
    h = jnp.asarray(np.random.default_rng(0).normal(0, 1, (*batch.inputs.shape, 64)), jnp.float32)
    ids = jnp.asarray(batch.ngram_ids)
    np.testing.assert_allclose(module(h, ids, jnp.asarray(batch.segment_ids)), h + module.gated_values(h, ids),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_decoder_runs_engram_before_its_block(scan_layers):
    """engram.layers=1: the decoder's hidden states are block 0, then h + Y of the reference, then block 1 and the
    final norm (scanned and unscanned stacks). Caught: the Engram run after its block."""
    config = engram_config()
    with config.unlocked():
        config.model.scan_layers = scan_layers
    model, module = perturbed_layer(config, seed=1)
    batch = jax.tree.map(jnp.asarray, assets.ngram_hasher(config)(host_batch()).for_device())
    got = np.asarray(scone.hidden_states(model, batch))
    x = scone.input_embeddings(model, batch)
    x = x + model.pos_embed(batch.positions)
    after0 = np.asarray(model.stack.blocks_between(x, batch.segment_ids, batch.positions, None, 0, 1))
    for r in range(2):
        y = reference_layer(module, config, after0[r], np.asarray(batch.ngram_ids[r]),
                            np.asarray(batch.segment_ids[r]))
        rest = model.stack.blocks_between(jnp.asarray(y[None], jnp.float32), batch.segment_ids[r:r + 1],
                                          batch.positions[r:r + 1], None, 1)
        np.testing.assert_allclose(got[r], np.asarray(model.stack.norm(rest))[0], rtol=2e-4, atol=2e-4)


def test_cached_decoding_equals_the_full_pass():
    """A prompt of 5 tokens, then one token at a time through the KV cache (its Engram buffers holding each
    position's RMSNorm(v~)), gives the full pass's logits, with a random convolution of reach 9. Caught: the step's
    RMSNorm(v~) not written into the cache (later taps read zeros)."""
    config = engram_config(layers="0,1")
    model, _ = perturbed_layer(config, seed=2)
    tokens = np.random.default_rng(4).integers(0, 512, (2, 16)).astype(np.int32)
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape)
    ids = assets.ngram_hasher(config).ids(tokens)
    full = np.asarray(scone.batch_logits(model, jax.tree.map(jnp.asarray, Batch(
        inputs=tokens, segment_ids=np.ones_like(tokens), positions=positions, ngram_ids=ids))))
    cache = transformer.init_cache(config.model, 2, 16, config.engram)
    assert len(cache.engram) == 2

    @jax.jit
    def step(graphdef, state, piece, cache):
        decoder = nnx.merge(graphdef, state)
        h, cache = scone.hidden_states(decoder, piece, cache)
        return decoder.logits(h), cache

    graphdef, state = nnx.split(model)
    steps, start = [], 0
    for end in [5, *range(6, 17)]:
        piece = Batch(inputs=tokens[:, start:end], positions=positions[:, start:end], ngram_ids=ids[:, start:end])
        logits, cache = step(graphdef, state, jax.tree.map(jnp.asarray, piece), cache)
        steps.append(np.asarray(logits))
        start = end
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


def test_no_position_reads_a_later_token():
    """The logits at positions 0..t do not change when every token after t does (ids from the host's hasher, then the
    decoder with Engram at both blocks and a random convolution of reach 9), and those after t do: Engram's memory
    and convolution read only the past. A direct check of what the references imply, made after Engram's first 10M
    run came out 50% below the baseline (docs/quality.md). Caught: the hasher's n-gram reading the next token
    (np.roll of the tokens by -1 before hashing); the convolution's taps shifted forward."""
    config = engram_config(layers="0,1")
    model, _ = perturbed_layer(config, seed=3)
    hasher = assets.ngram_hasher(config)
    tokens = np.random.default_rng(5).integers(0, 512, (1, 24)).astype(np.int32)
    positions = np.arange(24, dtype=np.int32)[None]

    def logits(t):
        batch = Batch(inputs=t, segment_ids=np.ones_like(t), positions=positions, ngram_ids=hasher.ids(t))
        return np.asarray(scone.batch_logits(model, jax.tree.map(jnp.asarray, batch)))[0]

    before = logits(tokens)
    for t in (0, 7, 15):
        changed = tokens.copy()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1 + np.arange(23 - t)) % 512
        after = logits(changed)
        np.testing.assert_array_equal(after[: t + 1], before[: t + 1], err_msg=f"positions 0..{t}")
        assert np.abs(after[t + 1:] - before[t + 1:]).max() > 1e-3


def test_a_decoder_and_a_batch_of_the_other_kind_are_refused():
    """An Engram decoder without the batch's ids, or given ids of another layout, would run another model."""
    config = engram_config()
    model = state_lib.build_model(config)
    batch = host_batch()
    with pytest.raises(ValueError, match="carries no ngram_ids"):
        scone.hidden_states(model, batch)
    other = assets.ngram_hasher(engram_config(heads=3))(batch)
    with pytest.raises(ValueError, match="the ids were made for another engram config"):
        scone.hidden_states(model, other)


def test_roles_flops_and_bytes():
    """The tables are embeddings (not decayed, not matmul FLOPs), W_K and W_V decayed matrices, the convolution and
    norms not decayed; inference FLOPs per token grow by W_K and W_V (2 x 2 d_mem d), the convolution (2 w d), the
    norms' scales (counted as parameters, as the blocks' are) and the gate's 3d; the accelerator holds everything.
    Caught: the tables dropped from EMBEDDING_MODULES (decayed, and 6 x 512 x 8 FLOPs too many)."""
    config = engram_config()
    model = nnx.eval_shape(lambda: state_lib.build_model(config))
    mask = optimizer.decay_mask(nnx.state(model, nnx.Param), config.train.weight_decay)
    decayed = sorted(jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(mask) if v)
    engram_decayed = [name for name in decayed if "engram" in name]
    assert engram_decayed == ["['engram'][0]['key']['kernel'].value", "['engram'][0]['value']['kernel'].value"]
    params = nnx.state(model, nnx.Param)
    plain = nnx.state(nnx.eval_shape(lambda: state_lib.build_model(small_config())), nnx.Param)
    with_engram, without = accounting.param_counts(params), accounting.param_counts(plain)
    d, memory = 64, 4 * 8
    assert with_engram["embedding"] - without["embedding"] == 512 * 8
    assert with_engram["non_embedding"] - without["non_embedding"] == 2 * memory * d + 4 * d + 3 * d
    flops = [accounting.decoder_flops_per_token(config.model, 32, c["non_embedding"], cfg)
             for c, cfg in ((with_engram, config.engram), (without, None))]
    assert flops[0] - flops[1] == 6 * (2 * memory * d + 4 * d + 3 * d) + 9 * d
    assert accounting.param_bytes(params) - accounting.param_bytes(plain) == 4 * (512 * 8 + 2 * memory * d + 7 * d)


@pytest.mark.parametrize("settings,message", [
    ({"scone.enabled": True}, "engram.enabled and scone.enabled are both set"),
    ({"overencoding.enabled": True}, "engram.enabled and overencoding.enabled are both set"),
    ({"engram.layers": "2"}, "engram.layers='2' is not an ascending list of distinct block indices in [0, 2)"),
    ({"engram.layers": "1,0"}, "engram.layers='1,0' is not an ascending list"),
    ({"engram.layers": "x"}, "engram.layers='x' is not an ascending list"),
    ({"engram.rows": 2**31 - 3}, "beyond the int32 ids"),
    ({"engram.n": 1}, "engram.n=1 is not valid: it must be >= 2"),
    ({"engram.head_width": 0}, "engram.head_width=0 is not valid: it must be >= 1"),
    ({"engram.kernel_size": 0}, "engram.kernel_size=0 is not valid: it must be >= 1"),
    ({"model.init_from_hf": "/ckpt"}, "a Hugging Face checkpoint has no Engram tables"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    """Each refusal names the key and the fix in one line (main.py: exit 2 before anything is written)."""
    config = engram_config()
    with config.unlocked():
        for key, value in settings.items():
            section, name = key.split(".")
            config[section][name] = value
    with pytest.raises(ValueError) as raised:
        config_lib.validate(config)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_resume_may_not_change_engrams_keys():
    """Every engram key defines the saved state: a resume that changes one is refused naming it; a run without
    Engram ignores them."""
    saved = engram_config().to_dict()
    config = engram_config(rows=211, layers="0")
    assert sorted(config_lib.resume_changes(saved, config)) == ["engram.layers: '1' -> '0'", "engram.rows: 101 -> 211"]
    plain = small_config()
    saved_plain = plain.to_dict()
    saved_plain["engram"]["rows"] = 5
    assert config_lib.resume_changes(saved_plain, plain) == []
