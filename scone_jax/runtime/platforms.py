"""libtpu kept out of a profiled job on a machine without a TPU, so that jax.profiler works there.

With JAX_PLATFORMS unset JAX tries every backend it knows. Where libtpu is installed (our [test] and [aot]
extras install it, to compile for TPU on a CPU host) a job on a machine without a TPU therefore loads
libtpu, which finds no chip, and runs on the CPU; but loading it registered libtpu's profiler with jaxlib.
jax.profiler.start_trace then starts that profiler too. libtpu 0.0.52's profiler interface is newer than
the one jax 0.10.2's jaxlib knows (104 bytes against 80; jax[tpu] pairs jax 0.10.2 with libtpu 0.0.42):
jaxlib logs "Unexpected PLUGIN_Profiler_Api size: expected 80, got 104" and then calls into the interface
it refused, a segmentation fault (exit 139). Nothing can unregister it once loaded, so:

- `skip_absent_tpu()` (called by the main job once its modules are imported, before JAX starts its backends:
  a module imported after it that registers TPU lowering rules would find no TPU platform) drops JAX's TPU
  backend where no TPU is attached, as JAX itself drops CUDA where no NVIDIA device is visible (it also spares
  the job libtpu's dozen lines of warnings about the chip it did not find);
- `libtpu_loaded_off_tpu()` tells train.run that libtpu is loaded in a process that does not run on a TPU
  (JAX started before the skip: train.run called from Python), so that profiling is refused in one line.
"""
from __future__ import annotations

import glob
import importlib.util
import os


def tpu_attached() -> bool:
    """Whether this machine may have a TPU: a Google TPU on its PCI bus (JAX's own table of chips) or the
    device files TPUs appear as (/dev/accel* up to v4, /dev/vfio/<n> from v5e). Errs towards yes."""
    try:
        from jax._src import hardware_utils

        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return True
    except (OSError, ImportError, AttributeError):  # an unreadable sysfs, or a JAX that moved the helper
        return True
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def skip_absent_tpu() -> bool:
    """Before JAX's backends start: drop its TPU backend if libtpu is installed, no TPU is attached and the user
    left the choice to JAX (JAX_PLATFORMS unset, no JAX_FORCE_TPU_INIT). Returns whether it did."""
    import jax
    from jax._src import xla_bridge

    factories = getattr(xla_bridge, "_backend_factories", None)  # JAX's own; left alone if it changes shape
    started = getattr(xla_bridge, "backends_are_initialized", lambda: True)
    if (jax.config.jax_platforms or os.environ.get("JAX_FORCE_TPU_INIT") or not isinstance(factories, dict)
            or "tpu" not in factories or importlib.util.find_spec("libtpu") is None or started()
            or tpu_attached()):
        return False
    del factories["tpu"]
    return True


def libtpu_loaded_off_tpu() -> bool:
    """Whether this process loaded libtpu although JAX runs it on another backend (starts JAX's backends)."""
    import jax

    try:
        from jax._src.lib import xla_client
    except ImportError:  # a JAX that moved it: nothing to tell
        return False
    loaded = getattr(xla_client, "pjrt_plugin_loaded", None)
    return jax.default_backend() != "tpu" and loaded is not None and bool(loaded("tpu"))
