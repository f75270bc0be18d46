"""One quality study's runs (tools/bench_quality.py's protocol): the config each arm trains with, and
training, exporting and scoring one run the way a user does (`python -m scone_jax.main`, serving.export,
serving.evaluate), with its record, FLOPs and progress."""
from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np

from scone_jax.config import load_config_file, set_overrides
from scone_jax.data import pipeline
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.matcher import Matcher
from scone_jax.model import accounting
from scone_jax.runtime import workdir as workdir_layout
from scone_jax.serving import bundle
from scone_jax.study import runs as study_runs
from scone_jax.study.protocol import planned_keys, variant
from scone_jax.study.runs import REPO, run_cli
from scone_jax.training import assets, capacity, state as state_lib

CONFIG = os.path.join(REPO, "configs", "quality.py")
ARMS = ("baseline", "baseline_2x", "baseline_short", "baseline_4x", "scone", "scone_short", "scone_fgram0.5x",
        "scone_fgram2x", "scone_s5k",
        "scone_s100k", "scone_k3", "oe", "oe_5x", "engram")
SWEPT = ("baseline", "scone", "oe", "engram")  # the arms whose learning rate is swept: their family's (protocol.family)
MAIN_ARMS = ("baseline", "scone", "baseline_2x", "oe", "oe_5x", "engram")  # trained for --tokens; the others for
#                                                                            --ablation_tokens


def parse_rates(values: list[str]) -> list[str]:
    """--learning_rates as canonical strings (str(float)), lowest first; ValueError naming the flag."""
    rates = set()
    for text in values:
        try:
            rate = float(text)
        except ValueError:
            rate = float("nan")
        if not 0 < rate < float("inf"):
            raise ValueError(f"--learning_rates={','.join(values)}: {text!r} is not a positive learning rate. Fix: "
                             "write numbers, e.g. --learning_rates=5e-4,1e-3,2e-3.")
        rates.add(str(rate))
    if not rates:
        raise ValueError("--learning_rates is empty. Fix: e.g. --learning_rates=5e-4,1e-3,2e-3.")
    return sorted(rates, key=float)


