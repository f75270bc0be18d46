"""The config: the defaults of every key (declared once, with its meaning and range, in config_keys.py),
loading config files, --config overrides and validation; config files in configs/ override the defaults.

Configs are ml_collections ConfigDicts, locked after construction, so a misspelled
`--config.model.num_layrs=4` is an error listing the valid keys (see `unknown_key_message`); a config file's
own `c.model.num_layrs = 4` (made before it locks) is refused the same way (`check_declared`).
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os

import ml_collections

from scone_jax import config_keys
from scone_jax.data import eval_sets, mixture
from scone_jax.runtime import storage, workdir as workdir_layout


def base_config() -> ml_collections.ConfigDict:
    """Every key of config_keys.KEYS at its default, unlocked (config files override some, then lock it)."""
    c = ml_collections.ConfigDict()
    for key in config_keys.KEYS:
        section, name = key.name.split(".")
        if section not in c:
            c[section] = ml_collections.ConfigDict()
        c[section][name] = ml_collections.ConfigDict() if isinstance(key.default, config_keys.Group) else key.default
    return c


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Load `path/to/config.py[:arg]` the way `--config` does (for tools and tests)."""
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise FileNotFoundError(f"Config file {path!r} not found; pass e.g. configs/tiny.py.")
    spec_obj = importlib.util.spec_from_file_location("_scone_config", path)
    module = importlib.util.module_from_spec(spec_obj)
    try:
        spec_obj.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(f"Config file {path!r} does not parse: {e.msg} at line {e.lineno}. Fix: correct it.") from None
    except Exception as e:  # noqa: BLE001 - any error of the file's own code, in one line
        raise ValueError(f"Config file {path!r} fails when loaded: {type(e).__name__}: {e}. Fix: correct it.") from None
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"Config file {path!r} defines no get_config(arg). Fix: define one that returns the config "
                         "(see configs/tiny.py).")
    try:
        config = module.get_config(arg or None)
    except ValueError:
        raise  # the config's own message (e.g. an unknown variant): already says what to pass
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"Config file {path!r}: get_config({arg or None!r}) failed: {type(e).__name__}: {e}. "
                         "Fix: correct the config file.") from None
    check_declared(config, f"Config file {spec!r}")
    return config


def undeclared_keys(config) -> list[str]:
    """The dotted keys `config` holds that config_keys.py does not declare, in order: a misspelled key a config
    file set (`c.model.num_layrs = 2`) or a section of its own (`c.optim = ...`). A group's entries (data.mixture's
    components) are the config's own names, not keys."""
    out = []
    for section in config.keys():
        node = config[section]
        if not isinstance(node, ml_collections.ConfigDict):
            out.append(section)
            continue
        out += [f"{section}.{name}" for name in node.keys() if f"{section}.{name}" not in config_keys.BY_NAME]
    return out


def check_declared(config, where: str) -> None:
    """ValueError naming the first key of `config` that config_keys.py does not declare, as an unknown
    --config.KEY override is refused: nothing reads such a key, so the run would silently train with the
    default of the key that was meant."""
    for key in undeclared_keys(config):
        section, _, name = key.partition(".")
        known = [k for k in config_keys.BY_NAME if k.startswith(section + ".")] if name else []
        close = difflib.get_close_matches(key, known, n=1)
        raise ValueError(f"{where} sets {key}, which is not a config key: "
                         f"{unknown_key_message(base_config(), key).split(': ', 1)[1]}. Fix: "
                         f"{f'correct it ({close[0]}?)' if close else 'remove it'}; only the keys declared in "
                         "scone_jax/config_keys.py are read.")


