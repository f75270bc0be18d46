"""Engram (DeepSeek-AI 2026, "Conditional Memory via Scalable Lookup", arXiv 2601.07372, §2): hashed n-gram memory
read inside the block stack, SCONE's second n-gram baseline (docs/method.md §9).

Before block l of engram.layers, the residual stream h [B, T, d] gains Y:
    e_t = concat over orders i = 2..n and heads k of E_{i,k}[id_{i,k}(t)]       ((n-1)K rows of width w_e)
    k_t = W_K e_t,  v_t = W_V e_t                                              ([d_mem, d] each, no bias)
    alpha_t = sigmoid(RMSNorm(h_t) . RMSNorm(k_t) / sqrt(d))                   (one scalar per position)
    v~_t = alpha_t v_t
    Y = SiLU(Conv1D(RMSNorm(v~))) + v~,   h <- h + Y
Conv1D is causal and depthwise: c_t = sum_{j<w} W_j * u_{t - j delta}, kernel w = engram.kernel_size, dilation
delta = engram.dilation (0: n, the paper's max order), W zero-initialised so Y starts as v~ (the paper's identity at
initialisation); its taps never reach into another document of a packed row (zero there, as before the row). The host
computes the ids (data/engram_hash.py, in the loader); each head's table has a prime modulus, distinct over every head
of every layer (`heads`). A layer's tables are one [sum M, w_e] array padded to a multiple of 128 rows, each head at
its offset. The tables live in the decoder, so an export's decoder holds them and serving runs them on the
accelerator; a host-RAM table (the paper's prefetching) is not done here (docs/method.md §9).

With a KVCache (decoding), each Engram layer keeps RMSNorm(v~) of every decoded position in the cache's `engram`
buffers, so a new token's convolution reads the earlier positions it needs.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from scone_jax.model.layers import dtype_of, normal
from scone_jax.sharding import constrain

_MAX_MODULUS = 2**31 - 1  # the ids reach the device as int32
_ROW_MULTIPLE = 128


def layers(engram_cfg) -> tuple[int, ...]:
    """The blocks (0-based) an Engram runs before, ascending: engram.layers, e.g. '1' or '1,5'."""
    text = str(engram_cfg.layers).replace(" ", "")
    try:
        found = tuple(int(part) for part in text.split(",") if part)
    except ValueError:
        found = ()
    return found


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    return all(value % p for p in range(2, math.isqrt(value) + 1))


def heads(engram_cfg) -> list[list[tuple[int, int]]]:
    """Per Engram layer (block order), its (n-1)K heads as (order, modulus), order-major: the moduli are successive
    primes from engram.rows on, each used once over all layers (as DeepSeek's demo, so no two heads' collisions
    coincide)."""
    out, candidate = [], engram_cfg.rows
    for _ in layers(engram_cfg):
        layer = []
        for order in range(2, engram_cfg.n + 1):
            for _ in range(engram_cfg.heads):
                while not _is_prime(candidate):
                    candidate += 1
                layer.append((order, candidate))
                candidate += 1
        out.append(layer)
    return out


def dilation(engram_cfg) -> int:
    return engram_cfg.dilation or engram_cfg.n


def parameter_rows(layer_heads: list[tuple[int, int]]) -> int:
    """Rows of one layer's table array: the sum of its heads' moduli, padded to a multiple of 128."""
    return -(-sum(modulus for _, modulus in layer_heads) // _ROW_MULTIPLE) * _ROW_MULTIPLE


def check(config) -> None:
    """ValueError naming the key and the fix where engram's settings do not fit the run: SCONE, Over-Encoding or a
    Hugging Face checkpoint beside it, a layer list that is not block indices, a modulus beyond int32."""
    en, m = config.get("engram"), config.model
    if en is None or not en.enabled:
        return
    for other in ("scone", "overencoding"):
        if config[other].enabled:
            raise ValueError(f"engram.enabled and {other}.enabled are both set: Engram is another n-gram baseline of "
                             f"SCONE's, and one run trains one of them. Fix: set one of them to False.")
    if m.get("init_from_hf", ""):
        raise ValueError(f"engram.enabled with model.init_from_hf={m.init_from_hf!r}: a Hugging Face checkpoint has "
                         "no Engram tables to start from. Fix: drop one of the two.")
    found = layers(en)
    if (not found or len(set(found)) != len(found) or min(found) < 0 or max(found) >= m.num_layers
            or list(found) != sorted(found)):
        raise ValueError(f"engram.layers={en.layers!r} is not an ascending list of distinct block indices in "
                         f"[0, {m.num_layers}) (model.num_layers={m.num_layers}). Fix: e.g. engram.layers=1 (before "
                         "the second block, the paper's early layer).")
    largest = heads(en)[-1][-1][1]
    if largest > _MAX_MODULUS:
        raise ValueError(f"engram.rows={en.rows} gives moduli up to {largest:,}, beyond the int32 ids the device "
                         f"reads. Fix: a smaller engram.rows.")


class Engram(nnx.Module):
    """One layer's tables, projections, norms and convolution (module docstring). Initialisation the paper leaves
    open (docs/method.md §9): table rows N(0, engram.init_std or model.init_std), W_K and W_V N(0, 1/sqrt(d_mem)) (a
    value row at the tables' scale), the three RMSNorm scales 1, the convolution 0 (the paper's)."""

    def __init__(self, model_cfg, engram_cfg, layer_heads: list[tuple[int, int]], rngs: nnx.Rngs):
        self.num_heads = len(layer_heads)
        width = engram_cfg.head_width
        memory = width * self.num_heads
        offsets, total = [], 0
        for _, modulus in layer_heads:
            offsets.append(total)
            total += modulus
        self.offsets = tuple(offsets)
        self.kernel_size, self.dilation = engram_cfg.kernel_size, dilation(engram_cfg)
        self.dtype = dtype_of(model_cfg.dtype)
        param_dtype = dtype_of(model_cfg.param_dtype)
        # An embedding by its name (model/roles.py): never weight-decayed, as the paper trains its tables.
        self.engram_tables = nnx.Embed(parameter_rows(layer_heads), width, dtype=self.dtype, param_dtype=param_dtype,
                                       embedding_init=normal(engram_cfg.init_std or model_cfg.init_std,
                                                             ("vocab", None)), rngs=rngs)

        def projection():
            return nnx.Linear(memory, model_cfg.d_model, use_bias=False, dtype=self.dtype, param_dtype=param_dtype,
                              kernel_init=normal(1.0 / math.sqrt(memory), (None, "embed")), rngs=rngs)

        self.key, self.value = projection(), projection()

        def norm():
            return nnx.RMSNorm(model_cfg.d_model, epsilon=model_cfg.norm_eps, dtype=jnp.float32,
                               param_dtype=param_dtype,
                               scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), (None,)), rngs=rngs)

        self.hidden_norm, self.key_norm, self.conv_norm = norm(), norm(), norm()
        self.conv_weights = nnx.Param(jnp.zeros((self.kernel_size, model_cfg.d_model), param_dtype),
                                      out_sharding=(None, "embed"))

    def gated_values(self, h: jax.Array, ids: jax.Array) -> jax.Array:
        """v~ [B, T, d] (float32) of the residual stream h and the layer's ids [B, T, (n-1)K]."""
        if ids.shape[-1] != self.num_heads:
            raise ValueError(f"The batch carries {ids.shape[-1]} ids for an Engram layer of {self.num_heads} heads: "
                             "the ids were made for another engram config.")
        table = constrain(self.engram_tables.embedding[...], ("vocab", None))
        rows = jnp.take(table, ids + jnp.asarray(self.offsets, ids.dtype), axis=0).astype(self.dtype)
        memory = constrain(rows.reshape(*ids.shape[:-1], -1), ("batch", None, None))
        keys, values = self.key(memory), self.value(memory)
        d = h.shape[-1]
        score = jnp.sum(self.hidden_norm(h.astype(jnp.float32)) * self.key_norm(keys.astype(jnp.float32)), axis=-1)
        alpha = jax.nn.sigmoid(score / math.sqrt(d))
        return alpha[..., None] * values.astype(jnp.float32)

    def convolve(self, u: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """sum_j W_j * u[t - j delta] over [B, T, d], zero before the row and across a document boundary."""
        weights = self.conv_weights[...].astype(jnp.float32)
        length = u.shape[1]
        out = weights[0] * u
        for j in range(1, self.kernel_size):
            lag = j * self.dilation
            if lag >= length:
                break
            shifted = jnp.pad(u[:, : length - lag], ((0, 0), (lag, 0), (0, 0)))
            if segment_ids is not None:
                same = jnp.pad(segment_ids[:, : length - lag] == segment_ids[:, lag:], ((0, 0), (lag, 0)))
                shifted = jnp.where(same[..., None], shifted, 0.0)
            out = out + weights[j] * shifted
        return out

    def convolve_cached(self, u: jax.Array, history: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Decoding: u [B, t, d] of the positions index.. written into `history` [B, S, d] (every earlier position's
        u, one document per row), and their convolution over it. Returns (convolution, the updated history)."""
        history = jax.lax.dynamic_update_slice_in_dim(history, u.astype(history.dtype), index, axis=1)
        weights = self.conv_weights[...].astype(jnp.float32)
        where = index + jnp.arange(u.shape[1])
        out = jnp.zeros(u.shape, jnp.float32)
        for j in range(self.kernel_size):
            source = where - j * self.dilation
            taps = jnp.take(history, jnp.maximum(source, 0), axis=1).astype(jnp.float32)
            out = out + weights[j] * jnp.where((source >= 0)[None, :, None], taps, 0.0)
        return out, history

    def __call__(self, h: jax.Array, ids: jax.Array, segment_ids: jax.Array | None = None,
                 history: jax.Array | None = None, index: jax.Array | None = None):
        """h + Y (module docstring) in h's dtype; with `history` (decoding), (h + Y, the updated history)."""
        v = self.gated_values(h, ids)
        u = self.conv_norm(v)
        if history is None:
            return (h.astype(jnp.float32) + jax.nn.silu(self.convolve(u, segment_ids)) + v).astype(h.dtype)
        c, history = self.convolve_cached(u, history, index)
        return (h.astype(jnp.float32) + jax.nn.silu(c) + v).astype(h.dtype), history
