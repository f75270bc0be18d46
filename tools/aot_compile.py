"""Compile the real train step for a TPU slice on a machine without TPUs: does it fit, how fast?

  pip install -e '.[aot]'     # libtpu: the TPU compiler, usable without a TPU
  python tools/aot_compile.py --config=configs/olmo_paper.py:1b --topology=v5p-128
  python tools/aot_compile.py --config=configs/gpt2_paper.py:419m --topology=v5e-256 \
      --config.train.grad_accum_steps=2

A run that starts from Hugging Face checkpoints (model.init_from_hf, scone.init_from_hf) takes its shapes from their
config.json files; --hf_config and --fgram_hf_config give those files (or directories holding them) where the
checkpoints are not on this machine, e.g. the paper's fine-tuning setting from the published configs in configs/hf/:
  python tools/aot_compile.py --config=configs/finetune_paper.py --topology=v5p-128 \
      --hf_config=configs/hf/qwen3_4b_base --fgram_hf_config=configs/hf/qwen3_8b_base
A SCONE run also prints the size of its exported table in bf16 (`RESULT table_gb`: host RAM or disk at serving).

The slice is named as Cloud TPU names it: v4-N and v5p-N count TensorCores (two per chip),
v5e-N (or v5litepod-N) and v6e-N count chips. The step is the one training runs
(scone_jax.training.steps.make_train_step over the config's mesh, lowered for the shapes of the state and
the [global_batch, seq_len] batch that scone_jax.training.run.build_abstract gives), so the figures hold
for `scone_jax.main` with the same config and flags. Prints, per chip: HBM use as XLA plans it (arguments,
outputs, temporaries, generated code) against the chip's HBM; FLOPs per step from the model formula of
scone_jax.model.accounting (next to XLA's own count with --config.model.scan_layers=False:
XLA counts a scanned loop's body once); the step time if the chip ran at its bf16 peak (a
lower bound: real steps reach maybe 40-60% of it); and the compile time, which a pod pays at
every start. The last lines are `RESULT name value` for scripts (compile_s, hbm_gib_per_chip,
step_flops, predicted_step_s) and FITS or DOES NOT FIT; the exit status is 0 if it fits, 1 if
not, 2 for bad input. When the compiler itself runs out of HBM there is no program to
measure: only `RESULT hbm_gib_per_chip` (the compiler's need for temporaries) is printed.

With --decode_context=N the program is instead one decoding step of the main decoder (one new token for each
of --decode_batch sequences over a KV cache of N positions: what scone_jax.serving.generate runs per token),
compiled for the slice; it prints the KV cache's size (`RESULT kv_cache_gib`, all chips together) beside what
it would be with as many key/value heads as query heads (`RESULT kv_cache_mha_gib`), then the step's HBM per
chip. E.g. Qwen3-8B's shapes (36 layers, 32 query and 8 key/value heads of 128, bf16) at 8k context:
  python tools/aot_compile.py --topology=v5e-8 --decode_context=8192 --config=configs/tiny.py:baseline \
      --config.model.d_model=4096 --config.model.num_layers=36 --config.model.num_heads=32 \
      --config.model.num_kv_heads=8 --config.model.head_dim=128 --config.model.d_ff=12288 \
      --config.model.vocab_size=151936 --config.model.position=rope --config.model.norm=rmsnorm \
      --config.model.mlp=swiglu --config.model.qk_norm=True --config.model.use_bias=False \
      --config.model.tie_embeddings=False --config.model.dtype=bfloat16 --config.model.param_dtype=bfloat16
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
import time

# The step compiles for TPU through the topology API; JAX's own default backend stays the
# CPU, and libtpu skips its one-process-per-host lock (no TPU is opened here). See
# tpu_devices for the rest of libtpu's environment.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from scone_jax import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:variant], e.g. configs/olmo_paper.py:1b.", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p-128, v4-64, v5e-256, v6e-64.")
_DECODE_CONTEXT = flags.DEFINE_integer("decode_context", 0, "> 0: compile one decoding step over a KV cache of this "
                                       "many positions instead of the train step, and print the cache's size.")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 1, "Sequences decoded together (with --decode_context).")
_HF_CONFIG = flags.DEFINE_string("hf_config", "", "A Hugging Face config.json (or a directory holding one) the main "
                                 "model's shapes are derived from, as model.init_from_hf derives them, without weights "
                                 "or a tokenizer; '' = the config.json of the config's model.init_from_hf, if any.")
_FGRAM_HF_CONFIG = flags.DEFINE_string("fgram_hf_config", "", "The same for the f-gram model's source "
                                       "(scone.init_from_hf); '' = the config.json of the config's scone.init_from_hf.")

GIB = 1024**3
EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 1, 2
_REMEDY = ("try --config.model.remat=save_dots (or full), a larger --config.train.grad_accum_steps, "
           "or more chips")

# Slice shapes in chips, as Cloud TPU lays them out (v4/v5p: 3-D torus; v5e/v6e: 2-D).
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Generation:
    cores_per_chip: int  # how many TensorCores the slice name counts per chip
    shapes: dict
    chip_config: str  # libtpu's name for one JAX device per chip ("megacore" on v4)
    hbm_gib: int


GENERATIONS = {
    "v4": Generation(2, _SHAPES_3D, "megacore", 32),
    "v5p": Generation(2, _SHAPES_3D, "default", 95),
    "v5e": Generation(1, _SHAPES_2D, "default", 16),
    "v6e": Generation(1, _SHAPES_2D, "default", 32),
}


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # as given, e.g. "v5e-256"
    accelerator_type: str  # as a TPU VM reports it, e.g. "v5litepod-256"
    generation: str
    chips: int
    topology_name: str  # what libtpu's topology API takes, e.g. "v5p:4x4x4"
    chip_config: str
    hbm_bytes: int


def valid_slice_names() -> list[str]:
    return [f"{g}-{chips * gen.cores_per_chip}" for g, gen in GENERATIONS.items() for chips in gen.shapes]


def parse_slice(name: str) -> Slice:
    """'v5p-128' -> 64 chips laid out 4x4x4; an unknown name is an error listing the valid ones."""
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    generation = ("v5e" if match[1] == "v5litepod" else match[1]) if match else None
    gen = GENERATIONS.get(generation)
    count = int(match[2]) if match else 0
    chips = count // gen.cores_per_chip if gen and count % gen.cores_per_chip == 0 else 0
    if not gen or chips not in gen.shapes:
        raise ValueError(f"Unknown TPU slice {name!r}; valid names: {', '.join(valid_slice_names())}.")
    accelerator_type = f"{'v5litepod' if generation == 'v5e' else generation}-{count}"
    return Slice(match[0], accelerator_type, generation, chips, f"{generation}:{gen.shapes[chips]}",
                 gen.chip_config, gen.hbm_gib * GIB)


def tpu_devices(tpu: Slice) -> list:
    """The slice's devices from libtpu's topology description (hosts of 2x2 chips)."""
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError("libtpu, the TPU compiler, is not installed; pip install -e '.[aot]' (no TPU needed).")
    from jax.experimental import topologies

    # Off a TPU VM libtpu cannot query the VM's metadata for these and prints screens of
    # warnings; what they say does not change the compiled program. A TPU VM's own values win.
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                       ("TPU_ACCELERATOR_TYPE", tpu.accelerator_type)):
        os.environ.setdefault(key, value)

    dims = [int(x) for x in tpu.topology_name.split(":")[1].split("x")]
    host_bounds = tuple(min(2, d) for d in dims[:2]) + (1,)
    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=tpu.topology_name, chip_config_name=tpu.chip_config,
        chips_per_host_bounds=host_bounds, num_slices=1,
    )
    return topology.devices


def compile_train_step(config, devices):
    """Lower and compile scone_jax's train step over `devices` for the run's shapes without data
    (training/run.py's build_abstract): (compiled, mesh, spec, timings)."""
    from scone_jax import sharding
    from scone_jax.training import run as run_lib

    mesh = sharding.make_mesh(config.mesh, devices=devices)
    config_lib.validate_batch_split(config, sharding.num_batch_shards(mesh))
    abstract = run_lib.build_abstract(config, mesh)
    start = time.perf_counter()
    lowered = abstract.lower_train_step()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    timings = {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at}
    return compiled, mesh, abstract.spec, timings


def compile_decode_step(config, devices, context: int, batch: int):
    """One token per sequence through the decoder over a cache of `context` positions (Decoder.decode with a
    KVCache, as serving/generate.py runs it), lowered for the slice: parameters in their training shardings,
    the cache's rows over (data, fsdp) and its key/value heads over 'tensor' where each divides, else whole.
    Returns (compiled, mesh, timings)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from scone_jax import sharding
    from scone_jax.model.layers import kv_heads_of
    from scone_jax.model.transformer import Decoder, init_cache

    mesh = sharding.make_mesh(config.mesh, devices=devices)
    graphdef, abstract = nnx.eval_shape(lambda: nnx.split(Decoder(config.model, nnx.Rngs(0)), nnx.Param))
    params = sharding.sharded_abstract(abstract, sharding.state_shardings(abstract, mesh))
    rows = sharding.BATCH_AXES if batch % sharding.num_batch_shards(mesh) == 0 else None
    heads = "tensor" if kv_heads_of(config.model) % mesh.shape["tensor"] == 0 else None
    cache_spec = NamedSharding(mesh, P(None, rows, None, heads, None) if config.model.scan_layers
                               else P(rows, None, heads, None))
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cache_spec if a.ndim else None),
                         jax.eval_shape(lambda: init_cache(config.model, batch, context)))
    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=NamedSharding(mesh, P(rows)))

    def step(params, cache, tokens, positions):
        decoder = nnx.merge(graphdef, params)
        h, cache = decoder.decode(decoder.input_tokens(tokens), None, positions, cache)
        return decoder.logits(h), cache

    start = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = jax.jit(step, donate_argnums=1).lower(params, cache, token, token)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return compiled, mesh, {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at}


def report_decode(config, tpu: Slice, compiled, mesh, timings, context: int, batch: int) -> bool:
    """Print the KV cache's size (grouped and as multi-head) and the decode step's HBM per chip."""
    from scone_jax.model.transformer import cache_bytes

    m = config.model
    cache = cache_bytes(m, batch, context)
    mha_cfg = m.copy_and_resolve_references()
    with mha_cfg.unlocked():
        mha_cfg.num_kv_heads = 0
    mha = cache_bytes(mha_cfg, batch, context)
    mem = compiled.memory_analysis()
    used = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    heads = m.num_kv_heads or m.num_heads
    print(f"{tpu.name}: {tpu.chips} chips, mesh {dict(mesh.shape)}; decode step lowered in {timings['lower_s']:.1f} s, "
          f"compiled in {timings['compile_s']:.1f} s")
    print(f"KV cache for {batch} x {context} positions ({m.num_layers} layers, {heads} key/value heads of "
          f"{m.head_dim or m.d_model // m.num_heads}, {m.dtype}): {cache / GIB:.3f} GiB; with as many key/value "
          f"heads as query heads ({m.num_heads}): {mha / GIB:.3f} GiB ({mha / cache:.0f}x)")
    print(f"decode step HBM per chip: arguments (parameters + cache) {mem.argument_size_in_bytes / GIB:.2f} GiB, "
          f"temporaries {mem.temp_size_in_bytes / GIB:.2f} GiB, total {used / GIB:.2f} of {tpu.hbm_bytes / GIB:.0f}")
    print(f"RESULT kv_cache_gib {cache / GIB:.6g}")
    print(f"RESULT kv_cache_mha_gib {mha / GIB:.6g}")
    print(f"RESULT hbm_gib_per_chip {used / GIB:.3f}")
    fits = used <= tpu.hbm_bytes
    print(f"{'FITS' if fits else 'DOES NOT FIT'}: {used / GIB:.2f} GiB of {tpu.hbm_bytes / GIB:.0f} GiB HBM per chip "
          f"on {tpu.name}")
    return fits


def report(config, tpu: Slice, devices, compiled, mesh, spec, timings) -> bool:
    """Print memory, FLOPs and predicted step time per chip; return whether it fits in HBM."""
    from scone_jax import sharding
    from scone_jax.model import accounting
    from scone_jax.training.throughput import PEAK_FLOPS

    mem = compiled.memory_analysis()
    used = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    counts = accounting.param_counts(spec.abstract[0])
    tokens = config.data.global_batch_size * config.data.seq_len
    model_flops = accounting.train_step_flops(config, spec.abstract[0], sharding.num_batch_shards(mesh))["total"]
    step_flops = model_flops / tpu.chips
    peak = PEAK_FLOPS[devices[0].device_kind]
    step_s = step_flops / peak
    fits = used <= tpu.hbm_bytes

    print(f"{tpu.name}: {tpu.chips} chips ({devices[0].device_kind}, topology {tpu.topology_name}), "
          f"mesh {dict(mesh.shape)}; lowered in {timings['lower_s']:.1f} s, compiled in {timings['compile_s']:.1f} s")
    s, m = config.scone, config.model
    scone = ""
    if s.enabled:
        fgram = accounting.param_counts(spec.abstract[0]["fgram_model"])["total"]
        source = f", from {s.init_from_hf}" if s.get("init_from_hf", "") else ""
        scone = (f" (SCONE: {fgram:,} of them the f-gram model's, {s.num_layers} layers of width "
                 f"{s.d_model or m.d_model}{source}; U = {s.fgram_capacity} f-grams per data shard)")
    print(f"model: {counts['total']:,} parameters{scone}; batch {config.data.global_batch_size} x {config.data.seq_len} "
          f"= {tokens:,} tokens; scan_layers={m.scan_layers}, remat={m.remat}, attention={m.attention}, "
          f"grad_accum_steps={config.train.grad_accum_steps}")
    print("HBM per chip (GiB):")
    for label, size in [("arguments (state + batch)", mem.argument_size_in_bytes),
                        ("outputs not aliased to arguments", mem.output_size_in_bytes - mem.alias_size_in_bytes),
                        ("temporaries (activations, gradients)", mem.temp_size_in_bytes),
                        ("generated code", mem.generated_code_size_in_bytes)]:
        print(f"  {label:38s} {size / GIB:8.2f}")
    print(f"  {'total':38s} {used / GIB:8.2f} of {tpu.hbm_bytes / GIB:.0f} ({used / tpu.hbm_bytes:.0%})")
    print(f"FLOPs per chip and step (model formula): {step_flops:.4g}", end="")
    if not m.scan_layers:  # XLA's cost analysis counts a scanned loop's body once: no use there
        xla_flops = compiled.cost_analysis()["flops"]
        print(f"; XLA {xla_flops:.4g} (XLA/formula {xla_flops / step_flops:.2f}"
              f"{'; remat recomputes' if m.remat != 'none' else ''})", end="")
    print()
    print(f"Step time at the {peak / 1e12:.0f} TFLOP/s bf16 peak: {step_s:.3g} s "
          f"({tokens / step_s:,.0f} tokens/s over the slice; a lower bound)")
    if s.enabled:  # what the export's table needs on the serving host (docs/method.md §6), in bf16
        table = s.num_fgrams * m.d_model * 2
        print(f"Exported table: {s.num_fgrams:,} f-grams x {m.d_model} x 2 bytes (bfloat16) = {table / 1e9:.1f} GB of "
              "host RAM (--table=ram) or disk (--table=disk)")
        print(f"RESULT table_gb {table / 1e9:.6g}")
    print(f"RESULT compile_s {timings['compile_s']:.1f}")
    print(f"RESULT hbm_gib_per_chip {used / GIB:.3f}")
    print(f"RESULT step_flops {step_flops:.6g}")
    print(f"RESULT predicted_step_s {step_s:.6g}")
    if used > 0.9 * tpu.hbm_bytes:
        print("Note: within 10% of HBM. XLA rematerializes on its own to squeeze a program in (more FLOPs "
              "than the formula, long compiles); --config.model.remat=save_dots usually leaves room for less work.")
    if fits:
        print(f"FITS: {used / GIB:.2f} GiB of {tpu.hbm_bytes / GIB:.0f} GiB HBM per chip on {tpu.name}")
    else:
        print(f"DOES NOT FIT: {used / GIB:.2f} GiB > {tpu.hbm_bytes / GIB:.0f} GiB HBM per chip on {tpu.name}; {_REMEDY}")
    return fits


def parse_flags(argv):
    """absl flag parsing; a bad config file, variant or --config.* key becomes one line saying
    what is valid instead of a traceback."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError, flags.Error) as e:
        print(f"aot_compile: error: {config_lib.config_flag_error(argv) or e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def report_out_of_memory(tpu: Slice, error: Exception) -> None:
    """The TPU compiler refuses programs whose temporaries alone exceed HBM: say so, with its figures."""
    message = str(error).splitlines()[0]
    print(f"{tpu.name}: the TPU compiler ran out of HBM: {message}")
    required = re.search(r"required for HLO temporaries \(([\d.]+)G\)", message)
    if required:
        print(f"RESULT hbm_gib_per_chip {float(required[1]):.3f}")
    print(f"DOES NOT FIT on {tpu.name}; {_REMEDY}")


def main(argv):
    del argv
    from jax.errors import JaxRuntimeError

    try:
        if _CONFIG.value is None or not _TOPOLOGY.value:
            raise ValueError("pass --config=configs/<name>.py[:variant] and --topology=<slice>, e.g. v5p-128")
        tpu = parse_slice(_TOPOLOGY.value)
        config = _CONFIG.value
        from scone_jax.hf import derive

        with config.unlocked():
            derive.from_config_files(config, _HF_CONFIG.value, _FGRAM_HF_CONFIG.value)
        config_lib.validate(config)
        if _DECODE_CONTEXT.value < 0 or _DECODE_BATCH.value < 1:
            raise ValueError(f"--decode_context={_DECODE_CONTEXT.value} and --decode_batch={_DECODE_BATCH.value}: "
                             "pass a context of >= 1 positions (0 = compile the train step) and >= 1 sequences.")
        if _DECODE_CONTEXT.value and config.model.vocab_size <= 0:
            raise ValueError("--decode_context builds the decoder alone, without the run's tokenizer: set "
                             "--config.model.vocab_size (e.g. 151936 for Qwen3).")
        m = config.model
        if _DECODE_CONTEXT.value and m.position == "learned" and _DECODE_CONTEXT.value > m.max_seq_len:
            raise ValueError(f"--decode_context={_DECODE_CONTEXT.value} exceeds model.max_seq_len={m.max_seq_len}, "
                             "the learned positions the model has. Fix: a shorter context, or a larger max_seq_len.")
        devices = tpu_devices(tpu)
        if _DECODE_CONTEXT.value:
            context, batch = _DECODE_CONTEXT.value, _DECODE_BATCH.value
            compiled, mesh, timings = compile_decode_step(config, devices, context, batch)
            if not report_decode(config, tpu, compiled, mesh, timings, context, batch):
                sys.exit(EXIT_DOES_NOT_FIT)
            return
        compiled, mesh, spec, timings = compile_train_step(config, devices)
    except (ValueError, OSError) as e:  # OSError: config_flags reports a missing config file late
        print(f"aot_compile: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        report_out_of_memory(tpu, e)
        sys.exit(EXIT_DOES_NOT_FIT)
    if not report(config, tpu, devices, compiled, mesh, spec, timings):
        sys.exit(EXIT_DOES_NOT_FIT)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
