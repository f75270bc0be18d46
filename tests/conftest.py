"""Test setup: 8 virtual CPU devices (before JAX starts) and parsed absl flags for grain workers."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()
