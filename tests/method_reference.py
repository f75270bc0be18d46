"""SCONE's forward pass and AdamW written from docs/method.md alone, in plain numpy (float64).

Shares no code with scone_jax/: it reads parameters as nested dicts of numpy arrays (one dict per
block) and a batch of token ids, and computes everything else itself, the longest f-gram matches
included. Each document piece of a row is run on its own (attention never crosses documents), and
the f-gram model runs once per matched position on exactly that f-gram's tokens (no padding, no
deduplication, no prefix sharing), so none of the production shortcuts is assumed.

Conventions the method leaves to the code, as this reference fixes them (they are the model's
documented architecture, model/layers.py): pre-norm blocks x + attn(norm(x)), x + mlp(norm(x)),
then a final norm; norms with epsilon 1e-5; GELU in its tanh form; SwiGLU = silu(gate) * up;
rotary embeddings on the two halves of each head; the untied head is a [d, vocab] matrix.
"""
from __future__ import annotations

import math

import numpy as np

EPS = 1e-5


def norm(x, p, kind):
    if kind == "rmsnorm":
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * p["scale"]
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS)
    if kind == "nonparametric_layernorm":
        return y
    return y * p["scale"] + p.get("bias", 0.0)


def linear(x, p):
    return x @ p["kernel"] + p.get("bias", 0.0)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1 + np.exp(-x))


def rotate(x, positions, theta):
    """Rotary embedding of [n, heads, head_dim] at integer positions [n]: pairs (i, i + half) rotate."""
    half = x.shape[-1] // 2
    angle = positions[:, None] * theta ** (-np.arange(half) / half)  # [n, half]
    sin, cos = np.sin(angle)[:, None], np.cos(angle)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attention(x, p, positions, arch):
    """Causal self-attention over one document piece x [n, d]."""
    n = len(x)
    heads = arch["num_heads"]
    q, k, v = (linear(x, p[name]).reshape(n, heads, -1) for name in ("query", "key", "value"))
    if arch["rope"]:
        q, k = rotate(q, positions, arch["rope_theta"]), rotate(k, positions, arch["rope_theta"])
    scores = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return linear(np.einsum("hij,jhd->ihd", weights, v).reshape(n, -1), p["out"])


def mlp(x, p, arch):
    if arch["mlp"] == "swiglu":
        return linear(silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])
    return linear(gelu(linear(x, p["up"])), p["down"])


def block_stack(x, blocks, final_norm, positions, arch, apply_final_norm=True):
    for b in blocks:
        x = x + attention(norm(x, b["attn_norm"], arch["norm"]), b["attn"], positions, arch)
        x = x + mlp(norm(x, b["mlp_norm"], arch["norm"]), b["mlp"], arch)
    return norm(x, final_norm, arch["norm"]) if apply_final_norm else x


def fgram_embedding(gram, params, arch):
    """§4: T(t_1..t_n) (+ width projection), plus the f-gram model's own positions 0..n-1, through its
    blocks (causal), the hidden state at the last token after the final norm (projected back to the main width).
    arch["fgram_output_norm"] False (an experiment of docs/quality.md): the residual stream, without the norm."""
    f = params["fgram"]
    x = params["token_embed"][list(gram)] * arch.get("fgram_input_multiplier", 1.0)  # 1 in the method
    if "in_proj" in f:
        x = linear(x, f["in_proj"])
    x = x + f["pos_embed"][: len(gram)]
    fgram_arch = arch | {"rope": False, "num_heads": arch["fgram_num_heads"]}
    h = block_stack(x, f["blocks"], f.get("final_norm"), np.arange(len(gram)), fgram_arch,
                    apply_final_norm=arch.get("fgram_output_norm", True))[-1]
    return linear(h, f["out_proj"]) if "out_proj" in f else h


def matched_input(gram, params, arch):
    """§3: what the decoder reads at a position where `gram` is the longest match: its f-gram embedding. With the
    gate of docs/training.md (scone.gate; params["fgram"]["gate"] = g, absent in the method) the mix
    (1 - g) T(token) + g f, the token there being the f-gram's last one and T(token) the decoder's own input
    (times its embedding multiplier). The additive control of docs/training.md (arch["combine"] = "add"; "replace"
    in the method) keeps that input beside f: T(token) + f (+ g f with the gate); arch["row_scale"] = "token_rms"
    rescales f to that input's RMS first; arch["ramp"] = r (the output ramp) makes it (1 - r) T(token) + r of that.
    The export's table row of `gram`."""
    f = fgram_embedding(gram, params, arch)
    token = params["token_embed"][gram[-1]] * arch.get("embedding_multiplier", 1.0)
    if arch.get("row_scale", "raw") == "token_rms":  # f at the token input's RMS (docs/training.md)
        f = f * np.sqrt(np.mean(token ** 2)) / np.sqrt(np.mean(f ** 2))
    g = float(params["fgram"]["gate"]) if "gate" in params["fgram"] else None
    if arch.get("combine", "replace") == "add":
        x = token + (f if g is None else g * f)
    else:
        x = f if g is None else (1 - g) * token + g * f
    r = arch.get("ramp", 1.0)  # scone.output_ramp_steps' r (docs/training.md); 1 without a ramp
    return (1 - r) * token + r * x


