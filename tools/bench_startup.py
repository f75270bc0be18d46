"""How long a restarted job takes to train its first step, without and with the compilation cache.

  python tools/bench_startup.py --quick                            # the tiny config, a minute or two
  python tools/bench_startup.py --config=configs/gpt2_paper.py:128m,fgram=1x --workdir=/tmp/startup

Each figure is one `python -m scone_jax.main` process, timed from the process's start to the end of
its first step (the run's own `startup/first_step_s` record in metrics.jsonl: imports, device and
mesh set-up, checkpoint restore, the input pipeline's first batch, compilation, the step):

  1. a first run trains one step, so the workdir holds its tokenizer, f-grams and a checkpoint;
  2. cold: the compilation cache is deleted and the job restarted (it resumes and trains one step);
  3. warm: the job is restarted again with the cache the cold restart wrote;
  4. steps 2 and 3 again, `--repeats` times in all: a 2-core machine's figures vary by a second
     from run to run, so the results are the medians.

Both restarts do the same work but for tracing and compiling the train step (the cache keeps both:
training/exported_step.py), so their difference is what the cache saves.
Last lines: `RESULT first_step_s_cold`, `RESULT first_step_s_warm`, `RESULT warm_over_cold`.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from absl import flags

from scone_jax.runtime import tool_main, workdir as workdir_layout
from scone_jax.runtime.compile_cache import DEFAULT as CACHE_DIR

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "The job's --config.")
_WORKDIR = flags.DEFINE_string("workdir", "", "A workdir for the runs (emptied first); '' = a temporary one.")
_QUICK = flags.DEFINE_bool("quick", False, "The tiny config at its default size with a shorter corpus pass.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Cold and warm restarts each; the medians are reported.",
                                lower_bound=1)
_OVERRIDE = flags.DEFINE_multi_string("override", [], "Extra --config.KEY=VALUE flags for every run.")

QUICK_OVERRIDES = ["--config.model.num_layers=2", "--config.scone.num_layers=1", "--config.data.worker_count=0"]


def first_step_seconds(workdir: str) -> float:
    """The latest `startup` record's first_step_s in the workdir's metrics.jsonl."""
    with open(os.path.join(workdir, workdir_layout.METRICS)) as f:
        records = [json.loads(line) for line in f if '"startup"' in line]
    if not records:
        raise ValueError(f"{workdir}/{workdir_layout.METRICS} has no startup record: did the run train a step?")
    return records[-1]["first_step_s"]


def run_once(config: str, workdir: str, overrides: list[str], step: int, num_steps: int) -> float:
    """Train step `step` (resuming at step - 1) in a fresh process; the seconds to its end."""
    argv = [sys.executable, "-m", "scone_jax.main", f"--config={config}", f"--workdir={workdir}",
            f"--config.train.num_steps={num_steps}", "--config.train.max_steps_per_run=1", "--config.train.eval_every=0",
            "--config.train.checkpoint_every=1", *overrides]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        raise ValueError(f"the run for step {step} failed (exit {done.returncode}): "
                         f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
    seconds = first_step_seconds(workdir)
    print(f"step {step}: {seconds:.1f} s from process start to the end of the step", flush=True)
    return seconds


def main():
    config = "configs/tiny.py" if _QUICK.value else _CONFIG.value
    overrides = (QUICK_OVERRIDES if _QUICK.value else []) + [f"--config.{o}" for o in _OVERRIDE.value]
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="bench_startup-")
    shutil.rmtree(workdir, ignore_errors=True)
    cache = os.path.join(workdir, CACHE_DIR)
    num_steps = 1 + 2 * _REPEATS.value
    colds, warms = [], []
    try:
        run_once(config, workdir, overrides, 1, num_steps)  # tokenizer, f-grams, first checkpoint
        for repeat in range(_REPEATS.value):
            shutil.rmtree(cache, ignore_errors=True)
            colds.append(run_once(config, workdir, overrides, 2 + 2 * repeat, num_steps))
            if not os.listdir(cache):
                raise ValueError(f"the cold restart wrote no compilation cache into {cache}")
            warms.append(run_once(config, workdir, overrides, 3 + 2 * repeat, num_steps))
    finally:
        if not _WORKDIR.value:
            shutil.rmtree(workdir, ignore_errors=True)
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"cold: {', '.join(f'{c:.1f}' for c in colds)} s; warm: {', '.join(f'{w:.1f}' for w in warms)} s")
    print(f"RESULT first_step_s_cold {cold:.2f}")
    print(f"RESULT first_step_s_warm {warm:.2f}")
    print(f"RESULT warm_over_cold {warm / cold:.3f}")


if __name__ == "__main__":
    tool_main.run(main, "bench_startup")
