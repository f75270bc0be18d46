"""Small configs and synthetic batches shared by the tests."""
import os
import subprocess
import sys

import numpy as np

from scone_jax.batch import Batch
from scone_jax.config import base_config

# An XLA flag of every JAX process of the suite (conftest.py sets it for the test processes, xla_flags for the jobs
# they start): the tests compile far more than they run, and LLVM's optimisation of the CPU code is most of a
# compile (the same tests took 27% less CPU without it). The programs are the same HLO; only the machine code is
# less optimised, so results agree with an optimised build's to float rounding, never more.
FAST_COMPILE = "--xla_backend_optimization_level=0"
# run_tool's env for a job that runs more than it compiles (a whole --quick study: hundreds of steps, exports and
# evaluations of a few programs each): there the optimised code is the cheaper (bench_quality's: 242 -> 187 CPU
# seconds, bench_finetune's: 386 -> 298), with the same results to the last digit printed.
OPTIMISED = {"XLA_FLAGS": ""}


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a JAX process a test starts: FAST_COMPILE, and `devices` virtual CPU devices if given."""
    return FAST_COMPILE + ("" if devices is None else f" --xla_force_host_platform_device_count={devices}")


def small_config(**model_overrides):
    """A 2-layer, 64-wide model on the embedded corpus with a 512-piece tokenizer."""
    c = base_config()
    c.model.update(dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, d_ff=128, max_seq_len=32))
    c.model.update(model_overrides)
    c.data.update(dict(seq_len=32, global_batch_size=16, vocab_size=512, worker_count=0))  # tests pick workers
    c.train.update(dict(num_steps=6, warmup_steps=2, learning_rate=3e-3, log_every=2, eval_every=0,
                        checkpoint_every=3, eval_batches=2))
    c.mesh.data = -1
    c.lock()
    return c


def config_with(tokenizer_path, model=None, **train_overrides):
    """small_config (with `model`'s overrides) reading the session's tokenizer, its train section overridden."""
    config = small_config(**(model or {}))
    config.data.tokenizer_path = tokenizer_path
    config.train.update(train_overrides)
    return config


def largest(tree) -> float:
    """max |x| over every array of a tree (the `scale` of assert_sums_close for gradient trees)."""
    import jax
    return max(float(np.abs(np.asarray(x)).max(initial=0.0)) for x in jax.tree.leaves(tree))


def random_batch(batch=16, seq=32, vocab=512, seed=0):
    """A batch with two packed documents per row, as the pipeline produces."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, (batch, seq + 1)).astype(np.int32)
    split = seq // 3
    segments = np.where(np.arange(seq) < split, 1, 2).astype(np.int32)[None].repeat(batch, 0)
    positions = np.where(np.arange(seq) < split, np.arange(seq), np.arange(seq) - split)
    mask = np.ones((batch, seq), np.float32)
    mask[:, split - 1] = 0  # a document's last input has no target inside the document
    return Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segments,
                 positions=positions.astype(np.int32)[None].repeat(batch, 0), loss_mask=mask)


FP32_EPS = float(np.finfo(np.float32).eps)