def longest_matches(tokens, fgrams, max_len):
    """§2: for each position of one document piece, the longest f-gram ending there (tuple) or None."""
    out = []
    for i in range(len(tokens)):
        best = None
        for n in range(2, min(max_len, i + 1) + 1):
            gram = tuple(int(t) for t in tokens[i - n + 1: i + 1])
            if gram in fgrams:
                best = gram
        out.append(best)
    return out


def token_losses(params, batch, arch, fgrams=(), max_len=0, input_rows=None):
    """Per-position next-token cross-entropy [B, T] (zero where loss_mask is 0) of the decoder whose input
    at each matched position is the f-gram embedding instead of T(token) (§3). `input_rows(row, cols)`: another input
    layer's rows for that document piece instead of T(token) (Over-Encoding, tests/overencoding_reference.py)."""
    fgrams = set(map(tuple, fgrams))
    inputs, segments = batch.inputs, batch.segment_ids
    out = np.zeros(inputs.shape)
    for r in range(inputs.shape[0]):
        for segment in np.unique(segments[r][segments[r] > 0]):
            cols = np.flatnonzero(segments[r] == segment)
            tokens = inputs[r, cols]
            if input_rows is not None:
                x = input_rows(r, cols)
            else:
                x = params["token_embed"][tokens] * arch.get("embedding_multiplier", 1.0)  # 1 in the method
            for i, gram in enumerate(longest_matches(tokens, fgrams, max_len)):
                if gram is not None:
                    x[i] = matched_input(gram, params, arch)
            positions = batch.positions[r, cols]
            if not arch["rope"]:
                x = x + params["pos_embed"][positions]
            h = block_stack(x, params["blocks"], params["final_norm"], positions, arch)
            logits = h @ (params["head"] if "head" in params else params["token_embed"].T)
            top = logits.max(-1, keepdims=True)
            log_z = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
            out[r, cols] = (log_z - logits[np.arange(len(cols)), batch.targets[r, cols]]) * batch.loss_mask[r, cols]
    return out


def learning_rate(step, peak, warmup, total, min_ratio):
    """Linear warmup from 0 over `warmup` steps, then a cosine from peak to peak * min_ratio at `total`."""
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    end = peak * min_ratio
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * progress))


def delayed_factor(step, delay):
    """docs/training.md, train.fgram_model_delay_steps = D: the f-gram model's update at step `step` (counted
    from 1) is scaled by 0 for steps 1..D, by k / D at step D + k, and by 1 from step 2D on."""
    if delay == 0:
        return 1.0
    return min(1.0, max(0.0, (step - delay) / delay))


def adamw_step(params, grads, mu, nu, count, decayed, hp):
    """One AdamW update of flat {name: array} trees, the step numbered count + 1 (`count` steps done before it):
    global-norm clipping, bias-corrected moments, decoupled weight decay on the names in `decayed`, learning
    rate of step `count` (before the update). The f-gram model's parameters (names starting "['fgram_model']")
    train at hp["fgram_lr_multiplier"] (1 if absent) times that rate, their whole update (decay included)
    scaled by it and by delayed_factor(count + 1, hp["fgram_delay"]) (no delay if absent).
    Returns (params, mu, nu, learning rate, gradient norm before clipping)."""
    norm_ = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    scale = min(1.0, hp["clip"] / norm_) if hp["clip"] > 0 else 1.0
    lr = learning_rate(count, hp["lr"], hp["warmup"], hp["total"], hp["min_ratio"])
    t = count + 1
    fgram_factor = hp.get("fgram_lr_multiplier", 1.0) * delayed_factor(t, hp.get("fgram_delay", 0))
    new_p, new_mu, new_nu = {}, {}, {}
    for name, p in params.items():
        g = grads[name] * scale
        new_mu[name] = hp["b1"] * mu[name] + (1 - hp["b1"]) * g
        new_nu[name] = hp["b2"] * nu[name] + (1 - hp["b2"]) * g * g
        update = (new_mu[name] / (1 - hp["b1"] ** t)) / (np.sqrt(new_nu[name] / (1 - hp["b2"] ** t)) + hp["eps"])
        if name in decayed:
            update = update + hp["weight_decay"] * p
        if name.startswith("['fgram_model']"):
            update = update * fgram_factor
        new_p[name] = p - lr * update
    return new_p, new_mu, new_nu, lr, norm_
