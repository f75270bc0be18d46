"""model/rope.py: RoPE's frequencies and their scalings against numpy references written from the published
definitions (Meta's Llama 3.1 `apply_scaling`; the YaRN authors' reference code, which transformers follows),
against transformers' own ROPE_INIT_FUNCTIONS where it is installed, and the rotation against Hugging Face's
rotate-half formula."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from scone_jax import config as config_lib
from scone_jax.config import base_config
from scone_jax.model.rope import Rope
from tests.common import small_config

LLAMA31 = dict(rope_theta=500_000.0, rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_max_len=8192)
YARN = dict(rope_theta=1_000_000.0, rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=32768,
            rope_beta_fast=32.0, rope_beta_slow=1.0)
YARN_WIDE_RANGE = dict(YARN, rope_theta=10_000.0, rope_original_max_len=131_072)


def model_cfg(**overrides):
    cfg = base_config().model
    cfg.update(dict(position="rope", **overrides))
    return cfg


def plain_frequencies(theta, head_dim):
    return 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)


def llama31_reference(theta, head_dim, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's apply_scaling (Llama 3.1), frequency by frequency."""
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    out = []
    for freq in plain_frequencies(theta, head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def yarn_reference(theta, head_dim, factor, original, beta_fast, beta_slow):
    """YaRN's reference code: the correction range [floor(d(beta_fast)), ceil(d(beta_slow))] of dimension indices,
    d(r) = dim * ln(original / (2 pi r)) / (2 ln theta); a linear ramp mask over it; frequencies blended between
    extrapolation (f) and interpolation (f / factor) by 1 - mask; attention factor 0.1 ln(factor) + 1."""
    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    mask = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - mask
    freq = plain_frequencies(theta, head_dim)
    return freq / factor * (1 - extrapolation) + freq * extrapolation, 0.1 * math.log(factor) + 1


def test_llama3_frequencies_match_meta_s_definition():
    """Llama 3.1's own settings (theta 5e5, head_dim 128, factor 8, bands 1..4 over 8192): all three bands occur.
    Caught (each seen): the band conditions swapped (fast frequencies divided), the smooth factor's r taken as
    wavelength / L instead of L / wavelength."""
    got = np.asarray(Rope.of(model_cfg(**LLAMA31), 128).frequencies())
    want = llama31_reference(500_000.0, 128, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    plain = plain_frequencies(500_000.0, 128)
    assert (np.isclose(want, plain)).sum() > 10 and (np.isclose(want, plain / 8)).sum() > 10
    assert ((want < plain * 0.99) & (want > plain / 8 * 1.01)).sum() >= 3  # the smooth band
    assert Rope.of(model_cfg(**LLAMA31), 128).attention_factor == 1.0


@pytest.mark.parametrize("settings", [YARN, YARN_WIDE_RANGE], ids=["qwen", "wide_range"])
def test_yarn_frequencies_and_attention_factor_match_the_reference_code(settings):
    """theta 1e6, head_dim 128, factor 4 over 32768 (a Qwen-style extension), and theta 1e4 over 131,072 (whose
    slow end d(beta_slow) = 69.1 lies past the H/2 - 1 = 63 a ramp index reaches, but inside H - 1 = 127). Caught:
    the ramp reversed (slow dimensions kept, fast ones interpolated), the correction range not truncated
    (floor/ceil left out), and (wide_range only) the range's top clamped to H/2 - 1 instead of H - 1 (frequencies
    up to 46% off; issue 64's surviving mutant)."""
    rope = Rope.of(model_cfg(**settings), 128)
    want, factor = yarn_reference(settings["rope_theta"], 128, settings["rope_scaling_factor"],
                                  settings["rope_original_max_len"], 32.0, 1.0)
    np.testing.assert_allclose(np.asarray(rope.frequencies()), want, rtol=2e-6)
    assert rope.attention_factor == pytest.approx(factor) and factor == pytest.approx(1.1386294)


@pytest.mark.parametrize("kind", ["llama3", "yarn", "yarn_wide_range"])
def test_frequencies_match_transformers(kind):
    """The same settings through transformers' ROPE_INIT_FUNCTIONS (its float32 arithmetic: rtol 1e-5). Caught
    (yarn_wide_range): YaRN's correction range clamped to H/2 - 1 instead of H - 1."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = dict({"llama3": LLAMA31, "yarn": YARN, "yarn_wide_range": YARN_WIDE_RANGE}[kind])
    kind = ours["rope_scaling"]
    params = {"rope_type": kind, "rope_theta": ours["rope_theta"], "factor": ours["rope_scaling_factor"],
              "original_max_position_embeddings": ours["rope_original_max_len"]}
    if kind == "llama3":
        params.update(low_freq_factor=ours["rope_low_freq_factor"], high_freq_factor=ours["rope_high_freq_factor"])
    else:
        params.update(beta_fast=ours["rope_beta_fast"], beta_slow=ours["rope_beta_slow"])
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=131072,
                     rope_parameters=params)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    rope = Rope.of(model_cfg(**ours), 128)
    np.testing.assert_allclose(np.asarray(rope.frequencies()), inv_freq.numpy(), rtol=1e-5)
    assert rope.attention_factor == pytest.approx(attention_factor)


@pytest.mark.parametrize("scaling", [{}, LLAMA31, YARN])
def test_rotation_is_hugging_faces_rotate_half_with_the_scaled_frequencies(scaling):
    """Rope(x) = (x * cos + rotate_half(x) * sin) * attention_factor with emb = cat(freqs, freqs) (Hugging Face's
    apply_rotary_pos_emb) at positions up to 40,000. Caught: the YaRN attention factor left out, and applied to
    sin only."""
    cfg = model_cfg(**scaling)
    rope = Rope.of(cfg, 64)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 64))
    positions = np.stack([np.arange(5), 40_000 + np.arange(5) * 997])
    if scaling.get("rope_scaling") == "llama3":
        inv_freq, factor = llama31_reference(cfg.rope_theta, 64, 8.0, 1.0, 4.0, 8192), 1.0
    elif scaling.get("rope_scaling") == "yarn":
        inv_freq, factor = yarn_reference(cfg.rope_theta, 64, 4.0, 32768, 32.0, 1.0)
    else:
        inv_freq, factor = plain_frequencies(cfg.rope_theta, 64), 1.0
    emb = np.concatenate([positions[..., None] * inv_freq] * 2, axis=-1)[:, :, None]
    rotate_half = np.concatenate([-x[..., 32:], x[..., :32]], axis=-1)
    want = (x * np.cos(emb) + rotate_half * np.sin(emb)) * factor
    got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=5e-3 if positions.max() > 1000 else 1e-5)  # fp32 angles near 4e4


def test_no_scaling_keeps_the_old_frequencies_exactly():
    """'none' (every config saved before the key existed) computes theta^(-i / (H/2)) in float32 as before."""
    half = 32
    old = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    rope = Rope.of(model_cfg(), 64)
    assert rope.multipliers is None and rope.attention_factor == 1.0
    np.testing.assert_array_equal(np.asarray(rope.frequencies()), np.asarray(old))


@pytest.mark.parametrize("overrides,message", [
    (dict(rope_scaling="linear"), r"^Unknown model.rope_scaling='linear'; valid: none, llama3, yarn\.$"),
    (dict(position="learned", rope_scaling="llama3"),
     r"^model.rope_scaling='llama3' scales RoPE, but model.position='learned'. Fix: --config.model.position=rope"),
    (dict(position="rope", rope_scaling="llama3", rope_high_freq_factor=1.0),
     r"^model.rope_high_freq_factor=1.0 must exceed model.rope_low_freq_factor=1.0"),
    (dict(rope_scaling_factor=0.0), r"^model.rope_scaling_factor=0.0 is not valid: it must be > 0"),
])
def test_bad_rope_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_lib.validate(small_config(**overrides))