def load_beside(config_file: str, name: str):
    """The Python module `name` in the directory of `config_file` (a config's `__file__`), loaded by
    path: --config loads config files by path, not as a package, so their shared helpers
    (configs/common.py) cannot be imported by name from every working directory."""
    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), name)
    spec = importlib.util.spec_from_file_location(f"_scone_config_{os.path.splitext(name)[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unknown_key_message(config: ml_collections.ConfigDict, dotted: str) -> str | None:
    """Explain a bad `--config.a.b` override (which part is unknown, what is valid there);
    None if the key exists."""
    node, parts = config, dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            where = ".".join(parts[:i]) or "config"
            valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            return f"Unknown config key {dotted!r}: {where} has no field {part!r}. Valid keys there: {valid}"
        node = node[part]
    return None


def apply_override(config: ml_collections.ConfigDict, item: str, flag: str = "--config", joint: str = ".") -> None:
    """Set one KEY=VALUE of a tool's --config.KEY=VALUE on the unlocked `config`, VALUE read as the key's current
    type; a bad item is a ValueError naming the flag as written and the fix (override_flag_error's one line)."""
    key, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"{flag}{joint}{item} has no '='. Fix: write KEY=VALUE, e.g. {flag}{joint}train.seed=1.")
    unknown = unknown_key_message(config, key)
    if unknown:
        raise ValueError(f"{flag}{joint}{item}: {unknown}")
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    old = node[leaf]
    if isinstance(old, ml_collections.ConfigDict):
        if key in config_keys.GROUPS:
            raise ValueError(f"{flag}{joint}{item}: {key} is a group of named entries, set whole. Fix: set it in a "
                             f"config file, or give its shorthand, e.g. {flag}{joint}"
                             f"{config_keys.BY_NAME[key].default.shorthand}.")
        raise ValueError(f"{flag}{joint}{item}: {key} is a group of keys. Fix: set one of them, e.g. "
                         f"{flag}{joint}{key}.{sorted(old.keys())[0]}=VALUE.")
    if isinstance(old, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{flag}{joint}{item}: {key} is true or false, not {value!r}.")
        node[leaf] = value.lower() in ("true", "1")
        return
    try:
        node[leaf] = type(old)(value)
    except (TypeError, ValueError):
        kind = {int: "an integer", float: "a number"}.get(type(old), type(old).__name__)
        raise ValueError(f"{flag}{joint}{item}: {key} takes {kind} (it is {old!r} now), not {value!r}.") from None


def override_flag_error(argv, config: ml_collections.ConfigDict) -> str | None:
    """Why argv's --config.KEY=VALUE flags do not fit `config` (a tool whose --config is a fixed config's
    keys: tools/bench_quality.py), in apply_override's one line; None if they all do."""
    trial = config.copy_and_resolve_references()
    with trial.unlocked():
        for arg in argv:
            if arg.startswith("--config."):
                try:
                    apply_override(trial, arg[len("--config."):])
                except ValueError as e:
                    return str(e)
    return None


def define_override_flag(program: str, config: ml_collections.ConfigDict, help_text: str):
    """A tool's `--config.KEY=VALUE` flags over the fixed `config`'s keys (tools/bench_quality.py: configs/quality.py's
    arm; tools/trace_steps.py: base_config(), applied to a run's saved config). config_flags reads the command
    line's --config.* while it defines the flag, so an unknown key fails here (a traceback of its own): refused in
    one line, exit 2, as a bad value is. Read the settings with config_flags.get_override_values."""
    import sys

    from ml_collections import config_flags

    from scone_jax.runtime import tool_main
    from scone_jax.runtime.errors import one_line

    try:
        return config_flags.DEFINE_config_dict("config", config, help_text, lock_config=True)
    except (AttributeError, KeyError) as e:
        print(f"{program}: error: {override_flag_error(sys.argv, config) or one_line(e)}", file=sys.stderr)
        sys.exit(tool_main.EXIT_BAD_INPUT)


def set_overrides(config: ml_collections.ConfigDict, overrides: dict) -> None:
    """Set each dotted key of `overrides` (config_flags.get_override_values of define_override_flag's flag) on
    the unlocked `config`."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value


def config_flag_error(argv) -> str | None:
    """Why `--config=...`/`--config.*` flags in argv failed to parse, in one line (for CLIs)."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return None
    try:
        base = load_config_file(spec)
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    overrides = [a.split("=", 1)[0][len("--config."):] for a in argv if a.startswith("--config.")]
    return next(filter(None, (unknown_key_message(base, key) for key in overrides)), None)


# Numeric keys and the values they accept (config_keys.KEYS' rules); `validate` names the key and the rule when
# one is broken. "-1 | >= 1" accepts -1 (automatic) or any value of at least 1.
NUMERIC_RULES = config_keys.NUMERIC_RULES
_RULE_TESTS = {
    ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, ">= 2": lambda v: v >= 2, "> 0": lambda v: v > 0,
    ">= -1": lambda v: v >= -1, "-1 | >= 1": lambda v: v == -1 or v >= 1,
    "in (0, 1)": lambda v: 0 < v < 1, "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1, "in [0, 2**63)": lambda v: 0 <= v < 2**63,
}


def _check_numbers(config: ml_collections.ConfigDict) -> None:
    """Every numeric key's rule, and every number finite: inf passes '> 0', and nan fails no comparison."""
    for key in config_keys.KEYS:
        if not (key.rule or isinstance(key.default, float)):
            continue
        section, name = key.name.split(".")
        value = config[section][name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or (key.rule and not _RULE_TESTS[key.rule](value)):
            finite = (" and finite" if key.rule else "finite") if isinstance(key.default, float) else ""
            raise ValueError(f"{key.name}={value!r} is not valid: it must be {key.rule}{finite}"
                             f"{config_keys.RULE_HINTS.get(key.name, '')}.")


def _check_special_tokens(d: ml_collections.ConfigDict) -> None:
    """data.bos_token/eos_token/pad_token are token strings; whether the tokenizer has them is checked when it
    loads (data/tokenizer.py), with the same key named."""
    for role in ("bos", "eos", "pad"):
        value = d.get(f"{role}_token", "")
        if not isinstance(value, str):
            raise ValueError(f"data.{role}_token={value!r} is not valid: it must be '' (the tokenizer's own) or the "
                             f"spelling of one token of its vocabulary, e.g. --config.data.{role}_token='<|endoftext|>'.")


def _check_chat(d: ml_collections.ConfigDict) -> None:
    """data.loss_on and data.overlong are one of their words (read only with data.source='chat')."""
    for key, words in (("loss_on", ("assistant", "all")), ("overlong", ("refuse", "truncate"))):
        if d.get(key, words[0]) not in words:
            raise ValueError(f"data.{key}={d[key]!r} is not valid. Fix: one of {', '.join(map(repr, words))}.")


# The keys that each give the f-gram model's delay (training/optimizer.fgram_model_delay): at most one may be > 0.
DELAY_KEYS = ("fgram_model_delay_steps", "fgram_model_delay_steps_per_layer", "fgram_model_delay_fraction")


def delay_steps_for_fraction(fraction: float, num_steps: int) -> int:
    """train.fgram_model_delay_fraction's D: ceil(fraction x num_steps), the first steps that make up at least
    that share of the run (0 for 0). The product is rounded to 9 decimals first, so a share that is a whole
    number of steps (0.1 of 10) is that number and not one more from a float's last bit."""
    return math.ceil(round(fraction * num_steps, 9))


def _check_fgram_training(config: ml_collections.ConfigDict) -> None:
    """The f-gram model's own settings mean nothing without one (a baseline run), and the delay has one value."""
    s, t = config.scone, config.train
    if not s.enabled:
        for key, value, default in (("learning_rate_multiplier", s.learning_rate_multiplier, 1.0),
                                    ("gate", s.gate, False), ("own_token_embedding", s.own_token_embedding, False),
                                    ("combine", s.combine, "replace"), ("row_scale", s.row_scale, "raw"),
                                    ("output_ramp_steps", s.output_ramp_steps, 0),
                                    ("output_projection_init", s.output_projection_init, "normal")):
            if value != default:
                raise ValueError(f"scone.{key}={value!r} is set on a run without SCONE (scone.enabled=False): it "
                                 "applies to the f-gram model only. Fix: set --config.scone.enabled=True, or leave "
                                 f"scone.{key} at {default!r}.")
    _check_combine(config)
    if s.gate_learning_rate_multiplier != 1.0 and not s.gate:
        raise ValueError(f"scone.gate_learning_rate_multiplier={s.gate_learning_rate_multiplier!r} is set without "
                         "scone.gate: there is no gate to train. Fix: set --config.scone.gate=True, or leave the "
                         "multiplier at 1.0.")
    delays = [f"train.{key}={t[key]}" for key in DELAY_KEYS if t[key]]
    if len(delays) > 1:
        raise ValueError(f"{', '.join(delays[:-1])} and {delays[-1]} are set; they are ways to give the one delay. "
                         "Fix: keep one of them and set the others to 0.")


COMBINES = ("replace", "add")
PROJECTION_INITS = ("normal", "zeros")
ROW_SCALES = ("raw", "token_rms")


def _check_combine(config: ml_collections.ConfigDict) -> None:
    """scone.combine, scone.output_projection_init and scone.row_scale take their listed values. A zero projection
    needs a combination that starts from the token's input (add, or the gate), else every matched position would
    read zeros at step 0, and raw rows: token_rms would divide its f = 0 by its RMS."""
    s = config.scone
    for key, valid in (("combine", COMBINES), ("output_projection_init", PROJECTION_INITS),
                       ("row_scale", ROW_SCALES)):
        if s[key] not in valid:
            raise ValueError(f"Unknown scone.{key}={s[key]!r}; valid: {', '.join(valid)}.")
    if s.output_projection_init != "zeros":
        return
    if s.row_scale != "raw":
        raise ValueError("scone.output_projection_init='zeros' with scone.row_scale='token_rms': the rows start at 0, "
                         "and rescaling them to the token's RMS divides by theirs. Fix: one of the two (the zero "
                         "projection learns the rows' scale itself).")
    if s.combine == "replace" and not s.gate:
        raise ValueError("scone.output_projection_init='zeros' with scone.combine='replace' feeds the decoder zeros "
                         "at every matched position at step 0. Fix: --config.scone.combine=add (T(token) + f, f "
                         "from 0), or --config.scone.gate=True.")


def check_fgram_source(config: ml_collections.ConfigDict) -> None:
    """scone.init_from_hf needs SCONE and a start at the plain fine-tune: scone.gate (g = 0 at step 0), or
    scone.combine='add' with scone.output_projection_init='zeros' (T(token) + P h with P = 0): either way the decoder
    receives T(token) at every position at step 0, so the run starts exactly as the plain fine-tune of the main
    model does (docs/training.md), instead of feeding it a random projection of the source's states.
    scone.source_model, derived from the source, must parse and agree with the f-gram model's sizes."""
    s = config.scone
    if s.get("init_from_hf", ""):
        if not s.enabled:
            raise ValueError(f"scone.init_from_hf={s.init_from_hf!r} is set with scone.enabled=False. Fix: set "
                             "--config.scone.enabled=True, or drop scone.init_from_hf.")
        if not s.gate and not (s.combine == "add" and s.output_projection_init == "zeros"):
            raise ValueError(f"scone.init_from_hf={s.init_from_hf!r} is set with scone.gate=False and "
                             f"scone.combine={s.combine!r}, scone.output_projection_init={s.output_projection_init!r}:"
                             " the run would not start as the plain fine-tune of the main model. Fix: set "
                             "--config.scone.gate=True (g = 0 at step 0), or --config.scone.combine=add with "
                             "--config.scone.output_projection_init=zeros (f = 0 at step 0), or drop "
                             "scone.init_from_hf.")
    if not s.get("source_model", ""):
        return
    try:
        source = json.loads(s.source_model)
        sizes = {key: source[key] for key in ("num_layers", "d_model", "num_heads", "d_ff", "vocab_size")}
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"scone.source_model={s.source_model[:80]!r} is not the JSON object of model keys that "
                         "scone.init_from_hf derives. Fix: leave it '' (scone.init_from_hf sets it).") from None
    differ = [f"scone.{key}={s[key]!r} (the source has {sizes[key]!r})" for key in ("num_layers", "d_model",
                                                                                 "num_heads", "d_ff")
              if s[key] != sizes[key]]
    if differ:
        raise ValueError(f"{', '.join(differ)}: the f-gram model's sizes must be its source's (scone.source_model). "
                         "Fix: leave them unset; scone.init_from_hf derives them.")


def _check_fgram_heads(config: ml_collections.ConfigDict) -> None:
    """The f-gram model shares model.num_kv_heads (model/fgram_model.py), so its own heads must be a multiple (a
    source checkpoint's heads are its own, with its own key/value heads)."""
    m, s = config.model, config.scone
    if s.get("source_model", ""):
        return
    if s.enabled and s.num_heads and m.num_kv_heads and s.num_heads % m.num_kv_heads:
        raise ValueError(f"scone.num_heads={s.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}, "
                         "which the f-gram model shares. Fix: a multiple of it, or 0 (the main model's heads).")


def resolve_data(data: dict) -> dict:
    """The data section (a plain dict) with the command line's shorthand parsed into its groups, the one
    place it is read: data.train_files 'web=GLOBS@0.7;books=GLOBS@0.3' into data.mixture and data.eval_files
    'web=GLOBS;books=GLOBS' into data.eval_sets, each string left ''; both groups checked and in plain form.
    A section saved before the groups existed (a checkpoint's, an export's) gets them the same way, so it
    compares equal to today's resolution of the same command line. ValueError naming the key and the fix for a
    bad shorthand or group, or a group set beside a string that gives the same data."""
    data = dict(data)
    where = {}
    for key, group_key, parse in (("eval_files", "eval_sets", eval_sets.parse), ("train_files", "mixture", mixture.parse)):
        group, text = dict(data.get(group_key) or {}), data.get(key, "")
        if group and text:
            raise ValueError(f"data.{key}={text!r} and data.{group_key} ({', '.join(group)}) are both set: two ways "
                             f"to give the same data. Fix: set one of them (data.{key}='' to keep data.{group_key}).")
        parsed = parse(text)
        if parsed is not None:
            group, data[key] = parsed, ""
        data[group_key], where[group_key] = group, f"data.{key}" if parsed is not None else f"data.{group_key}"
    data["mixture"] = mixture.check(data["mixture"], where["mixture"])
    data["eval_sets"] = eval_sets.check(data["eval_sets"])
    return data


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` (changed in place, locked or not) with its data section resolved (resolve_data): from here on
    every consumer reads data.mixture and data.eval_sets, never the shorthand. Idempotent; validate calls it
    first, so a run, a tool and a test that validate see the groups."""
    data = resolve_data(config.data.to_dict())
    for key in ("train_files", "eval_files", "mixture", "eval_sets"):
        config.data[key] = data[key]
    return config


def validate(config: ml_collections.ConfigDict) -> None:
    """Every numeric key's range (NUMERIC_RULES), then cross-field checks that ml_collections cannot express,
    resolve(config) (in place) among them; each error names the key and says the fix. A key config_keys.py does
    not declare is refused first (check_declared)."""
    check_declared(config, "The config")
    _check_numbers(config)
    m, d, t = config.model, config.data, config.train
    _check_special_tokens(d)
    _check_chat(d)
    _check_fgram_training(config)
    check_fgram_source(config)
    resolve(config)  # the shorthand into its groups: a set or component without files, a bad weight, a name twice
    if t.profile_steps:
        start, sep, end = t.profile_steps.partition(":")
        if not (sep and start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
            raise ValueError(f"train.profile_steps={t.profile_steps!r} is not START:END with 1 <= START <= END "
                             "(steps, 1-based, inclusive). Fix: e.g. --config.train.profile_steps=10:15, or '' for none.")
        if int(end) > t.num_steps:  # the run never reaches it (a start that only misses it is warned about)
            raise ValueError(f"train.profile_steps={t.profile_steps!r} ends after train.num_steps={t.num_steps}: the "
                             f"run never reaches step {end}. Fix: a range within 1:{t.num_steps}, or '' for none.")
    if m.d_model % m.num_heads and not m.head_dim:
        raise ValueError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; set model.head_dim.")
    if m.num_kv_heads and m.num_heads % m.num_kv_heads:
        raise ValueError(f"model.num_kv_heads={m.num_kv_heads} does not divide model.num_heads={m.num_heads}: each "
                         "key/value head serves an equal group of query heads. Fix: a divisor of num_heads (0 = "
                         "num_heads).")
    _check_fgram_heads(config)
    from scone_jax.model import engram, overencoding, rope  # here, not at the top: they import jax, which loading a
    #                                                         config does not need
    rope.check(m)
    overencoding.check(config)
    engram.check(config)
    if m.position == "learned" and d.seq_len > m.max_seq_len:
        if m.get("init_from_hf", ""):  # its positions are the checkpoint's: raising max_seq_len would conflict
            raise ValueError(f"data.seq_len={d.seq_len} exceeds the {m.max_seq_len} learned positions of the "
                             f"checkpoint model.init_from_hf={m.init_from_hf} (its max_position_embeddings, which "
                             f"fixes model.max_seq_len). Fix: data.seq_len={m.max_seq_len} or less.")
        raise ValueError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len.")
    if d.global_batch_size % t.grad_accum_steps:
        raise ValueError(
            f"data.global_batch_size={d.global_batch_size} is not divisible by "
            f"train.grad_accum_steps={t.grad_accum_steps}."
        )


def validate_batch_split(config: ml_collections.ConfigDict, num_batch_shards: int) -> None:
    """Checks that need the mesh: the global batch splits into data shards, each shard's rows
    into train.grad_accum_steps micro-batches and (SCONE) its f-gram capacity likewise."""
    d, accum = config.data, config.train.grad_accum_steps
    if d.global_batch_size % num_batch_shards:
        raise ValueError(
            f"data.global_batch_size={d.global_batch_size} does not split over the {num_batch_shards} data "
            f"shards of the mesh (mesh.data x mesh.fsdp). Fix: use a multiple of {num_batch_shards}."
        )
    rows = d.global_batch_size // num_batch_shards
    if rows % accum:
        works = [a for a in range(1, rows + 1) if rows % a == 0]
        raise ValueError(
            f"train.grad_accum_steps={accum} does not divide the {rows} rows per data shard "
            f"(data.global_batch_size={d.global_batch_size} over {num_batch_shards} shards); micro-batches "
            f"take equal blocks of every shard. Values that work: {', '.join(map(str, works))}."
        )
    capacity = config.scone.fgram_capacity
    if config.scone.enabled and capacity % accum:
        lower = capacity // accum * accum
        choices = f"{lower} or {lower + accum}" if lower else f"{accum}"
        raise ValueError(
            f"scone.fgram_capacity={capacity} (f-gram rows per data shard and step) does not split into "
            f"train.grad_accum_steps={accum} equal micro-batches. Fix: use a multiple of {accum}, e.g. {choices}."
        )


# What a checkpoint's state and the batches after it mean (config_keys.STATE): resuming with another value of any
# of these is refused (train.run), unless named in --allow_config_change. The other keys may change between runs.
# The tokenizer and the f-gram vocabulary are pinned by their fingerprints instead of their paths, so moved files
# still resume.
RESUME_KEYS = config_keys.RESUME_KEYS


def resume_changes(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
    """'key: saved -> now' for every RESUME_KEYS value that differs from the saved config (a plain
    dict, as checkpoints store it); keys the saved config predates are not compared. Its data section is
    resolved as today's is (resolve_data), so a run saved with the shorthand compares with its groups."""
    if "data" in saved:
        saved = {**saved, "data": resolve_data(saved["data"])}
    changes = []
    for key in RESUME_KEYS:
        section, name = key.split(".")
        if section in ("scone", "overencoding", "engram") and name != "enabled" and not config[section].enabled:
            continue  # the f-gram (n-gram table) settings of a run without f-grams (n-gram tables) mean nothing
        now = config[section][name]
        now = now.to_dict() if isinstance(now, ml_collections.ConfigDict) else now
        if name in saved.get(section, {}) and saved[section][name] != now:
            changes.append(f"{key}: {saved[section][name]!r} -> {now!r}")
    return changes


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Write the resolved config next to the checkpoints (local or gs://), for humans and for restarts."""
    storage.write_bytes(workdir, workdir_layout.CONFIG, to_json(config).encode())

