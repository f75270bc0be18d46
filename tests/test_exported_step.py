"""The train step exported beside the compilation cache (training/exported_step.py): a program loaded
from the cache trains exactly like the jitted step, and whatever the program depends on is in its key."""
import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scone_jax import sharding
from scone_jax.training import exported_step, state as state_lib, steps
from tests.test_method_reference import scone_config
from tests.scone_batches import production_batch


def _setup(config):
    mesh = sharding.make_mesh(config.mesh)  # 8 virtual devices: the state and batch are sharded
    spec = state_lib.state_spec(config, mesh)
    host = production_batch(num_shards=sharding.num_batch_shards(mesh), capacity=48)[0]
    batch = sharding.global_batch(jax.tree.map(np.asarray, host.for_device()), mesh)
    return mesh, spec, batch


def _exported(config, mesh, spec, directory):
    return exported_step.ExportedTrainStep(spec.graphdef, spec.shardings, mesh, config, str(directory))


def _two_steps(step, config, spec, batch):
    """Two steps from a fresh state (each call donates its state): ([metrics of both], final state on the host)."""
    state = state_lib.init_state(config, spec)
    state, first = step(state, batch)
    state, second = step(state, batch)
    return jax.device_get([first, second]), jax.device_get(state)


def _assert_same(got, want):
    (got_metrics, got_state), (want_metrics, want_state) = got, want
    assert got_metrics == want_metrics
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
    for g, w in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _entries(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(exported_step.PREFIX))


@pytest.mark.slow  # exports, compiles and runs the SCONE train step several times: ~40 s
def test_a_step_loaded_from_the_cache_trains_like_the_jitted_step_and_a_changed_config_misses(tmp_path):
    """Two steps of the exported program, written by one start and loaded by the next, equal the jitted step's
    metrics and state bit for bit. Bugs it caught: the loaded metrics paired with names in another order than the
    export's (reversed); a key without the config, which let a run with another learning rate
    load the first run's program (it trained at the old rate)."""
    config = scone_config({})
    mesh, spec, batch = _setup(config)
    want = _two_steps(steps.make_train_step(spec.graphdef, spec.shardings, mesh, config), config, spec, batch)

    first = _exported(config, mesh, spec, tmp_path)
    _assert_same(_two_steps(first, config, spec, batch), want)
    assert not first.loaded and len(_entries(tmp_path)) == 1
    again = _exported(config, mesh, spec, tmp_path)
    _assert_same(_two_steps(again, config, spec, batch), want)
    assert again.loaded

    changed = scone_config({})
    changed.train.learning_rate = config.train.learning_rate / 2
    other = _exported(changed, mesh, spec, tmp_path)
    got = _two_steps(other, changed, spec, batch)
    assert not other.loaded and len(_entries(tmp_path)) == 2
    assert got[0][1]["learning_rate"] == want[0][1]["learning_rate"] / 2  # it trains at the new rate


