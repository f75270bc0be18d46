"""Causal self-attention within documents: one entry point, several implementations.

    attention(q, k, v, segment_ids, *, implementation="auto", platform=None, packed=True)

q, k, v are [B, T, N, H] in the compute dtype; segment_ids [B, T] int32 numbers the documents
of a row 1, 2, ... and marks padding with 0. Query i attends to key j iff j <= i and
segment_ids[i] == segment_ids[j]; logits are scaled by 1/sqrt(H); the result is [B, T, N, H] in
q.dtype. Padding attends among itself (every row keeps at least its diagonal), and its outputs
are masked out of the loss later.

Implementations (IMPLEMENTATIONS; which ones a platform has: PLATFORM_IMPLEMENTATIONS):
  reference  the plain formula: fp32 scores [B, N, T, T], mask, softmax. The test oracle.
  xla        pure-JAX flash attention: queries in at most 8 static chunks, each against the keys
             up to its end only (the causal upper triangle of whole chunks is never computed, 44%
             fewer score FLOPs at 8 chunks), online-softmax statistics saved instead of
             probabilities, and a custom VJP that recomputes each chunk's scores in the
             backward pass. Scores come from the inputs' dtype with fp32 accumulation
             (preferred_element_type), so no fp32 copy of q/k is made. The largest buffer is one
             chunk's scores [B, N, T/8, T] instead of [B, N, T, T]. It is the fallback everywhere
             (speed and memory against the others: docs/benchmarks.md, tools/bench_attention.py).
  cudnn      jax.nn.dot_product_attention(implementation='cudnn') (NVIDIA GPUs; bf16/fp16; head
             dim a multiple of 8 and <= 128, <= 256 on Hopper and later). jax 0.10's public API
             has no segment ids: it offers is_causal, per-row lengths (query_seq_lengths /
             key_value_seq_lengths: a valid prefix per row) and a boolean `mask` (or `bias`)
             that it turns into a dense additive bias [B, 1, T, T] in the compute dtype (and
             in jax 0.10 also computes that bias's unused gradient in the backward pass). So:
               packed=True  (rows may hold several documents; our data pipeline packs): causal
                            + mask=same-segment [B, 1, T, T]; costs 2 bytes x B x T^2 per call
                            (twice in the backward), still no fp32 [B, N, T, T]. cuDNN's bias
                            kernels in training need an even T.
               packed=False (the caller guarantees at most one document per row, padding only at
                            the end): causal + row lengths; no T^2 buffer at all. Outputs at
                            padding are zeros instead of padding-among-itself (masked anyway).
             Packed segment ids proper (cuDNN's THD layout with q_offsets) exist only in the
             private jax._src.cudnn API and need Hopper; not used.
  splash     the Pallas TPU splash-attention kernel (jax.experimental.pallas.ops.tpu), causal
             mask per head + SegmentIds, forward and backward kernels, fp32 accumulation and
             statistics; q is scaled by 1/sqrt(H) before it (the kernel does not scale).
             Mosaic kernels cannot be partitioned automatically, so under a mesh it runs inside
             jax.shard_map: rows over the mesh's ('data', 'fsdp') axes, heads over 'tensor'
             (each only where it divides), everything else replicated. Block sizes: see
             splash_block_sizes.
  auto       TPU -> splash; GPU -> cudnn when supported for the dtype, head dim and sequence
             length, else xla; CPU -> xla. A fallback is logged once with its reason.

The platform is the one the program is compiled for: the devices of the mesh set with
jax.set_mesh when there is one (compiling for a TPU topology on a CPU host gives TPU devices
while jax.default_backend() is 'cpu'), else jax.default_backend(); `platform=` overrides both.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging

IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "splash")
PLATFORM_IMPLEMENTATIONS = {
    "cpu": ("auto", "reference", "xla"),
    "gpu": ("auto", "reference", "xla", "cudnn"),
    "tpu": ("auto", "reference", "xla", "splash"),
}
BATCH_AXES = ("data", "fsdp")  # scone_jax.sharding's row axes
HEAD_AXIS = "tensor"  # scone_jax.sharding's head axis

_MASK_VALUE = -1e30  # finite: exp(_MASK_VALUE - max) == 0 without inf - inf
_MAX_XLA_CHUNKS = 8
_MIN_XLA_CHUNK = 128
_SPLASH_LANES = 128  # splash's blocks are multiples of the TPU lane width
_SPLASH_MAX_BLOCK = 512

_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logging.info("%s", message)


# ---------------------------------------------------------------------------------------------
# Dispatch


def check(implementation: str) -> None:
    """An unknown implementation name is a config error listing the valid ones."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"Unknown model.attention={implementation!r}; valid: {', '.join(IMPLEMENTATIONS)}.")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
              implementation: str = "auto", platform: str | None = None,
              packed: bool = True) -> jax.Array:
    """Causal attention within segments; see the module docstring for the choices."""
    check(implementation)
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape or segment_ids.shape != q.shape[:2]:
        raise ValueError(
            f"attention wants q, k, v [B, T, N, H] of one shape and segment_ids [B, T]; got "
            f"{q.shape}, {k.shape}, {v.shape}, {segment_ids.shape}.")
    platform = compile_platform() if platform is None else _normalize_platform(platform)
    valid = PLATFORM_IMPLEMENTATIONS.get(platform, ("auto", "reference", "xla"))
    if implementation not in valid:
        raise ValueError(
            f"model.attention={implementation!r} is not available on {platform}; "
            f"valid there: {', '.join(valid)}.")
    if implementation == "auto":
        implementation = _auto_choice(q, platform, packed)
    elif implementation == "cudnn":
        reason = cudnn_unsupported_reason(q, packed)
        if reason:
            raise ValueError(f"attention implementation 'cudnn' cannot run this call: {reason}; "
                             "use 'xla' (or 'auto', which falls back to it).")
    if implementation == "reference":
        return reference_attention(q, k, v, segment_ids)
    if implementation == "xla":
        return xla_attention(q, k, v, segment_ids)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, segment_ids, packed=packed)
    return splash_attention(q, k, v, segment_ids)


