"""Causal self-attention within documents: one entry point, several implementations.

    attention(q, k, v, segment_ids, *, implementation="auto", platform=None, packed=True)

q is [B, T, N, H] and k, v are [B, T, K, H] in the compute dtype, K dividing N (grouped-query
attention: query head n reads key/value head n // (N / K), Hugging Face's repeat_kv order; K = N is
multi-head, K = 1 multi-query); segment_ids [B, T] int32 numbers the documents of a row 1, 2, ... and
marks padding with 0. Query i attends to key j iff j <= i and segment_ids[i] == segment_ids[j];
logits are scaled by 1/sqrt(H); the result is [B, T, N, H] in q.dtype. Padding attends among itself
(every row keeps at least its diagonal), and its outputs are masked out of the loss later.

No path repeats k and v to N heads: each groups the query heads instead, [B, T, K, N/K, H] against
[B, T, K, H] (reference, xla and the decode step's cached_attention in their einsums; cudnn and
splash in their kernels, which take K key/value heads natively).

Implementations (IMPLEMENTATIONS; which ones a platform has: PLATFORM_IMPLEMENTATIONS):
  reference  the plain formula: fp32 scores [B, K, N/K, T, T], mask, softmax. The test oracle.
  xla        pure-JAX flash attention: queries in at most 8 static chunks, each against the keys
             up to its end only (the causal upper triangle of whole chunks is never computed, 44%
             fewer score FLOPs at 8 chunks), online-softmax statistics saved instead of
             probabilities, and a custom VJP that recomputes each chunk's scores in the
             backward pass. Scores come from the inputs' dtype with fp32 accumulation
             (preferred_element_type), so no fp32 copy of q/k is made. The largest buffer is one
             chunk's scores [B, K, N/K, T/8, T] instead of [B, N, T, T]. The backward pass sums
             dk, dv over each group's query heads in the same einsums. It is the fallback everywhere
             (speed and memory against the others: docs/benchmarks.md, tools/bench_attention.py).
  cudnn      jax.nn.dot_product_attention(implementation='cudnn') (NVIDIA GPUs; bf16/fp16; head
             dim a multiple of 8 and <= 128, <= 256 on Hopper and later; K key/value heads taken
             as they are, grouped as above). jax 0.10's public API
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
             statistics; q is scaled by 1/sqrt(H) before it (the kernel does not scale). Its
             multi-head form reads key/value head n // (N / K) for query head n when given K < N
             heads (its grid maps each query head to its group's k/v blocks and its dk/dv kernel
             sums over the group), so GQA needs neither repeated k/v nor the MQA form vmapped
             over groups. Mosaic kernels cannot be partitioned automatically, so under a mesh it
             runs inside jax.shard_map: rows over the mesh's ('data', 'fsdp') axes, key/value
             heads (and their query groups) over 'tensor' (each only where it divides),
             everything else replicated. Block sizes: see splash_block_sizes.
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
    if (q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]
            or q.shape[2] % k.shape[2] or segment_ids.shape != q.shape[:2]):
        raise ValueError(
            f"attention wants q [B, T, N, H], k and v [B, T, K, H] with K dividing N, and segment_ids [B, T]; got "
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
    """Decoding steps: queries [B, T, N, H] at cache slots start.. over a key/value cache [B, S, K, H];
    query i sees slots <= start + i, so later slots (unwritten or stale) never count. The plain formula:
    one new token's scores are [B, N, 1, S], too small for the fused kernels to matter (a prompt is
    prefilled through `attention` instead, layers.Attention)."""
    visible = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(q.shape[1])[:, None]  # [T, S]
    return _masked_attention(q, k, v, visible[None, None])


def grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """Query heads [B, T, N, H] -> [B, T, K, N/K, H] (head n is group n // (N / K)'s member n % (N / K)); q
    itself when K = N, so multi-head attention computes exactly what it did before grouping existed."""
    b, t, n, h = q.shape
    return q if kv_heads == n else q.reshape(b, t, kv_heads, n // kv_heads, h)


def _einsum(spec: str, *operands, **kwargs):
    """jnp.einsum of a spec written for grouped queries (group member axis g), on ungrouped ones (4-d q,
    see `grouped`) the same spec without g."""
    grouped_q = any(x.ndim == 5 for x in operands)
    return jnp.einsum(spec if grouped_q else spec.replace("g", ""), *operands, **kwargs)


def _group_mask(mask: jax.Array, scores: jax.Array) -> jax.Array:
    """A mask [B or 1, 1, Tq, Tk] broadcastable against (grouped or not) scores [B, K, (G,) Tq, Tk]."""
    return mask[:, :, None] if scores.ndim == 5 else mask


def _masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(H)) v with fp32 scores where `mask` ([B or 1, 1, Tq, Tk]) holds; each group of
    query heads against its key/value head."""
    scores = _einsum("bqkgh,bskh->bkgqs", grouped(q, k.shape[2]), k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(_group_mask(mask, scores), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return _einsum("bkgqs,bskh->bqkgh", probs, v).reshape(q.shape).astype(q.dtype)


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
    return _flash(grouped(q, k.shape[2]), k, v, segment_ids).reshape(q.shape)


def _chunk_scores(q, k, segment_ids, start, end):
    """fp32 scaled, masked scores of (grouped) queries [start, end) against keys [0, end): [B, K, (G,) C, end]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = _einsum("bqkgh,bskh->bkgqs", q[:, start:end], k[:, :end], preferred_element_type=jnp.float32)
    mask = _group_mask(_mask(segment_ids[:, start:end], segment_ids[:, :end], start), s)
    return jnp.where(mask, s * scale, _MASK_VALUE), mask


@jax.custom_vjp
def _flash(q, k, v, segment_ids):
    """Grouped queries [B, T, K, G, H] (or [B, T, K, H] when G = 1) over keys and values [B, T, K, H] -> q's
    shape."""
    return _flash_fwd(q, k, v, segment_ids)[0]


def _flash_fwd(q, k, v, segment_ids):
    outs, lses = [], []
    for start, end in xla_chunks(q.shape[1]):
        s, _ = _chunk_scores(q, k, segment_ids, start, end)
        row_max = s.max(axis=-1, keepdims=True)
        p = jnp.exp(s - row_max)
        denom = p.sum(axis=-1, keepdims=True)
        o = _einsum("bkgqs,bskh->bqkgh", (p / denom).astype(v.dtype), v[:, :end],
                       preferred_element_type=jnp.float32)
        outs.append(o.astype(q.dtype))
        lses.append((row_max + jnp.log(denom))[..., 0])  # [B, K, (G,) C]
    out = jnp.concatenate(outs, axis=1)
    return out, (q, k, v, segment_ids, out, jnp.concatenate(lses, axis=-1))


def _flash_bwd(res, d_out):
    q, k, v, segment_ids, out, lse = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    f32 = jnp.float32
    # delta_i = sum_j p_ij dp_ij = <out_i, d_out_i>
    delta = _einsum("bqkgh,bqkgh->bkgq", out.astype(f32), d_out.astype(f32))
    dq_chunks = []
    dk = jnp.zeros(k.shape, f32)
    dv = jnp.zeros(v.shape, f32)
    for start, end in xla_chunks(q.shape[1]):
        s, mask = _chunk_scores(q, k, segment_ids, start, end)
        p = jnp.where(mask, jnp.exp(s - lse[..., start:end, None]), 0.0)  # [B, K, (G,) C, end]
        do_c = d_out[:, start:end]
        # dk and dv: each key/value head sums over its group's query heads (g) as over queries (q)
        dv = dv.at[:, :end].add(_einsum("bkgqs,bqkgh->bskh", p.astype(v.dtype), do_c, preferred_element_type=f32))
        dp = _einsum("bqkgh,bskh->bkgqs", do_c, v[:, :end], preferred_element_type=f32)
        ds = (p * (dp - delta[..., start:end, None]) * scale).astype(q.dtype)
        dq_chunks.append(_einsum("bkgqs,bskh->bqkgh", ds, k[:, :end], preferred_element_type=f32).astype(q.dtype))
        dk = dk.at[:, :end].add(_einsum("bkgqs,bqkgh->bskh", ds, q[:, start:end], preferred_element_type=f32))
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
    """The kernel on one device's block, q [b, T, n, H] and k, v [b, T, kv, H] (vmapped over rows)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    seq_len = q.shape[1]
    padded, block = splash_block_sizes(seq_len)
    # The kernel does not scale the logits; it wants [heads, seq, head_dim] per row (k, v: their own heads).
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
    batch, kv_heads = q.shape[0], k.shape[2]
    batch_axes = tuple(a for a in BATCH_AXES if a in free)
    if batch_axes and batch % math.prod(mesh.shape[a] for a in batch_axes):
        _log_once(f"splash attention: batch {batch} does not divide over mesh axes {batch_axes}; "
                  "rows computed replicated.")
        batch_axes = ()
    head_axis = HEAD_AXIS if HEAD_AXIS in free else None
    if head_axis and kv_heads % mesh.shape[head_axis]:  # a device's query heads are whole groups
        _log_once(f"splash attention: {kv_heads} key/value heads do not divide over mesh axis {head_axis!r} "
                  f"of size {mesh.shape[head_axis]}; heads computed replicated.")
        head_axis = None
    rows = batch_axes or None
    qkv_spec = jax.P(rows, None, head_axis, None)
    return jax.shard_map(local, in_specs=(qkv_spec, qkv_spec, qkv_spec, jax.P(rows, None)),
                         out_specs=qkv_spec, axis_names=set(free), check_vma=False)(q, k, v, segment_ids)