def parse_tokens(text: str) -> int:
    scale = {"k": 10**3, "m": 10**6, "b": 10**9}.get(text[-1:].lower(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ValueError(f"{text!r} is not a token count; write e.g. 3m or 500000.") from None


class Study:
    """The runs of one invocation and where their results go (module docstring)."""

    def __init__(self, root: str, arms: list[str], tokens: int, ablation_tokens: int, rates: list[str],
                 data: dict, test_files: str, quick: bool, overrides: dict):
        self.root, self.arms, self.rates, self.data, self.quick = root, arms, rates, data, quick
        self.test_files = test_files  # never part of a run's config: nothing in training can see it
        self.budget = {a: tokens if a in MAIN_ARMS else ablation_tokens for a in arms}
        quick_settings = {"data.seq_len": 64, "model.max_seq_len": 64, "data.global_batch_size": 8,
                          "data.vocab_size": 1024} if quick else {}
        self.overrides = {**quick_settings, **overrides}  # dotted key -> typed value; the user's --config.* win
        self.results_path = os.path.join(root, "results.json")
        self.load_results()
        self.started, self.tokens_done = time.time(), 0
        self.skipped = set()  # (arm, rate) runs the sweep rule left out

    def load_results(self):
        """The runs and arms WORKDIR/results.json holds (none yet: empty), read again once the study owns WORKDIR."""
        self.results = study_runs.read_json(self.results_path) or {"runs": {}, "arms": {}}

    # --- configs -----------------------------------------------------------------------------------
    def config_arg(self, arm: str) -> str:
        """The main job's --config for `arm` (a study of another config file overrides it: study/finetune.py)."""
        return f"{CONFIG}:{variant(arm)}"

    def config(self, arm: str, rate: str | None = None, extra: dict | None = None, tokenizer=None):
        config = load_config_file(self.config_arg(arm))
        with config.unlocked():
            set_overrides(config, self.overrides)
            config.data.update(self.data)
            rows = config.data.global_batch_size * config.data.seq_len
            t = config.train
            t.num_steps = max(1, -(-self.budget[arm] // rows))  # at least the budget
            t.warmup_steps = max(1, t.num_steps // 20)
            t.log_every = max(1, min(50, t.num_steps // 20))
            t.eval_every = t.num_steps
            t.checkpoint_every = max(1, min(200, t.num_steps))
            if rate is not None:
                t.learning_rate = float(rate)
            set_overrides(config, extra or {})
        if tokenizer is not None:
            assets.resolve_vocab_size(config, tokenizer)
        return config

    def flags_for(self, config, arm: str) -> list[str]:
        """The main job's command line for this arm: the variant plus every key the study sets."""
        flat = _flatten(config.to_dict())
        base = _flatten(load_config_file(self.config_arg(arm)).to_dict())
        return [f"--config.{k}={v}" for k, v in flat.items() if base.get(k) != v]

    # --- progress ----------------------------------------------------------------------------------
    def progress(self, planned: list[tuple[str, str | None]]) -> str:
        keys = planned_keys([p for p in planned if p not in self.skipped], self.results["runs"], self.rates)
        todo = [k for k in keys if k not in self.results["runs"]]
        left = sum(self.budget[k.split("/lr")[0]] for k in todo)
        elapsed = time.time() - self.started
        rate = self.tokens_done / elapsed if self.tokens_done else 0
        eta = f"{left / rate / 60:.0f} min" if rate else "?"
        return f"{len(keys) - len(todo)}/{len(keys)} runs done, {left / 1e6:.1f}M tokens left, ETA {eta}"

    def run_dir(self, arm: str, rate: str) -> str:
        """WORKDIR/<arm>/lr<rate>: the main job's workdir of one run."""
        return os.path.join(self.root, arm, f"lr{rate}")

    def save(self, record: str):
        write_json(self.results_path, self.results)
        if record:
            write_json(record, self.results)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_json(path: str, value):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def fgram_capacity(config, tokenizer, vocab) -> int:
    """Rows per step the f-gram model needs (maximal unique f-grams of a whole batch) over a sample of the run's
    batches (training/capacity.py), with its headroom. A batch that needs more still fails loudly; the study then
    raises the capacity and resumes (run_arm)."""
    rows = config.data.global_batch_size * config.data.seq_len
    batcher = FgramBatcher(Matcher(vocab), vocab, num_shards=1, capacity=rows)
    build = pipeline.batch_builder(config.data, tokenizer)
    need, _ = capacity.needed(batcher, build, capacity.sample_batches(0, config.train.num_steps - 1))
    return capacity.suggested(need)


def fgram_settings(study: Study, config, tokenizer) -> dict:
    """The f-gram vocabulary and capacity a SCONE run of `study` trains with, as config overrides: the vocabulary
    counted once per (S, K) into WORKDIR/fgrams_s<S>_k<K> on the run's training data, the capacity measured once
    per rows per step (fgram_capacity) and kept beside it."""
    vocab_dir = os.path.join(study.root, f"fgrams_s{config.scone.num_fgrams}_k{config.scone.max_len}")
    vocab = assets.ensure_vocab(config.scone, config.data, tokenizer, vocab_dir)
    rows = config.data.global_batch_size * config.data.seq_len
    saved = study_runs.read_json(os.path.join(vocab_dir, "capacity.json"))
    if saved is None or saved["rows"] != rows:
        saved = {"capacity": fgram_capacity(config, tokenizer, vocab), "rows": rows}
        write_json(os.path.join(vocab_dir, "capacity.json"), saved)
    return {"scone.vocab_path": os.path.join(vocab_dir, "fgrams"), "scone.fgram_capacity": saved["capacity"]}


def flops(config) -> tuple[float, float, int]:
    """(inference FLOPs per token of the served decoder, training FLOPs of the whole run, the served decoder's
    parameter bytes): the model formula of scone_jax/model/accounting.py; inference is one forward pass (a third of
    training's 6N) through the decoder, whose input at matched positions is a table row (no f-gram model at
    inference) and, with Over-Encoding, the projection of its n-gram rows; with Engram, its projections,
    convolution and gates. The bytes are what the accelerator holds of the model at serving: the decoder as exported
    (model.param_dtype), Over-Encoding's or Engram's tables among them, SCONE's f-gram table not (host RAM or
    disk)."""
    from flax import nnx

    abstract = nnx.state(nnx.eval_shape(lambda: state_lib.build_model(config)), nnx.Param)
    decoder = abstract["decoder"] if config.scone.enabled else abstract
    per_token = accounting.decoder_flops_per_token(config.model, config.data.seq_len,
                                                   accounting.param_counts(decoder)["non_embedding"],
                                                   config.get("engram"))
    step = accounting.train_step_flops(config, abstract, 1)["total"]
    return per_token / 3.0, step * config.train.num_steps, accounting.param_bytes(decoder)


def train_tokens_per_s(metrics: list[dict]) -> float:
    """The run's training throughput from its metrics.jsonl records: the median tokens/s of its log lines, leaving
    out the first after each start (it holds compilation) unless nothing else is left."""
    steady, every, first = [], [], True
    for m in metrics:
        if m.get("split") == "startup":  # a process started: its first log line timed its compilation too
            first = True
        elif m.get("split") == "train" and "tokens_per_s" in m:
            every.append(m["tokens_per_s"])
            if not first:
                steady.append(m["tokens_per_s"])
            first = False
    return float(np.median(steady or every or [0.0]))


# --- running one arm ----------------------------------------------------------------------------------

class RunNotFinished(ValueError):
    """A training job ended (exit 0) before its last step: nothing of it is recorded; a rerun resumes it."""


def run_arm(study: Study, arm: str, rate: str, config, tokenizer, planned) -> dict:
    """Train (or resume) one run, export it and score it on the test split; returns its record."""
    key = f"{arm}/lr{rate}"
    workdir = study.run_dir(arm, rate)
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(workdir, "train.log")
    start = time.time()
    print(f"[{key}] training {config.train.num_steps:,} steps ({study.budget[arm] / 1e6:.1f}M tokens) in {workdir}; "
          f"{study.progress(planned)}", flush=True)

    def show(line):
        if " step " in line and " loss " in line or "eval step" in line:
            print(f"[{key}] " + line.split("] ", 1)[-1], flush=True)

    for _ in range(4):  # a capacity overflow: raise it and resume from the checkpoint the run saved
        rc, last = run_cli(["-m", "scone_jax.main", f"--config={study.config_arg(arm)}", f"--workdir={workdir}",
                            *study.flags_for(config, arm)], log, show)
        if rc == 0:
            break
        if "scone.fgram_capacity" in last and config.scone.enabled:
            with config.unlocked():
                config.scone.fgram_capacity = int(config.scone.fgram_capacity * 1.5 // 128 * 128)
            print(f"[{key}] capacity overflow; resuming with scone.fgram_capacity={config.scone.fgram_capacity}")
            continue
        raise RuntimeError(f"training {key} failed (exit {rc}): {last} (log: {log})")
    else:
        raise RuntimeError(f"training {key} kept overflowing scone.fgram_capacity (log: {log})")
    why = study_runs.unfinished(workdir, config.train.num_steps)
    if why:  # e.g. train.max_steps_per_run: the job exits 0 at that step
        raise RunNotFinished(f"{key} stopped before finishing ({why}), so it was not exported, scored or recorded. "
                             f"Rerun the same command to resume it (log: {log}).")
    trained = time.time() - start
    metrics = [json.loads(x) for x in open(os.path.join(workdir, workdir_layout.METRICS))]
    validation = [m for m in metrics if m.get("split") == "eval"][-1]
    export = os.path.join(workdir, "export")
    rc, last = run_cli(["-m", "scone_jax.serving.export", f"--workdir={workdir}", f"--output={export}"], log,
                       lambda _: None)
    if rc:
        raise RuntimeError(f"exporting {key} failed (exit {rc}): {last} (log: {log})")
    result_path = os.path.join(workdir, "test_eval.json")
    rc, last = run_cli(["-m", "scone_jax.serving.evaluate", f"--export={export}", f"--result={result_path}",
                        f"--config.data.eval_files={study.test_files}"], log, lambda _: None)
    if rc:
        raise RuntimeError(f"evaluating {key} failed (exit {rc}): {last} (log: {log})")
    test = study_runs.read_json(result_path)
    inference, train_flops, accelerator_bytes = flops(config)
    table = bundle.read_export_meta(export)
    record = {
        "arm": arm, "learning_rate": float(rate), "tokens": config.train.num_steps * config.data.global_batch_size
        * config.data.seq_len, "steps": config.train.num_steps, "validation_ppl": validation["perplexity"],
        "test_ppl": test["perplexity"], "test_bits_per_byte": test["bits_per_byte"], "test_tokens": test["tokens"],
        "hit_rate": test["hit_rate"], "inference_flops_per_token": inference, "train_flops": train_flops,
        "fgram_capacity": config.scone.fgram_capacity if config.scone.enabled else 0,
        "train_seconds": round(trained, 1), "commit": _commit(), "accelerator_bytes": accelerator_bytes,
        "host_table_bytes": table["num_fgrams"] * table["d_model"] * bundle.numpy_dtype(table["dtype"]).itemsize,
        "train_tokens_per_s": train_tokens_per_s(metrics),
    }
    study.tokens_done += study.budget[arm]
    study.results["runs"][key] = record
    print(f"[{key}] validation ppl {record['validation_ppl']:.2f}, test ppl {record['test_ppl']:.2f} "
          f"({trained / 60:.1f} min); {study.progress(planned)}", flush=True)
    return record


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except OSError:
        return ""


ARM_LABELS = {
    "baseline": "baseline (2 blocks)", "baseline_2x": "baseline, 4 blocks", "baseline_4x": "baseline, 8 blocks",
    "baseline_short": "baseline (2 blocks), ablation budget", "scone_short": "SCONE 1x, ablation budget",
    "scone": "SCONE, f-gram model 2 blocks (1x), S = 20k, K = 5", "scone_fgram0.5x": "SCONE, f-gram model 1 block (0.5x)",
    "scone_fgram2x": "SCONE, f-gram model 4 blocks (2x)", "scone_s5k": "SCONE, S = 5k", "scone_s100k": "SCONE, S = 100k",
    "scone_k3": "SCONE, K = 3", "oe": "Over-Encoding, n = 3, k = 4, m = 20k (about SCONE's table size)",
    "oe_5x": "Over-Encoding, m = 100k (5x)",
    "engram": "Engram before block 1, n = 3, 4 heads x 2 orders of 20k rows x 16 (about SCONE's table size)",
}


def markdown(results: dict) -> str:
    """The arms' table (test perplexity first) and every run of the sweep, as markdown."""
    rows = ["| arm | tokens | learning rate | validation ppl | test ppl | test bits/byte | inference FLOPs/token "
            "| training FLOPs | hit rate | accelerator MB | host table MB | training tokens/s (x baseline) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    baseline_rate = results["arms"].get("baseline", {}).get("train_tokens_per_s")
    for arm in ARMS:
        r = results["arms"].get(arm)
        if r:
            rate = r.get("train_tokens_per_s")
            versus = f" ({rate / baseline_rate:.2f}x)" if rate and baseline_rate else ""
            sizes = " | ".join(f"{r[k] / 1e6:.1f}" if k in r else "" for k in ("accelerator_bytes", "host_table_bytes"))
            rows.append(f"| {ARM_LABELS[arm]} (`{arm}`) | {r['tokens'] / 1e6:.1f}M | {r['learning_rate']:g} | "
                        f"{r['validation_ppl']:.2f} | **{r['test_ppl']:.2f}** | {r['test_bits_per_byte']:.4f} | "
                        f"{r['inference_flops_per_token']:.3g} | {r['train_flops']:.3g} | {r['hit_rate']:.3f} | "
                        f"{sizes} | {f'{rate:,.0f}' if rate else ''}{versus} |")
    runs = ["| run | validation ppl | test ppl | minutes | commit |", "|---|---|---|---|---|"]
    for key, r in sorted(results["runs"].items()):
        runs.append(f"| `{key}` | {r['validation_ppl']:.2f} | {r['test_ppl']:.2f} | {r['train_seconds'] / 60:.0f} | "
                    f"{r['commit']} |")
    return "\n".join(rows) + "\n\nEvery run (the learning-rate sweep included):\n\n" + "\n".join(runs) + "\n"
