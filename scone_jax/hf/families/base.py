"""What every family's map is made of: the architecture keys it derives, a tensor's name, layout and transform,
config.json reading (transformers 4 and 5 spellings) and the one-line refusals.

A family (families/llama.py, ...) states, both ways, its config.json <-> our model.* keys and each Hugging Face
tensor <-> the decoder parameter(s) it holds. Our parameters live at paths of the Decoder's nnx state
(model/transformer.py): top level ('token_embed', 'embedding'), or inside a block ('attn', 'query', 'kernel'),
which the tree holds at ('stack', 'blocks', ...) stacked along a leading layers axis (model.scan_layers, the
default) or at ('stack', 'blocks', i, ...) one per layer.
"""
from __future__ import annotations

import dataclasses

BLOCKS = ("stack", "blocks")


class HfConfigError(ValueError):
    """A config.json (or a run's model section) outside what a family or our decoder supports; one line."""


@dataclasses.dataclass(frozen=True)
class Part:
    """The decoder parameter at `path` (inside a block for a per-layer tensor) is the slice [start, stop) of its
    Hugging Face tensor along the tensor's `axis` (the whole tensor unless the tensor fuses several)."""

    path: tuple[str, ...]
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor: its name ('{i}' stands for the layer), shape and the decoder parameter(s) it holds.
    `transpose`: Hugging Face's nn.Linear weight is [out, in] and our nnx.Linear kernel [in, out]. `axis`: where the
    parts of a fused tensor (GPT-2's c_attn: q, k, v) lie side by side."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    transpose: bool = False
    axis: int = -1

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    def part_shape(self, part: Part) -> tuple[int, ...]:
        """Our parameter's shape (one layer's) for `part`."""
        shape = list(self.shape)
        shape[self.axis] = part.stop - part.start
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def hf_block(self, part: Part, ours: tuple[slice, ...]) -> tuple[slice, ...]:
        """The block of this tensor that holds the block `ours` (slices of one layer's parameter) of `part`."""
        ours = tuple(ours) + (slice(None),) * (len(self.shape) - len(ours))
        spans = [s.indices(n) for s, n in zip(ours, self.part_shape(part))]
        if self.transpose:
            spans = spans[::-1]
        axis = self.axis % len(self.shape)
        return tuple(slice(a + (part.start if d == axis else 0), b + (part.start if d == axis else 0))
                     for d, (a, b, _) in enumerate(spans))


def linear(name: str, d_in: int, d_out: int, path: tuple[str, ...]) -> Tensor:
    """An nn.Linear weight [out, in] holding our kernel [in, out] at `path`."""
    return Tensor(name, (d_out, d_in), (Part(path, 0, d_in),), transpose=True, axis=-1)


def vector(name: str, size: int, path: tuple[str, ...]) -> Tensor:
    """A 1-D tensor (norm scale, bias) equal to ours."""
    return Tensor(name, (size,), (Part(path, 0, size),))


def table(name: str, rows: int, width: int, path: tuple[str, ...]) -> Tensor:
    """An embedding table [rows, width], the same layout in both."""
    return Tensor(name, (rows, width), (Part(path, 0, width),))


def refuse(where: str, field: str, value, supported: str) -> HfConfigError:
    return HfConfigError(f"{where}: {field}={value!r} is not supported ({supported}). Fix: use a checkpoint without "
                         "it, or convert it to the supported form first.")


def require(hf: dict, where: str, field: str, allowed: tuple, default=None) -> None:
    """Refuse config.json's `field` unless its value (or `default` when absent) is one of `allowed`."""
    value = hf.get(field, default)
    if value not in allowed:
        raise refuse(where, field, value, f"supported: {', '.join(repr(a) for a in allowed)}")


def number(values: dict, where: str, field: str, default=None, kind=int, label: str = ""):
    """values[field] (or `default` when absent or null) as a positive `kind`; HfConfigError naming `label` (default:
    the field) when it is missing or not such a number."""
    value = values.get(field)
    value = default if value is None else value
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and value != int(value)) or value <= 0:
        raise HfConfigError(f"{where}: {label or field}={value!r} is missing or not a positive number. Fix: correct "
                            "config.json.")
    return kind(value)


