"""scone_jax.model.attention: every implementation that runs here against 'reference' (values and
gradients w.r.t. q, k, v), splash in Pallas's interpreter and compiled for a TPU topology with
libtpu, and the dispatcher's choices and errors.

The batch: 3 rows of T=300 (3 query chunks for 'xla', 3 splash blocks of 128 after padding to
384), N=2 heads of H=32. Row 0 holds 4 documents cut at random places and ends in padding
(segment 0); row 1 has 2 documents with a boundary exactly at the xla chunk / splash block edge
128, then padding; row 2 is all padding (the pipeline fills short batches with such rows).

Tolerances. fp32: 2e-5 absolute on values of size ~1-5 (the implementations differ only in
summation order). bf16: each implementation and the bf16 reference are compared with the fp32
oracle run on the same bf16-rounded inputs; bf16 keeps 8 significant bits, so a few roundings
of q, k, v, the probabilities and the output give errors of a few units in the last place of
the largest entries: atol = 2^-6 x max|oracle| (4 ulps at the top of the range). Every planted
bug listed below moves some entry by 0.1-3, so it is far outside both.

Planted bugs (each made by editing scone_jax/model/attention.py in a scratch copy and running
this file there; each made the test in brackets fail, and the unedited module passes):
  xla:    causal mask j <= i + 1 (off by one); segment mask dropped; chunk masks built without
          the chunk's offset; backward without delta; dk accumulated from the last chunk only
          [test_xla_matches_reference: errors 2.6-4.9 against atol 2e-5].
  cudnn:  mask=None (causal only) [test_cudnn_call_matches_reference: 3.3]; row lengths one
          short [test_cudnn_unpacked_call_matches_reference_on_documents: 0.43 against 0.05].
          (Lengths that count the trailing padding are harmless: causality hides it.)
  splash: q not scaled by 1/sqrt(H); SegmentIds not passed; output sliced from the wrong end of
          the padded sequence [test_splash_interpreted_matches_reference: 3.2-3.3]; segment ids
          replicated instead of split over rows in shard_map
          [test_splash_under_a_cpu_mesh_shards_rows_and_heads: vmap size error].
          (A pad sharing segment id 0 with the padding is harmless for the same reason.)
test_the_comparison_catches_planted_bugs runs three such bugs as variants of the reference
through the same bf16 comparison on every run.
"""
import functools
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from scone_jax.model import attention as A
from tests.common import REPO

B, T, N, H = 3, 300, 2, 32
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def segments() -> np.ndarray:
    seg = np.zeros((B, T), np.int32)
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(2, 280), 3, replace=False))
    seg[0, :285] = np.searchsorted(cuts, np.arange(285), side="right") + 1
    seg[1, :128], seg[1, 128:290] = 1, 2
    return seg  # row 2 stays all padding


def inputs(dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(key, (B, T, N, H), jnp.float32) for key in keys)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return q, k, v, jnp.asarray(segments()), w


def value_and_grads(fn, q, k, v, seg, w):
    """out and d(sum(out * w))/d(q, k, v), all as fp32 numpy."""
    def loss(q, k, v):
        out = fn(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) * w), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


NAMES = ("out", "dq", "dk", "dv")


@functools.lru_cache(maxsize=None)
def oracle_run(dtype):
    """The fp32 reference on `dtype`-rounded inputs (cached: shared by the tests)."""
    q, k, v, seg, w = inputs(dtype)
    return value_and_grads(A.reference_attention, *(x.astype(jnp.float32) for x in (q, k, v)), seg, w)


def assert_matches(fn, dtype, weights=None, oracle=None):
    """fn against the reference: values and gradients, fp32 tight, bf16 as the module docstring
    says. `weights` [B, T] restricts the comparison (and the loss) to some positions."""
    q, k, v, seg, w = inputs(dtype)
    if weights is not None:
        w = w * weights[:, :, None, None]
    got = value_and_grads(fn, q, k, v, seg, w)
    if oracle is None and weights is None:
        want = oracle_run(dtype)
    else:
        want = value_and_grads(oracle or A.reference_attention, *(x.astype(jnp.float32) for x in (q, k, v)), seg, w)
    keep = np.ones((B, T, 1, 1), np.float32) if weights is None else np.asarray(weights)[:, :, None, None]
    for name, g, r in zip(NAMES, got, want):
        err = float(np.max(np.abs((g - r) * keep)))
        atol = 2e-5 if dtype == jnp.float32 else 2.0**-6 * float(np.max(np.abs(r)))
        assert err <= atol, f"{name}: max abs error {err:.3g} > {atol:.3g} ({jnp.dtype(dtype).name})"


DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])


def test_the_bf16_reference_fits_the_bf16_tolerance():
    """The tolerance is fair: today's bf16 code (the reference on bf16 inputs) meets it too."""
    assert_matches(A.reference_attention, jnp.bfloat16)


@DTYPES
def test_xla_matches_reference(dtype):
    """Catches an off-by-one causal mask, a dropped segment mask, chunk masks that forget the
    chunk's offset, and backward-pass slips (delta omitted, dk summed over too few keys)."""
    assert [c for c in A.xla_chunks(T)] == [(0, 128), (128, 256), (256, 300)]
    assert_matches(A.xla_attention, dtype)


@DTYPES
def test_cudnn_call_matches_reference(dtype):
    """The exact jax.nn.dot_product_attention call the 'cudnn' path makes (causal + same-segment
    mask), run through that API's XLA implementation, since there is no GPU here. Catches a
    dropped or mis-shaped segment mask."""
    assert_matches(lambda *a: A.cudnn_attention(*a, _implementation="xla"), dtype)


def test_cudnn_unpacked_call_matches_reference_on_documents():
    """packed=False (row lengths instead of a mask) agrees wherever its promise holds: with every
    document after a row's first one turned into padding, each row is one document then padding;
    compared at real tokens (its padding outputs are zeros). Catches lengths that count padding."""
    first_only = lambda fn: lambda q, k, v, s: fn(q, k, v, jnp.where(s > 1, 0, s))  # noqa: E731
    weights = jnp.asarray(segments() == 1, jnp.float32)
    assert_matches(first_only(lambda *a: A.cudnn_attention(*a, packed=False, _implementation="xla")),
                   jnp.bfloat16, weights=weights, oracle=first_only(A.reference_attention))


@DTYPES
def test_splash_interpreted_matches_reference(dtype):
    """The TPU kernel in Pallas's interpreter on CPU (T=300 padded to 384, blocks of 128): catches
    an unscaled q and a pad that shares the padding's segment id 0."""
    assert A.splash_block_sizes(T) == (384, 128)
    assert_matches(lambda *a: A.splash_attention(*a, interpret=True), dtype)


def test_splash_under_a_cpu_mesh_shards_rows_and_heads():
    """splash_attention's shard_map under jax.set_mesh of the 8 CPU devices (data 2, fsdp 2,
    tensor 2; 4 rows, 2 heads): values and gradients still match the reference. Catches specs
    that put heads or rows on the wrong mesh axes."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    q, k, v, seg, w = inputs(jnp.float32)
    q, k, v, w = (jnp.concatenate([x, x[:1]])[:, :128] for x in (q, k, v, w))
    seg = jnp.concatenate([seg, seg[:1]])[:, :128]
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, rows) for x in (q, k, v, seg, w)]
        got = value_and_grads(lambda *a: A.splash_attention(*a, interpret=True), *args)
    want = value_and_grads(A.reference_attention, q, k, v, seg, w)
    for name, g, r in zip(NAMES, got, want):
        np.testing.assert_allclose(g, r, atol=2e-5, err_msg=name)


def test_the_comparison_catches_planted_bugs():
    """The bf16 comparison of assert_matches rejects reference variants with planted bugs."""
    def variant(causal_offset=0, segments=True, scale=1.0):
        def fn(q, k, v, seg):
            s = jnp.einsum("bqnh,bknh->bnqk", q, k).astype(jnp.float32) * scale / math.sqrt(H)
            pos = jnp.arange(T)
            mask = (pos[:, None] + causal_offset >= pos[None, :])[None]
            if segments:
                mask = mask & (seg[:, :, None] == seg[:, None, :])
            s = jnp.where(mask[:, None], s, -1e30)
            return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, -1).astype(v.dtype), v)
        return fn
    for bug in (dict(causal_offset=1), dict(segments=False), dict(scale=math.sqrt(H))):
        with pytest.raises(AssertionError):
            assert_matches(variant(**bug), jnp.bfloat16)
    assert_matches(variant(), jnp.bfloat16)  # and the unplanted variant passes


# ----------------------------------------------------------------------------- grouped-query attention

GQA_HEADS = 4  # query heads; key/value heads 1 (multi-query), 2 (groups of two), 4 (multi-head)


def gqa_inputs(kv_heads):
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (B, T, GQA_HEADS, H), jnp.float32)
    k, v = (jax.random.normal(key, (B, T, kv_heads, H), jnp.float32) for key in keys[1:3])
    w = jax.random.normal(keys[3], (B, T, GQA_HEADS, H), jnp.float32)
    return q, k, v, jnp.asarray(segments()), w


def gqa_formula(q, k, v, seg):
    """Grouped-query attention from its definition, written here: query head n uses key/value head
    n // (N / K) (Hugging Face's repeat_kv copies each k/v head to its group's query heads); query i sees
    key j iff j <= i in the same segment; softmax(q . k / sqrt(H)) v, in fp32."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    t = q.shape[1]
    allowed = np.tril(np.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])  # [B, Tq, Tk]
    scores = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), k) / math.sqrt(q.shape[-1])
    probs = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", probs, v)


