"""Rotary position embedding in the rotate-half convention (Hugging Face's), and its context-extension scalings.

Head width H, pairs (x_i, x_{i + H/2}) rotated by angle position * f_i with f_i = theta^(-2i / H), i < H/2.
model.rope_scaling rescales each f_i by a fixed factor m_i (cfg keys model.rope_*; L = rope_original_max_len,
the context the checkpoint was pretrained at, s = rope_scaling_factor):
  none    m_i = 1.
  llama3  Llama 3.1, by wavelength w_i = 2 pi / f_i: w_i < L / high_freq_factor (fast) keep m_i = 1;
          w_i > L / low_freq_factor (slow) m_i = 1 / s; in between m_i = (1 - r) / s + r with
          r = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor).
  yarn    YaRN (Peng et al., 2023), by dimension: d(b) = H ln(L / (2 pi b)) / (2 ln theta) is the pair index that
          turns b times over L; lo = floor(d(beta_fast)), hi = ceil(d(beta_slow)) (clamped to [0, H - 1]);
          ramp_i = clip((i - lo) / (hi - lo), 0, 1); m_i = ramp_i / s + 1 - ramp_i (fast pairs kept, slow ones
          interpolated). cos and sin are also multiplied by 0.1 ln(s) + 1 (1 for s <= 1), as transformers does:
          q and k both, so the logits by its square.
These are transformers' _compute_llama3_parameters and _compute_yarn_parameters (mscale-free, truncated
correction range), rewritten from their formulas; tests/test_rope.py checks them against numpy references
and, where transformers is installed, against its ROPE_INIT_FUNCTIONS.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

SCALINGS = ("none", "llama3", "yarn")


def check(cfg) -> None:
    """An unknown model.rope_scaling, or a scaling of learned positions, is a config error naming the fix."""
    if cfg.rope_scaling not in SCALINGS:
        raise ValueError(f"Unknown model.rope_scaling={cfg.rope_scaling!r}; valid: {', '.join(SCALINGS)}.")
    if cfg.rope_scaling != "none" and cfg.position != "rope":
        raise ValueError(f"model.rope_scaling={cfg.rope_scaling!r} scales RoPE, but model.position={cfg.position!r}. "
                         "Fix: --config.model.position=rope, or model.rope_scaling='none'.")
    if cfg.rope_scaling == "llama3" and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
        raise ValueError(f"model.rope_high_freq_factor={cfg.rope_high_freq_factor} must exceed "
                         f"model.rope_low_freq_factor={cfg.rope_low_freq_factor} (llama3's interpolation band). "
                         "Fix: e.g. Llama 3.1's 4.0 and 1.0.")


def multipliers(cfg, head_dim: int) -> np.ndarray | None:
    """The scaling's m_i (float64 [H/2], module docstring), or None for 'none'."""
    half = head_dim // 2
    factor = float(cfg.rope_scaling_factor)
    original = float(cfg.rope_original_max_len)
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling == "llama3":
        low, high = float(cfg.rope_low_freq_factor), float(cfg.rope_high_freq_factor)
        wavelength = 2 * math.pi * cfg.rope_theta ** (2 * np.arange(half) / head_dim)
        ratio = (original / wavelength - low) / (high - low)
        m = (1 - ratio) / factor + ratio
        m = np.where(wavelength > original / low, 1 / factor, m)
        return np.where(wavelength < original / high, 1.0, m)
    if cfg.rope_scaling == "yarn":
        def turns_at(rotations):  # the (fractional) pair index that turns `rotations` times over the context
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        lo = max(math.floor(turns_at(cfg.rope_beta_fast)), 0)
        hi = min(math.ceil(turns_at(cfg.rope_beta_slow)), head_dim - 1)
        ramp = np.clip((np.arange(half) - lo) / ((hi - lo) or 0.001), 0, 1)
        return ramp / factor + 1 - ramp
    check(cfg)  # raises: an unknown scaling
    return None


def attention_factor(cfg) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1 ln(s) + 1 (s > 1), else 1."""
    factor = float(cfg.rope_scaling_factor)
    return 0.1 * math.log(factor) + 1.0 if cfg.rope_scaling == "yarn" and factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotation one model config defines: fixed frequencies, no parameters (hashable, so a module may hold
    it as a static attribute)."""
    head_dim: int
    theta: float
    multipliers: tuple | None  # m_i as float32 values; None = all 1
    attention_factor: float

    @classmethod
    def of(cls, cfg, head_dim: int) -> "Rope":
        check(cfg)
        m = multipliers(cfg, head_dim)
        return cls(head_dim, float(cfg.rope_theta), None if m is None else tuple(m.astype(np.float32).tolist()),
                   attention_factor(cfg))

    def frequencies(self) -> jax.Array:
        """f_i * m_i, float32 [H/2] (f_i computed in float32 as it always was, so 'none' is unchanged)."""
        half = self.head_dim // 2
        freq = self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        return freq if self.multipliers is None else freq * jnp.asarray(self.multipliers, jnp.float32)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, T, N, H] rotated by its per-token positions [B, T]."""
        angle = positions[..., None].astype(jnp.float32) * self.frequencies()  # [B, T, half]
        sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
        if self.attention_factor != 1.0:
            sin, cos = sin * self.attention_factor, cos * self.attention_factor
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype)
