"""The train step traced once and kept beside the compilation cache (jax.export), so a restarted job
skips tracing and lowering the step as well as compiling it (docs/training.md, "Restarts").

JAX's persistent cache is keyed by the lowered program, so every start still traces the model
and lowers it before it can look the executable up: on a CPU host that is most of what a warm
restart of a small job does besides restoring, and on a pod every host does it. Here the step is
exported (StableHLO with its shardings) at the first start, written to the cache directory, and
later starts with the same program load it and compile it through the persistent cache.

The key must name everything the traced program depends on, since a stale program would train
the wrong model silently: the source of the scone_jax package, the versions of the libraries that
are traced (jax, jaxlib, flax, optax), every JAX flag (but for FLAGS_OUTSIDE_PROGRAM) and XLA's
flags, the devices and mesh, the whole config (but for the loop's own keys, LOOP_ONLY_KEYS: those whose
declaration in config_keys.py gives them the role LOOP), and the structure, shapes, dtypes and shardings
of the step's arguments. What is left out is named, and tests/test_exported_step.py checks that changing
it leaves the program unchanged; so a config key or JAX flag added later is in the key unless its
declaration says otherwise. Anything else misses and traces afresh.
A file that cannot be read, or whose recorded key differs, is a miss too (and is replaced); a step that jax.export
cannot export (a custom call without a stability guarantee) runs as a plain jitted step. Code
outside the package that changes what the step computes (an edited flax checkout with an
unchanged version, a monkeypatch) is not seen: `train.compilation_cache_dir=''` switches the cache
and this off.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import struct

import jax
from absl import logging
from jax import export as jax_export

from scone_jax import config_keys, sharding
from scone_jax.runtime import compile_cache
from scone_jax.training import steps

PREFIX = "scone-train-step-"
KEEP = 4  # newest entries kept: a few configs or code versions in one cache
_LIBRARIES = ("jax", "jaxlib", "flax", "optax")
_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")  # flags JAX passes on to XLA
# JAX flags that say where and when compiled programs are cached and what is logged, not what is traced: a
# restart that changes them (a moved workdir moves the cache) still loads the program. Every other flag is in
# the key. tests/test_exported_step.py checks that changing all of these leaves the exported program unchanged.
FLAGS_OUTSIDE_PROGRAM = (
    "jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_compilation_cache_max_size",
    "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes",
    "jax_raise_persistent_cache_errors", "jax_explain_cache_misses", "jax_log_compiles",
)
# Config keys the train step does not read (the loop's cadence, paths and switches: config_keys.LOOP): a resume that
# changes them still loads the program. Every other key is in the key. tests/test_exported_step.py checks that
# changing all of these leaves the exported program unchanged.
LOOP_ONLY_KEYS = config_keys.LOOP_ONLY_KEYS
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_fingerprint(package_dir: str = _PACKAGE_DIR) -> str:
    """sha256 over every .py file of the package (relative path and bytes, in path order)."""
    digest = hashlib.sha256()
    paths = []
    for root, dirs, names in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        paths += [os.path.join(root, n) for n in names if n.endswith(".py")]
    for path in sorted(paths):
        digest.update(os.path.relpath(path, package_dir).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def _signature(tree) -> dict:
    leaves, treedef = jax.tree.flatten(tree)
    return {"tree": str(treedef),
            "leaves": [[list(x.shape), str(x.dtype), str(getattr(x.sharding, "spec", x.sharding))] for x in leaves]}


def _program_config(config) -> dict:
    """The whole config but LOOP_ONLY_KEYS."""
    values = json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))
    for dotted in LOOP_ONLY_KEYS:
        section, key = dotted.split(".")
        values.get(section, {}).pop(key, None)
    return values


def _program_flags() -> dict:
    """Every JAX flag's current value (a `with jax.default_matmul_precision(...)` included) but
    FLAGS_OUTSIDE_PROGRAM, and XLA's flags from the environment."""
    flags = {name: str(value) for name, value in jax.config.values.items() if name not in FLAGS_OUTSIDE_PROGRAM}
    return flags | {name: os.environ.get(name, "") for name in _ENVIRONMENT}


def key_material(config, mesh, state, batch) -> dict:
    """What the traced step depends on (module docstring): equal material, equal program."""
    devices = jax.devices()
    return {
        "source": source_fingerprint(),
        "libraries": {name: importlib.metadata.version(name) for name in _LIBRARIES},
        "jax_flags": _program_flags(),
        "devices": [devices[0].platform, devices[0].device_kind, len(devices), jax.process_count()],
        "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
        "config": _program_config(config),
        "state": _signature(state),
        "batch": _signature(batch),
    }


def entry_name(material: dict) -> str:
    return PREFIX + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:40]


def _write(path: str, header: dict, payload: bytes) -> None:
    """Header length (8 bytes), the header as JSON, the serialized export; atomically (rename)."""
    head = json.dumps(header, sort_keys=True).encode()
    tmp = compile_cache.temporary_path(path)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + payload)
    os.replace(tmp, path)