def _normalize_platform(platform: str) -> str:
    platform = platform.lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def compile_platform() -> str:
    """The platform the current trace compiles for: the context mesh's devices, if a mesh is
    set (jax.set_mesh), else jax.default_backend()."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return _normalize_platform(device.platform if device is not None else jax.default_backend())


def _device_kind() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is not None:
        return device.device_kind
    try:
        return jax.devices()[0].device_kind
    except RuntimeError:
        return ""


def _auto_choice(q, platform: str, packed: bool) -> str:
    if platform == "tpu":
        return "splash"
    if platform == "gpu":
        reason = cudnn_unsupported_reason(q, packed)
        if reason is None:
            return "cudnn"
        _log_once(f"attention 'auto' on GPU uses 'xla', not 'cudnn': {reason}.")
    return "xla"


def cudnn_unsupported_reason(q, packed: bool = True) -> str | None:
    """Why cuDNN's fused attention (jax 0.10) cannot run q's shape/dtype, or None if it can."""
    kind = _device_kind()
    if any(name in kind for name in ("AMD", "Instinct", "Radeon")):
        return f"cuDNN needs an NVIDIA GPU, this is {kind!r}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bfloat16/float16 inputs, these are {q.dtype}"
    head_dim = q.shape[-1]
    max_head_dim = 256 if _hopper_or_later(kind) else 128
    if head_dim % 8 or head_dim > max_head_dim:
        return f"cuDNN attention needs a head dim that is a multiple of 8 and <= {max_head_dim}, got {head_dim}"
    if packed and q.shape[1] % 2:
        return f"cuDNN's masked (bias) training kernel needs an even sequence length, got {q.shape[1]}"
    return None


def _hopper_or_later(kind: str) -> bool:
    try:
        gpus = jax.devices("gpu")
        return tuple(int(x) for x in gpus[0].compute_capability.split(".")) >= (9, 0)
    except (RuntimeError, AttributeError, ValueError):
        return any(name in kind for name in ("H100", "H200", "H800", "H20", "B100", "B200", "B300"))


# ---------------------------------------------------------------------------------------------
# reference


def reference_attention(q, k, v, segment_ids):
    """The plain formula with fp32 scores [B, N, T, T] (the test oracle; shares no code with the
    training implementations)."""
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = (causal[None] & same_segment)[:, None]  # [B, 1, T, T]
    return _masked_attention(q, k, v, mask)


def cached_attention(q, k, v, start):
    """Decoding steps: queries [B, T, N, H] at cache slots start.. over a key/value cache [B, S, N, H];
    query i sees slots <= start + i, so later slots (unwritten or stale) never count. The plain formula:
    one new token's scores are [B, N, 1, S], too small for the fused kernels to matter (a prompt is
    prefilled through `attention` instead, layers.Attention)."""
    visible = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(q.shape[1])[:, None]  # [T, S]
    return _masked_attention(q, k, v, visible[None, None])


def _masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(H)) v with fp32 scores where `mask` ([B or 1, 1, Tq, Tk]) holds."""
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bnqk,bknh->bqnh", probs, v).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# xla: chunked flash attention with a custom VJP


