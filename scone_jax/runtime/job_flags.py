"""The flags for joining a multi-process job (coordinator, process count and id, start-up deadline), shared by
the programs that run on every host of a job (train, export).

Defined here once so that `scone_jax.main` and `scone_jax.serving.export` accept the same spelling. This
module does not import JAX: main.py parses flags before JAX starts.
"""
from __future__ import annotations

import types

from absl import flags


def define(startup_help: str = "Seconds to wait for all processes to join.") -> types.SimpleNamespace:
    """Define --coordinator_address, --num_processes, --process_id, --startup_timeout; the
    returned namespace's spec() gives the distributed.JoinSpec they describe (after parsing)."""
    coordinator = flags.DEFINE_string(
        "coordinator_address", None, "Multi-process: HOST:PORT of process 0 (not needed on Cloud TPU).")
    num_processes = flags.DEFINE_integer(
        "num_processes", None, "Multi-process: number of processes (not needed on Cloud TPU).")
    process_id = flags.DEFINE_integer("process_id", None, "Multi-process: this process's id in [0, num_processes).")
    timeout = flags.DEFINE_integer("startup_timeout", 300, startup_help)

    def spec():
        from scone_jax.runtime import distributed  # imports JAX

        return distributed.JoinSpec(coordinator.value, num_processes.value, process_id.value, timeout.value)

    return types.SimpleNamespace(spec=spec, startup_timeout=timeout)