@pytest.mark.slow
def test_a_damaged_or_foreign_entry_is_traced_again_and_replaced(tmp_path):
    """A truncated entry, or one whose recorded key is another program's (a hash collision, a hand-copied file),
    is a miss: the step is traced, trains right, and the entry is rewritten so the next start loads it."""
    config = scone_config({})
    mesh, spec, batch = _setup(config)
    want = _two_steps(steps.make_train_step(spec.graphdef, spec.shardings, mesh, config), config, spec, batch)
    _two_steps(_exported(config, mesh, spec, tmp_path), config, spec, batch)
    [name] = _entries(tmp_path)
    path = tmp_path / name
    whole = path.read_bytes()
    header, payload = exported_step._read(str(path))

    path.write_bytes(whole[: len(whole) // 2])
    damaged = _exported(config, mesh, spec, tmp_path)
    _assert_same(_two_steps(damaged, config, spec, batch), want)
    assert not damaged.loaded and exported_step._read(str(path))[0] == header
    exported_step.jax_export.deserialize(bytearray(exported_step._read(str(path))[1]))  # rewritten whole

    foreign_header = {**header, "material": {**header["material"], "config": {"another": "program"}}}
    exported_step._write(str(path), foreign_header, payload)
    foreign = _exported(config, mesh, spec, tmp_path)
    _assert_same(_two_steps(foreign, config, spec, batch), want)
    assert not foreign.loaded and exported_step._read(str(path))[0] == header
    restored = _exported(config, mesh, spec, tmp_path)
    _assert_same(_two_steps(restored, config, spec, batch), want)
    assert restored.loaded


@pytest.mark.slow
def test_a_step_that_cannot_be_exported_runs_jitted_and_writes_nothing(tmp_path, monkeypatch):
    """A step jax.export refuses (a custom call without a stability guarantee, say) trains as the jitted step does,
    and the cache gets no entry."""
    def refuse(_jitted, **_):
        raise ValueError("Cannot serialize code with custom calls whose targets have no compatibility guarantees")

    monkeypatch.setattr(exported_step.jax_export, "export", refuse)
    config = scone_config({})
    mesh, spec, batch = _setup(config)
    step = _exported(config, mesh, spec, tmp_path)
    _assert_same(_two_steps(step, config, spec, batch),
                 _two_steps(steps.make_train_step(spec.graphdef, spec.shardings, mesh, config), config, spec, batch))
    assert not step.loaded and _entries(tmp_path) == []


def test_the_key_names_the_source_the_config_the_mesh_and_the_arguments(tmp_path):
    """Each thing the traced program depends on changes the key (the source, the config, the arguments' shapes,
    shardings and dtypes, the mesh); a rerun of the same computes the same."""
    package = tmp_path / "pkg"
    (package / "model").mkdir(parents=True)
    (package / "model" / "a.py").write_text("x = 1\n")
    before = exported_step.source_fingerprint(str(package))
    assert exported_step.source_fingerprint(str(package)) == before
    (package / "model" / "a.py").write_text("x = 2\n")
    edited = exported_step.source_fingerprint(str(package))
    (package / "b.py").write_text("")
    assert len({before, edited, exported_step.source_fingerprint(str(package))}) == 3

    config = scone_config({})
    mesh = sharding.make_mesh(config.mesh)
    state = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharding.batch_sharding(mesh))}
    batch = {"inputs": jax.ShapeDtypeStruct((8, 16), np.int32, sharding=sharding.batch_sharding(mesh))}
    base = exported_step.entry_name(exported_step.key_material(config, mesh, state, batch))
    assert exported_step.entry_name(exported_step.key_material(config, mesh, state, batch)) == base
    changed = scone_config({})
    changed.train.weight_decay += 0.01
    longer = {"inputs": jax.ShapeDtypeStruct((8, 32), np.int32, sharding=sharding.batch_sharding(mesh))}
    replicated = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))}
    half = {"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=sharding.batch_sharding(mesh))}
    other = scone_config({})
    other.mesh.data, other.mesh.fsdp = 4, 2
    other_mesh = sharding.make_mesh(other.mesh)
    names = {exported_step.entry_name(exported_step.key_material(*args)) for args in [
        (changed, mesh, state, batch), (config, mesh, state, longer), (config, mesh, replicated, batch),
        (config, mesh, half, batch), (config, other_mesh, state, batch)]}
    assert len(names | {base}) == 6  # caught: the arguments' signature without their dtypes


def test_only_the_newest_entries_are_kept(tmp_path):
    for i in range(exported_step.KEEP + 3):
        path = tmp_path / f"{exported_step.PREFIX}{i}"
        path.write_bytes(b"x")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    (tmp_path / "jit_train_step-abc-cache").write_bytes(b"JAX's own entry")
    exported_step._prune(str(tmp_path))
    kept = [f"{exported_step.PREFIX}{i}" for i in range(3, exported_step.KEEP + 3)]
    assert _entries(tmp_path) == sorted(kept)
    assert (tmp_path / "jit_train_step-abc-cache").exists()


def _other_value(value, dotted=""):
    """Another valid value of a config key or JAX flag, of its type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    return {"train.profile_steps": "1:2", "model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
            "data.eval_sets": {"web": "/d/web/*.jsonl"},
            "data.mixture": {"web": {"files": "/d/web/*.jsonl", "weight": 1.0, "order": 0}}}.get(
        dotted, f"{value}-changed")


def test_what_the_key_leaves_out_leaves_the_traced_program_unchanged(tmp_path):
    """LOOP_ONLY_KEYS and FLAGS_OUTSIDE_PROGRAM are left out of the key, so a resume that changes them loads the
    program: here every one of them changes together and the exported StableHLO stays the same text. A name listed
    wrongly fails it: train.num_steps (the learning-rate schedule reads it) and jax_use_shardy_partitioner (the
    shardings' dialect) were tried."""
    config = scone_config({})
    mesh, spec, batch = _setup(config)
    changed = scone_config({})
    for dotted in exported_step.LOOP_ONLY_KEYS:
        section, key = dotted.split(".")
        changed[section][key] = _other_value(changed[section][key], dotted)
    flags = {name: jax.config.values[name] for name in exported_step.FLAGS_OUTSIDE_PROGRAM}
    other_flags = {name: str(tmp_path) if value is None else _other_value(value) for name, value in flags.items()}
    state = state_lib.abstract_with_shardings(spec)
    texts, materials = [], []
    for c, values in ((config, flags), (changed, other_flags)):
        try:
            for name, value in values.items():
                jax.config.update(name, value)
            step = _exported(c, mesh, spec, tmp_path / "unwritten")
            state_leaves, batch_leaves = jax.tree.leaves(state), jax.tree.leaves(batch)
            exported, _, _ = step._export(state_leaves, jax.tree.structure(spec.abstract), batch_leaves,
                                          jax.tree.structure(batch), [step._batch_sharding] * len(batch_leaves))
            texts.append(exported.mlir_module())
            materials.append(exported_step.key_material(c, mesh, state, batch))
        finally:
            for name, value in flags.items():
                jax.config.update(name, value)
    assert texts[0] == texts[1]
    assert materials[0] == materials[1]


def test_every_config_key_the_step_may_read_changes_the_key():
    """The key holds the whole config but LOOP_ONLY_KEYS, so a key added later is in it without anyone listing it:
    every other key of the config, changed alone, changes the entry's name. And every LOOP_ONLY_KEYS name is a
    config key (a misspelled one would leave the real key in and nothing would notice). Caught: the key's config
    section replaced by a list of the keys that matter (train.b2 left off)."""
    config = scone_config({})
    mesh = sharding.make_mesh(config.mesh)
    state = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharding.batch_sharding(mesh))}
    batch = {"inputs": jax.ShapeDtypeStruct((8, 16), np.int32, sharding=sharding.batch_sharding(mesh))}
    every = [f"{section}.{key}" for section in config for key in config[section]]
    assert set(exported_step.LOOP_ONLY_KEYS) <= set(every)
    base = exported_step.entry_name(exported_step.key_material(config, mesh, state, batch))
    unchanged = []
    for dotted in sorted(set(every) - set(exported_step.LOOP_ONLY_KEYS)):
        changed = _changed(config, dotted)
        if exported_step.entry_name(exported_step.key_material(changed, mesh, state, batch)) == base:
            unchanged.append(dotted)
    assert unchanged == []