def rope_parameters(hf: dict, where: str, default_theta: float) -> dict:
    """RoPE's settings in transformers 5's form ({'rope_type', 'rope_theta', 'factor', ...}) whichever way config.json
    spells them: transformers 5 keeps them in `rope_parameters`, transformers 4 in top-level `rope_theta` and
    `rope_scaling` (with 'type' an older name of 'rope_type')."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise refuse(where, "rope_parameters", params, "one dict for every layer")
    params = dict(params or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise refuse(where, "rope_parameters", sorted(params), "one dict for every layer, not one per layer type")
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    return params


def rope_keys(hf: dict, where: str, default_theta: float) -> dict:
    """Our rope_theta and rope_scaling keys from config.json, with the scaling's own keys when it has one: 'default'
    RoPE, Llama 3.1's 'llama3' or 'yarn'; every other type (linear, dynamic, longrope, ...) or a yarn knob we do not
    implement is refused naming it."""
    p = rope_parameters(hf, where, default_theta)
    keys = dict(rope_theta=number(p, where, "rope_theta", kind=float, label="rope_parameters.rope_theta"),
                rope_scaling="none")
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(where, "rope_parameters.partial_rotary_factor", p["partial_rotary_factor"], "RoPE on whole heads")
    kind = p["rope_type"]
    if kind == "default":
        return keys
    original = (p.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings"))
    common = dict(rope_scaling_factor=number(p, where, "factor", kind=float, label="rope_parameters.factor"),
                  rope_original_max_len=number({"n": original}, where, "n", kind=int,
                                               label="rope_parameters.original_max_position_embeddings"))
    if kind == "llama3":
        return {**keys, **common, "rope_scaling": "llama3",
                "rope_low_freq_factor": number(p, where, "low_freq_factor", kind=float,
                                               label="rope_parameters.low_freq_factor"),
                "rope_high_freq_factor": number(p, where, "high_freq_factor", kind=float,
                                                label="rope_parameters.high_freq_factor")}
    if kind == "yarn":
        for field in ("attention_factor", "mscale", "mscale_all_dim"):
            if p.get(field) is not None:
                raise refuse(where, f"rope_parameters.{field}", p[field], "yarn with its default attention factor")
        if p.get("truncate", True) is not True:
            raise refuse(where, "rope_parameters.truncate", p["truncate"], "yarn with truncate=True")
        return {**keys, **common, "rope_scaling": "yarn",
                "rope_beta_fast": float(p.get("beta_fast") or 32.0), "rope_beta_slow": float(p.get("beta_slow") or 1.0)}
    raise refuse(where, "rope_parameters.rope_type", kind, "supported: 'default', 'llama3', 'yarn'")


def rope_config(model) -> dict:
    """config.json's rope_parameters (transformers 5) for our model section, plus rope_theta and rope_scaling at the
    top level, which transformers 4 reads."""
    params = {"rope_type": "default", "rope_theta": float(model["rope_theta"])}
    scaling = model["rope_scaling"]
    if scaling in ("llama3", "yarn"):
        params.update(rope_type=scaling, factor=float(model["rope_scaling_factor"]),
                      original_max_position_embeddings=int(model["rope_original_max_len"]))
    if scaling == "llama3":
        params.update(low_freq_factor=float(model["rope_low_freq_factor"]),
                      high_freq_factor=float(model["rope_high_freq_factor"]))
    if scaling == "yarn":
        params.update(beta_fast=float(model["rope_beta_fast"]), beta_slow=float(model["rope_beta_slow"]))
    legacy = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params, "rope_theta": params["rope_theta"],
            "rope_scaling": legacy if scaling != "none" else None}


def head_dim_of(model) -> int:
    return model["head_dim"] or model["d_model"] // model["num_heads"]


def kv_heads_of(model) -> int:
    return model["num_kv_heads"] or model["num_heads"]


def canonical(key: str, value, model) -> object:
    """A model key's value in the one form two equal architectures share: num_kv_heads 0 means num_heads and
    head_dim 0 means d_model // num_heads; numbers compare as floats."""
    if key == "num_kv_heads":
        return value or model["num_heads"]
    if key == "head_dim":
        return value or model["d_model"] // model["num_heads"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


class Family:
    """One Hugging Face model family: config.json <-> our model keys, and its tensors. Subclasses set the class
    attributes and the four methods."""

    model_type: str = ""  # config.json's model_type
    architecture: str = ""  # config.json's architectures entry (the CausalLM class written on export)
    prefix: str = ""  # the base model's name prefix inside the CausalLM ('model.'); a file saved without it loads too
    fits: dict = {}  # model keys this family's architecture fixes (compared with `canonical`)

    def model_keys(self, hf: dict, where: str) -> dict:
        """config.json -> every model key its architecture fixes; HfConfigError (one line, naming the field and
        value) for a setting outside the family or our decoder."""
        raise NotImplementedError

    def hf_config(self, model) -> dict:
        """Our model section -> the architecture part of config.json."""
        raise NotImplementedError

    def tensors(self, model) -> list[Tensor]:
        """Every tensor of a checkpoint of `model` (names with the prefix)."""
        raise NotImplementedError

    def ignored(self, name: str, model) -> bool:
        """A tensor a checkpoint may hold that is no parameter of ours (read past, never written): a tied head's
        copy of the embedding table."""
        return model["tie_embeddings"] and name == "lm_head.weight"

    def misfit(self, model) -> list[str]:
        """What in our model section this family cannot express ([] = it fits), e.g. "norm='rmsnorm' (has
        'layernorm')"."""
        return [f"{key}={want!r} (has {model[key]!r})" for key, want in self.fits.items()
                if canonical(key, model[key], model) != canonical(key, want, model)]
