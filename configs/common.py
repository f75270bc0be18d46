"""Helpers the paper configs share: parsing `SIZE[,fgram=..][,fgrams=..][,capacity=..]` variants and
counts such as '10m', and turning a config into its SCONE variant. Kept here, not in scone_jax/config_keys.py
(the schema), since only configs use them. Not a config itself: config files load it by its path (see
`load_beside` in scone_jax/config.py, as gpt2_paper.py does), as --config loads them by path, not as a package."""

SCONE_OPTIONS = ("fgram", "fgrams", "capacity")
_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9}


def split_variant(arg: str | None, valid, path: str) -> tuple[str, dict]:
    """`SIZE[,fgram=..][,fgrams=..][,capacity=..]` -> (SIZE, options); errors list the choices."""
    name, *parts = (arg or "").split(",")
    if name not in valid:
        raise ValueError(
            f"Unknown variant {arg!r} of {path}; valid variants: {', '.join(valid)}. "
            f"Pass one as --config={path}:{valid[0]}."
        )
    options = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in SCONE_OPTIONS or not value:
            raise ValueError(
                f"Unknown option {part!r} in {arg!r} of {path}; options are fgram=<f-gram model size>, "
                "fgrams=<count such as 10m>, capacity=<rows per data shard>."
            )
        options[key] = value
    if options and "fgram" not in options:
        raise ValueError(f"Options {sorted(options)} in {arg!r} need fgram=<size> too (they configure SCONE).")
    return name, options


def parse_count(text: str) -> int:
    """'10m' -> 10_000_000, '512k' -> 512_000, '1b' -> 1_000_000_000, '4096' -> 4096."""
    scale = _SUFFIXES.get(text[-1:].lower(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"{text!r} is not a count; write e.g. 4096, 512k, 10m or 1b.") from None


def enable_scone(config, *, fgram_layers: int, options: dict, default_fgrams: str, default_capacity: int) -> None:
    """Turn a paper config into its SCONE variant (same main model plus an f-gram model)."""
    s = config.scone
    s.enabled = True
    s.num_layers = fgram_layers
    s.num_fgrams = parse_count(options.get("fgrams", default_fgrams))
    s.fgram_capacity = parse_count(options.get("capacity", str(default_capacity)))
