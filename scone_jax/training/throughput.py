"""Tokens/s, ETA and MFU for progress lines; the FLOP formula is in model/accounting.py."""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


_IMPORTED = time.time()


def process_uptime_s() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere: since this module's import)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def measured_cpu_flops(size: int = 1024, trials: int = 5) -> float:
    """Best FLOP/s of XLA's fp32 matmul on this host (CPUs have no spec-sheet peak to quote). At 1024
    it takes about 0.15 s of every start on 2 cores (2048: 0.7 s) and reads 10-15% higher, so MFU errs low."""
    matmul = jax.jit(lambda a: a @ a)
    a = jax.device_put(jnp.ones((size, size), jnp.float32), jax.devices("cpu")[0])
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_device(configured: float = 0.0) -> float:
    if configured > 0:
        return configured
    device = jax.devices()[0]
    if device.platform == "cpu":
        return measured_cpu_flops() / jax.local_device_count()  # virtual devices share the cores
    for prefix, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if device.device_kind.startswith(prefix):
            return flops
    return 0.0  # unknown chip: MFU is reported as 0


class Throughput:
    """Rates over the interval since the previous `update` call."""

    def __init__(self, total_steps: int, start_step: int, flops_per_step: float, peak_flops_total: float):
        self.total_steps = total_steps
        self.flops_per_step = flops_per_step
        self.peak = peak_flops_total
        self._last_time = time.perf_counter()
        self._last_step = start_step

    def update(self, step: int, tokens: float) -> dict:
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        steps = max(step - self._last_step, 1)
        self._last_time, self._last_step = now, step
        tokens_per_s = tokens / elapsed
        return {
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed / steps,
            "eta_s": (self.total_steps - step) * elapsed / steps,
            "mfu": self.flops_per_step * steps / elapsed / self.peak if self.peak else 0.0,
        }