GQA_PATHS = {
    "reference": A.reference_attention,
    "xla": A.xla_attention,
    "cudnn": lambda *a: A.cudnn_attention(*a, _implementation="xla"),
    "splash": lambda *a: A.splash_attention(*a, interpret=True),
    "dispatch": lambda *a: A.attention(*a, implementation="auto"),
}


@pytest.mark.parametrize("kv_heads", [1, 2, GQA_HEADS])
@pytest.mark.parametrize("path", sorted(GQA_PATHS))
def test_grouped_query_attention_matches_the_formula(path, kv_heads):
    """Every path with 4 query heads over 1, 2 or 4 key/value heads, values and gradients (dk, dv summed
    over each group) against gqa_formula, fp32, atol 2e-5. Deliberate bugs, each seen to fail here: the
    grouping as n % K instead of n // (N / K) (attention.grouped reshaping to [.., G, K, H]; reference,
    xla and dispatch at K=2, the only case where the orders differ), xla's dk summed from the first
    group member only (xla, every K), and splash fed k, v tiled to N heads (jnp.tile: the n % K order)
    instead of its native grouping (K=2)."""
    q, k, v, seg, w = gqa_inputs(kv_heads)
    got = value_and_grads(GQA_PATHS[path], q, k, v, seg, w)
    want = value_and_grads(gqa_formula, q, k, v, seg, w)
    assert got[2].shape == (B, T, kv_heads, H)
    for name, g, r in zip(NAMES, got, want):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_cached_attention_groups_query_heads_over_the_cache(kv_heads):
    """The decode step over a cache of K heads (slots beyond start + i unwritten noise) against the
    formula on the written prefix: queries 5..7 of one document at slots 5..7. Caught: the n % K grouping
    (K=2)."""
    q, k, v, _, _ = gqa_inputs(kv_heads)
    q, k, v = q[:1, :16], k[:1, :16], v[:1, :16]
    got = A.cached_attention(q[:, 5:8], k, v, jnp.int32(5))
    want = gqa_formula(q[:, :8], k[:, :8], v[:, :8], jnp.ones((1, 8), jnp.int32))[:, 5:8]
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_splash_under_a_cpu_mesh_shards_key_value_heads():
    """GQA (4 query heads over 2 key/value heads) under a (data 2, fsdp 2, tensor 2) CPU mesh: each device
    holds one key/value head and its query group; values and gradients match the formula. Caught: q's
    heads split over 'tensor' while k, v stay whole (a device's query pair read the wrong k/v head)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    q, k, v, seg, w = gqa_inputs(2)
    q, k, v, w = (jnp.concatenate([x, x[:1]])[:, :128] for x in (q, k, v, w))
    seg = jnp.concatenate([seg, seg[:1]])[:, :128]
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, rows) for x in (q, k, v, seg, w)]
        got = value_and_grads(lambda *a: A.splash_attention(*a, interpret=True), *args)
    want = value_and_grads(gqa_formula, q, k, v, seg, w)
    for name, g, r in zip(NAMES, got, want):
        np.testing.assert_allclose(g, r, atol=2e-5, err_msg=name)


def test_key_value_heads_must_divide_the_query_heads():
    q, k, v, seg, _ = gqa_inputs(2)
    with pytest.raises(ValueError, match=r"k and v \[B, T, K, H\] with K dividing N"):
        A.attention(q[:, :, :3], k, v, seg)


# ----------------------------------------------------------------------------- dispatch


def test_unknown_and_unavailable_implementations_are_clear_errors():
    q, k, v, seg, _ = inputs(jnp.float32)
    valid = "valid: auto, reference, xla, cudnn, splash"
    with pytest.raises(ValueError, match=f"Unknown model.attention='flash'; {valid}"):
        A.attention(q, k, v, seg, implementation="flash")
    with pytest.raises(ValueError, match="'splash' is not available on cpu; valid there: auto, reference, xla"):
        A.attention(q, k, v, seg, implementation="splash")
    with pytest.raises(ValueError, match="'cudnn' is not available on cpu"):
        A.attention(q, k, v, seg, implementation="cudnn")
    with pytest.raises(ValueError, match="'splash' is not available on gpu; valid there: auto, reference, xla, cudnn"):
        A.attention(q, k, v, seg, implementation="splash", platform="gpu")
    with pytest.raises(ValueError, match="cuDNN attention takes bfloat16/float16 inputs"):
        A.attention(q, k, v, seg, implementation="cudnn", platform="gpu")
    with pytest.raises(ValueError, match="segment_ids"):
        A.attention(q, k, v, seg[:, :10])
    assert A.IMPLEMENTATIONS == ("auto", "reference", "xla", "cudnn", "splash")


def test_auto_picks_by_platform_and_logs_a_gpu_fallback_once(caplog):
    q, k, v, seg = (x[:, :32] for x in inputs(jnp.float32)[:4])
    assert A.compile_platform() == "cpu"
    with jax.set_mesh(Mesh(np.array(jax.devices()[:2]), ("data",))):
        assert A.compile_platform() == "cpu"
    np.testing.assert_array_equal(A.attention(q, k, v, seg), A.xla_attention(q, k, v, seg))
    A._logged.clear()
    with caplog.at_level(logging.INFO):
        for _ in range(2):  # fp32 on a GPU: cuDNN cannot, 'xla' runs, one log line says why
            np.testing.assert_array_equal(A.attention(q, k, v, seg, platform="gpu"), A.xla_attention(q, k, v, seg))
    assert caplog.text.count("attention 'auto' on GPU uses 'xla', not 'cudnn': cuDNN attention takes bfloat16") == 1
    bf16 = q.astype(jnp.bfloat16)
    assert A.cudnn_unsupported_reason(bf16) is None
    assert "even sequence length" in A.cudnn_unsupported_reason(bf16[:, :31])
    assert A.cudnn_unsupported_reason(bf16[:, :31], packed=False) is None
    assert "head dim that is a multiple of 8" in A.cudnn_unsupported_reason(bf16[..., :20])


@pytest.fixture(scope="module")
def tpu_compiled():
    """What tests/tpu_attention_probe.py's programs, compiled for a v5e 2x2 slice, hold: in a process of its
    own, so that libtpu never loads into this test session (see that module's docstring)."""
    if not HAVE_LIBTPU:
        pytest.skip("libtpu not installed (pip install -e '.[aot]')")
    done = subprocess.run([sys.executable, "-m", "tests.tpu_attention_probe"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # compiles a train step for TPU in a process of its own
@pytest.mark.parametrize("case", ["auto-1024-bf16", "auto-300-fp32"])
def test_splash_train_step_compiles_for_tpu_without_square_buffers(tpu_compiled, case):
    """'auto' under a TPU mesh (on this CPU host) picks splash: the compiled program calls the
    Mosaic kernel and has no [.., T, T] buffer (T=300 runs padded to 384)."""
    assert tpu_compiled[case] == {"tpu_custom_call": True, "square_buffers": []}


@pytest.mark.slow  # reads the same TPU compile (tpu_compiled)
@pytest.mark.parametrize("case", ["gqa-auto-512-bf16", "mqa-auto-512-bf16"])
def test_grouped_query_splash_train_step_compiles_for_tpu(tpu_compiled, case):
    """4 query heads over 2 key/value heads (one per 'tensor' shard with its query pair) and over 1 (heads
    replicated): the splash kernel takes the grouped k, v as they are, forward and backward, no [T, T]."""
    assert tpu_compiled[case] == {"tpu_custom_call": True, "square_buffers": []}


@pytest.mark.slow  # reads the same TPU compile (tpu_compiled)
def test_the_square_buffer_check_sees_the_reference(tpu_compiled):
    assert tpu_compiled["reference-256-bf16"]["tpu_custom_call"] is False
    assert "f32[2,2,256,256]" in tpu_compiled["reference-256-bf16"]["square_buffers"]  # 2 local rows x 2 local heads