def _changed(config, dotted):
    changed = copy.deepcopy(config)
    section, key = dotted.split(".")
    changed[section][key] = _other_value(changed[section][key], dotted)
    return changed


def test_every_optimizer_setting_and_dtype_changes_the_key_of_the_state_built_from_it():
    """Each optimizer setting (every train.* key the loop does not own: the delay, weight decay, betas, eps, clipping,
    the schedule's keys and any added later) and each dtype, changed alone, gives another entry, its key computed as
    a run computes it: from the state spec built from that config, not from one shared spec. Caught: the key without
    the config (the state's structure, shapes and dtypes alone: b1, b2, eps, weight decay, clipping and the schedule
    missed, and a run with another weight decay loaded the old program)."""
    config = scone_config({})
    mesh = sharding.make_mesh(config.mesh)
    batch = {"inputs": jax.ShapeDtypeStruct((8, 16), np.int32, sharding=sharding.batch_sharding(mesh))}

    def name(c):
        state = state_lib.abstract_with_shardings(state_lib.state_spec(c, mesh))
        return exported_step.entry_name(exported_step.key_material(c, mesh, state, batch))

    settings = [f"train.{key}" for key in config.train if f"train.{key}" not in exported_step.LOOP_ONLY_KEYS]
    assert {"train.fgram_model_delay_steps", "train.weight_decay", "train.b1", "train.b2", "train.eps",
            "train.grad_clip_norm", "train.learning_rate", "train.warmup_steps"} <= set(settings)
    settings += ["model.dtype", "model.param_dtype"]
    names = {dotted: name(_changed(config, dotted)) for dotted in settings}
    base = name(config)
    assert [dotted for dotted, n in names.items() if n == base] == []
    assert len(set(names.values())) == len(settings)