def _read(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _prune(directory: str, keep: int = KEEP) -> None:
    """Remove all but the `keep` newest entries (the others belong to earlier code or configs)."""
    entries = [os.path.join(directory, n) for n in os.listdir(directory)
               if n.startswith(PREFIX) and compile_cache.TEMPORARY not in n]
    for path in sorted(entries, key=os.path.getmtime, reverse=True)[keep:]:
        try:
            os.remove(path)
        except OSError:
            pass


class ExportedTrainStep:
    """step(state, batch) -> (state, metrics) like steps.make_train_step's, from the exported program in
    `directory` when one with this key is there, else exported now (and written there by process 0).

    `loaded` says, after the first call, whether the program came from the directory. `lower(state, batch)`
    lowers the program that calls run, as a jitted step's `lower` does."""

    def __init__(self, graphdef, state_shardings, mesh, config, directory: str):
        self._graphdef, self._mesh, self._config, self._directory = graphdef, mesh, config, directory
        self._tree_shardings = state_shardings
        self._state_shardings = jax.tree.leaves(state_shardings)
        self._batch_sharding = sharding.batch_sharding(mesh)
        self._run, self._compiled = None, False
        self.loaded = False

    def __call__(self, state, batch):
        if not self._compiled:
            # Compiled first, so that a cache entry holding another program is a miss (compile_cache.compile);
            # the call below finds this executable in JAX's memory.
            compile_cache.compile(self.lower(state, batch))
            self._compiled = True
        return self._run(state, batch)

    def lower(self, state, batch):
        """The step's program for `state` and `batch` (arrays, or ShapeDtypeStructs with shardings), lowered."""
        if self._run is None:
            self._run = self._prepare(state, batch)
        return self._run.lower(state, batch)

    def _prepare(self, state, batch):
        """The step, step(state, batch) with step.lower(state, batch), from the cache or exported now."""
        state_leaves, state_tree = jax.tree.flatten(state)
        batch_leaves, batch_tree = jax.tree.flatten(batch)
        if len(state_leaves) != len(self._state_shardings):
            raise ValueError(f"the train state has {len(state_leaves)} arrays, its shardings {len(self._state_shardings)}")
        batch_shardings = [self._batch_sharding] * len(batch_leaves)
        material = key_material(self._config, self._mesh, state, batch)
        path = os.path.join(self._directory, entry_name(material))
        exported, metric_names = self._load(path, material)
        if exported is None:
            exported, metric_names, payload = self._export(state_leaves, state_tree, batch_leaves, batch_tree,
                                                           batch_shardings)
            if exported is None:  # not exportable: the plain jitted step
                return steps.make_train_step(self._graphdef, self._tree_shardings, self._mesh, self._config)
            if jax.process_index() == 0:
                self._save(path, material, metric_names, payload)

        def train_step(state_leaves, batch_leaves):  # named: the cache entry and profiles say jit_train_step
            return exported.call(state_leaves, batch_leaves)

        run = sharding.under_mesh(self._mesh, self._jit_flat(train_step, batch_shardings))

        def step(state, batch):
            new_leaves, metrics = run(jax.tree.leaves(state), jax.tree.leaves(batch))
            return state_tree.unflatten(new_leaves), dict(zip(metric_names, metrics))

        step.lower = lambda state, batch: run.lower(jax.tree.leaves(state), jax.tree.leaves(batch))
        return step

    def _jit_flat(self, fn, batch_shardings):
        """`fn(state_leaves, batch_leaves) -> (state_leaves, metrics)` jitted as steps.make_train_step jits the step."""
        return jax.jit(fn, in_shardings=(self._state_shardings, batch_shardings),
                       out_shardings=(self._state_shardings, None), donate_argnums=0)

    def _load(self, path: str, material: dict):
        """(exported, metric names) from `path` if it holds this key's program, else (None, None)."""
        if not os.path.exists(path):
            return None, None
        try:
            header, payload = _read(path)
            if header.get("material") != material:
                logging.warning("Exported train step %s was written for another program; tracing the step again", path)
                return None, None
            exported = jax_export.deserialize(bytearray(payload))
        except Exception as e:  # noqa: BLE001 - a damaged entry is a miss: the step is traced again and replaces it
            logging.warning("Exported train step %s cannot be read (%s: %s); tracing the step again",
                            path, type(e).__name__, e)
            return None, None
        self.loaded = True
        logging.info("Train step: the traced program loaded from %s (not traced again)", path)
        return exported, header["metrics"]

    def _export(self, state_leaves, state_tree, batch_leaves, batch_tree, batch_shardings):
        """Trace and lower the step over flat argument lists (jax.export serializes no custom pytree nodes)."""
        names = []
        step_fn = steps.train_step_fn(self._graphdef, self._mesh, self._config)

        def flat_step(state_leaves, batch_leaves):
            new_state, metrics = step_fn(state_tree.unflatten(state_leaves), batch_tree.unflatten(batch_leaves))
            new_leaves, new_tree = jax.tree.flatten(new_state)
            if new_tree != state_tree:
                raise ValueError("the train step returned a state of another structure than it was given")
            names[:] = sorted(metrics)
            return new_leaves, [metrics[k] for k in names]

        abstract = (sharding.sharded_abstract(state_leaves, self._state_shardings),
                    sharding.sharded_abstract(batch_leaves, batch_shardings))
        try:
            with jax.set_mesh(self._mesh):
                exported = jax_export.export(self._jit_flat(flat_step, batch_shardings))(*abstract)
            payload = bytes(exported.serialize())
        except Exception as e:  # noqa: BLE001 - a real error in the step also fails the plain jit, where it is raised
            logging.warning("The train step cannot be exported (%s: %s); it is traced at every start",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None, None, None
        return exported, list(names), payload

    def _save(self, path: str, material: dict, metric_names: list, payload: bytes) -> None:
        try:
            _write(path, {"material": material, "metrics": metric_names}, payload)
            _prune(self._directory)
        except OSError as e:  # a full or read-only cache costs the next start a trace, not this run
            logging.warning("Could not write the exported train step to %s: %s", path, e)