def _mask(seg_q: jax.Array, seg_k: jax.Array, q_start: int = 0) -> jax.Array:
    """[B, 1, Tq, Tk]: key position <= query position and same segment."""
    q_pos = q_start + jnp.arange(seg_q.shape[1])
    causal = q_pos[:, None] >= jnp.arange(seg_k.shape[1])[None, :]
    return (causal[None] & (seg_q[:, :, None] == seg_k[:, None, :]))[:, None]


def xla_chunks(seq_len: int) -> list[tuple[int, int]]:
    """Static query chunks [start, end): at most 8, at least 128 rows each (one for T <= 128)."""
    size = max(_MIN_XLA_CHUNK, -(-seq_len // _MAX_XLA_CHUNKS))
    return [(s, min(s + size, seq_len)) for s in range(0, seq_len, size)]


def xla_attention(q, k, v, segment_ids):
    """Flash attention in plain JAX (see the module docstring)."""
    return _flash(q, k, v, segment_ids)


def _chunk_scores(q, k, segment_ids, start, end):
    """fp32 scaled, masked scores of queries [start, end) against keys [0, end): [B, N, C, end]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqnh,bknh->bnqk", q[:, start:end], k[:, :end], preferred_element_type=jnp.float32)
    mask = _mask(segment_ids[:, start:end], segment_ids[:, :end], start)
    return jnp.where(mask, s * scale, _MASK_VALUE), mask


@jax.custom_vjp
def _flash(q, k, v, segment_ids):
    return _flash_fwd(q, k, v, segment_ids)[0]


def _flash_fwd(q, k, v, segment_ids):
    outs, lses = [], []
    for start, end in xla_chunks(q.shape[1]):
        s, _ = _chunk_scores(q, k, segment_ids, start, end)
        row_max = s.max(axis=-1, keepdims=True)
        p = jnp.exp(s - row_max)
        denom = p.sum(axis=-1, keepdims=True)
        o = jnp.einsum("bnqk,bknh->bqnh", (p / denom).astype(v.dtype), v[:, :end],
                       preferred_element_type=jnp.float32)
        outs.append(o.astype(q.dtype))
        lses.append((row_max + jnp.log(denom))[..., 0])  # [B, N, C]
    out = jnp.concatenate(outs, axis=1)
    return out, (q, k, v, segment_ids, out, jnp.concatenate(lses, axis=2))


def _flash_bwd(res, d_out):
    q, k, v, segment_ids, out, lse = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    f32 = jnp.float32
    # delta_i = sum_j p_ij dp_ij = <out_i, d_out_i>
    delta = jnp.einsum("bqnh,bqnh->bnq", out.astype(f32), d_out.astype(f32))
    dq_chunks = []
    dk = jnp.zeros(k.shape, f32)
    dv = jnp.zeros(v.shape, f32)
    for start, end in xla_chunks(q.shape[1]):
        s, mask = _chunk_scores(q, k, segment_ids, start, end)
        p = jnp.where(mask, jnp.exp(s - lse[:, :, start:end, None]), 0.0)  # [B, N, C, end]
        do_c = d_out[:, start:end]
        dv = dv.at[:, :end].add(jnp.einsum("bnqk,bqnh->bknh", p.astype(v.dtype), do_c, preferred_element_type=f32))
        dp = jnp.einsum("bqnh,bknh->bnqk", do_c, v[:, :end], preferred_element_type=f32)
        ds = (p * (dp - delta[:, :, start:end, None]) * scale).astype(q.dtype)
        dq_chunks.append(jnp.einsum("bnqk,bknh->bqnh", ds, k[:, :end], preferred_element_type=f32).astype(q.dtype))
        dk = dk.at[:, :end].add(jnp.einsum("bnqk,bqnh->bknh", ds, q[:, start:end], preferred_element_type=f32))
    return jnp.concatenate(dq_chunks, axis=1), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------
# cudnn


def cudnn_attention(q, k, v, segment_ids, *, packed: bool = True, _implementation: str = "cudnn"):
    """jax.nn.dot_product_attention with cuDNN (see the module docstring for `packed`).
    `_implementation='xla'` runs the same call through JAX's XLA implementation of that API (for
    tests on machines without a GPU)."""
    if packed:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=True,
                                            implementation=_implementation)
    lengths = jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                        key_value_seq_lengths=lengths, implementation=_implementation)


# ---------------------------------------------------------------------------------------------
# splash (TPU)


def splash_block_sizes(seq_len: int) -> tuple[int, int]:
    """(padded length, block): the length rounded up to a multiple of 128 (splash's blocks are
    multiples of the TPU lane width; the padding is its own masked segment), and the largest of
    512, 256, 128 that divides it, used for every forward and backward block. 512 is MaxText's
    default for all splash blocks; the kernel skips blocks above the causal diagonal, so larger
    blocks waste more of each diagonal block."""
    padded = -(-seq_len // _SPLASH_LANES) * _SPLASH_LANES
    block = next(b for b in (_SPLASH_MAX_BLOCK, 256, 128) if padded % b == 0)
    return padded, block


def _splash_kernel(num_heads: int, seq_len: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask as sm,
    )

    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len))] * num_heads)
    # Made inside the shard_map body for the local heads and the whole sequence, so the
    # kernel's mask tables need no sharding (head_shards = q_seq_shards = 1). Not cached: its
    # tables become constants of the trace that makes it (jnp.array under a trace is a tracer);
    # the costly mask analysis is cached inside splash (lru_cache on _process_mask).
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q, k, v, segment_ids, interpret):
    """The kernel on one device's [b, T, n, H] block (vmapped over rows)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    seq_len = q.shape[1]
    padded, block = splash_block_sizes(seq_len)
    # The kernel does not scale the logits; it wants [heads, seq, head_dim] per row.
    scaled_q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    q_, k_, v_ = (jnp.swapaxes(x, 1, 2) for x in (scaled_q, k, v))
    seg = segment_ids.astype(jnp.int32)
    if padded != seq_len:  # appended keys follow every real query: causality hides them
        pad = ((0, 0), (0, 0), (0, padded - seq_len), (0, 0))
        q_, k_, v_ = (jnp.pad(x, pad) for x in (q_, k_, v_))
        seg = jnp.pad(seg, ((0, 0), (0, padded - seq_len)), constant_values=-1)
    kernel = _splash_kernel(q_.shape[1], padded, block, interpret)
    out = jax.vmap(kernel)(q_, k_, v_, sk.SegmentIds(q=seg, kv=seg))
    return jnp.swapaxes(out[:, :, :seq_len], 1, 2).astype(q.dtype)


def splash_attention(q, k, v, segment_ids, *, interpret: bool = False):
    """Splash attention, inside jax.shard_map over the context mesh when one is set.
    `interpret=True` runs the kernel in Pallas's interpreter (any platform; slow)."""
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in set(mesh.manual_axes))
    local = functools.partial(_splash_local, interpret=interpret)
    if not free:
        return local(q, k, v, segment_ids)
    batch, heads = q.shape[0], q.shape[2]
    batch_axes = tuple(a for a in BATCH_AXES if a in free)
    if batch_axes and batch % math.prod(mesh.shape[a] for a in batch_axes):
        _log_once(f"splash attention: batch {batch} does not divide over mesh axes {batch_axes}; "
                  "rows computed replicated.")
        batch_axes = ()
    head_axis = HEAD_AXIS if HEAD_AXIS in free else None
    if head_axis and heads % mesh.shape[head_axis]:
        _log_once(f"splash attention: {heads} heads do not divide over mesh axis {head_axis!r} "
                  f"of size {mesh.shape[head_axis]}; heads computed replicated.")
        head_axis = None
    rows = batch_axes or None
    qkv_spec = jax.P(rows, None, head_axis, None)
    return jax.shard_map(local, in_specs=(qkv_spec, qkv_spec, qkv_spec, jax.P(rows, None)),
                         out_specs=qkv_spec, axis_names=set(free), check_vma=False)(q, k, v, segment_ids)