def test_every_jax_flag_and_xla_flags_are_in_the_key(monkeypatch):
    """The key holds every JAX flag but FLAGS_OUTSIDE_PROGRAM (read when the step is prepared, so a `with` around it
    counts) and XLA_FLAGS. Caught: the earlier fixed list of five flags, which missed jax_use_shardy_partitioner
    (it changes the exported program's shardings) and jax_numpy_dtype_promotion; the flags read once at import,
    which missed a `with jax.default_matmul_precision(...)`."""
    config = scone_config({})
    mesh = sharding.make_mesh(config.mesh)
    state = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharding.batch_sharding(mesh))}
    batch = {"inputs": jax.ShapeDtypeStruct((8, 16), np.int32, sharding=sharding.batch_sharding(mesh))}

    def name():
        return exported_step.entry_name(exported_step.key_material(config, mesh, state, batch))

    flags = exported_step.key_material(config, mesh, state, batch)["jax_flags"]
    assert set(exported_step.FLAGS_OUTSIDE_PROGRAM) <= set(jax.config.values)  # names JAX still has
    assert set(flags) == set(jax.config.values) - set(exported_step.FLAGS_OUTSIDE_PROGRAM) | {"XLA_FLAGS",
                                                                                               "LIBTPU_INIT_ARGS"}
    base = name()
    names = set()
    with jax.default_matmul_precision("highest"):
        names.add(name())
    with jax.numpy_dtype_promotion("strict"):
        names.add(name())
    shardy = jax.config.values["jax_use_shardy_partitioner"]
    try:
        jax.config.update("jax_use_shardy_partitioner", not shardy)
        names.add(name())
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    names.add(name())
    assert base not in names and len(names) == 4


@pytest.mark.slow  # compiles the SCONE step twice: ~15 s
def test_the_exported_step_donates_the_state_like_the_jitted_step(tmp_path):
    """The program the exported step runs (the object the training loop calls, lowered as it calls it) aliases the old
    state's buffers to the new state's, as the jitted step does (a pod's memory depends on it): the same argument,
    output, alias and temporary bytes. Caught: the exported step jitted without donate_argnums."""
    config = scone_config({})
    mesh, spec, batch = _setup(config)
    abstract = state_lib.abstract_with_shardings(spec)
    plain = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config).lower(abstract, batch).compile()
    step = _exported(config, mesh, spec, tmp_path)
    wrapped = step.lower(abstract, batch).compile()
    figures = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    got, want = wrapped.memory_analysis(), plain.memory_analysis()
    assert {f: getattr(got, f) for f in figures} == {f: getattr(want, f) for f in figures}
    assert want.alias_size_in_bytes > 0.9 * want.argument_size_in_bytes  # the state is most of the arguments
    state = state_lib.init_state(config, spec)
    leaves = jax.tree.leaves(state)
    step(state, batch)  # the call runs what was lowered: its state is donated
    assert all(x.is_deleted() for x in leaves)


def test_the_key_changes_with_each_traced_librarys_version_and_the_devices(monkeypatch):
    """A program traced by other library code (jax and jaxlib lower it, flax builds the model's graph, optax the
    update) or for other devices (their number, kind, platform, the processes) is another program: each of these
    changed alone gives another entry, and the same ones give the same entry. Caught: one of the libraries left out
    of _LIBRARIES (flax tried: a flax upgrade loaded the old program), and the device count left out of "devices"."""
    import importlib.metadata

    config = scone_config({})
    mesh = sharding.make_mesh(config.mesh)
    state = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharding.batch_sharding(mesh))}
    batch = {"inputs": jax.ShapeDtypeStruct((8, 16), np.int32, sharding=sharding.batch_sharding(mesh))}

    def name():
        return exported_step.entry_name(exported_step.key_material(config, mesh, state, batch))

    base = name()
    version = importlib.metadata.version
    seen = {base}
    for library in ("jax", "jaxlib", "flax", "optax"):
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda n, lib=library: version(n) + ".post1" if n == lib else version(n))
        seen.add(name())
        monkeypatch.setattr(importlib.metadata, "version", version)
    assert len(seen) == 5 and name() == base
    devices = jax.devices()

    class Device:  # another kind of device on the same platform
        platform, device_kind = devices[0].platform, "TPU v5p"

    for other in (devices[:4], devices * 2, [Device()] * len(devices)):
        monkeypatch.setattr(jax, "devices", lambda other=other: other)
        seen.add(name())
    monkeypatch.setattr(jax, "devices", lambda: devices)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    seen.add(name())
    monkeypatch.undo()
    assert len(seen) == 9 and name() == base