def assert_sums_close(got, want, terms: int, scale: float | None = None, err_msg: str = ""):
    """`got` == `want` up to fp32 rounding of sums of `terms` terms taken in another order (another batch
    split, layer layout, mesh or remat policy). Such a sum's rounding error is a few sqrt(terms) ulps of its
    terms' magnitude; we allow 8 * sqrt(terms) * eps * scale on every element, so the bound follows the
    reduction it guards instead of being one fixed atol for every array. `scale` bounds the terms: by
    default max|want|, but a sum that cancels (a gradient that is zero in exact arithmetic, like the key
    bias's) has terms far larger than its result: pass the largest value of the whole tree then."""
    want = np.asarray(want, np.float64)
    scale = np.abs(want).max(initial=0.0) if scale is None else scale
    atol = 8 * np.sqrt(terms) * FP32_EPS * max(scale, np.finfo(np.float32).tiny)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=atol, err_msg=err_msg)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(script: str, args, timeout: float = 600, env: dict | None = None):
    """`python <script> <args>` (a tools/ script, or `-m module`) from the repository root, as a user runs it:
    on the CPU's one device (not the suite's 8 virtual ones), `env` over that environment; the CompletedProcess
    with text stdout and stderr."""
    command = [sys.executable, *script.split(), *map(str, args)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "XLA_FLAGS": xla_flags(), **(env or {})}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def training_graph_eval(config, tokenizer, state, mesh, batcher=None) -> dict:
    """The training loop's held-out evaluation of `state` (a train state) over config.data's eval split as one
    set: the eval step training uses, the f-gram model (if any) run on the fly through `batcher`'s rows."""
    import functools

    import jax

    from scone_jax.data import pipeline
    from scone_jax.training import evaluation, state as state_lib, steps

    spec = state_lib.state_spec(config, mesh)
    batches = pipeline.make_eval_batches(config.data, tokenizer, process_index=jax.process_index(),
                                         process_count=jax.process_count())
    step = functools.partial(steps.make_eval_step(spec.model_graphdef, spec.model_shardings, mesh), state[0])
    return evaluation.evaluate(step, batches, mesh, rows=batcher, max_batches=config.train.eval_batches)


def record_list(workdir: str, split: str = "step") -> list:
    """The workdir's metrics.jsonl records of one split ('step' or 'eval'), in file order (a step recorded
    twice shows twice); [] before the file exists, and a last line still being written is skipped."""
    import json

    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in (json.loads(line) for line in f if line.endswith("\n")) if r["split"] == split]


def step_records(workdir: str, split: str = "step") -> dict:
    """{step: record} of record_list."""
    return {r["step"]: r for r in record_list(workdir, split)}


def run_main(workdir, *args, config: str = "tests/small_config.py", devices: int = 8,
             file_size_limit_kb: int | None = None, timeout: float = 600, platforms: str | None = "cpu"):
    """`python -m scone_jax.main` in a new process on `devices` virtual CPU devices (CompletedProcess, text);
    `file_size_limit_kb` runs it under `ulimit -f` (bash, kB); `platforms=None` leaves JAX_PLATFORMS unset, as a
    user does (JAX then tries every backend installed, libtpu's included)."""
    env = {**os.environ, "JAX_PLATFORMS": platforms, "XLA_FLAGS": xla_flags(devices)}
    if platforms is None:
        del env["JAX_PLATFORMS"]
    command = [sys.executable, "-m", "scone_jax.main", f"--config={config}", f"--workdir={workdir}", *map(str, args)]
    if file_size_limit_kb is not None:
        command = ["bash", "-c", f'ulimit -f {file_size_limit_kb} && exec "$@"', "bash", *command]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A TCP port free on loopback right now (for a coordinator or a server the test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_report(results: list) -> str:
    """Every process's status and stderr, stack dumps left out (the faulthandler's and the C++ log's frames): when
    one process of a job fails, the cause is usually another process's one line, which a tail would not show."""
    dump = ("  File ", "    @ ", "Thread 0x", "Current thread 0x", "Extension modules", "*** ")
    parts = []
    for i, r in enumerate(results):
        lines = [line for line in r.stderr.splitlines() if not line.startswith(dump)]
        parts.append(f"--- process {i}: status {r.returncode}\n" + "\n".join(lines[-40:]))
    return "\n".join(parts)


def main_process_argv(tokenizer_path, port, process_id, num_processes, *extra) -> list:
    """argv of one process of a multi-process `python -m scone_jax.main` job on loopback (the tests'
    small config, its tokenizer)."""
    return [sys.executable, "-m", "scone_jax.main", f"--config=tests/small_config.py:{tokenizer_path}",
            f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
            f"--process_id={process_id}", *extra]


def run_processes(argvs: list, timeout: float = 240, devices: int = 4) -> list:
    """Start every argv at once (`devices` virtual CPU devices each); kill all of them if any outlives
    `timeout` (a whole two-process run takes ~30 s: far below that, far above "hung"). CompletedProcesses."""
    import time

    env = {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(a, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argvs]
    deadline, results = time.monotonic() + timeout, []
    try:
        for argv, p in zip(argvs, procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
