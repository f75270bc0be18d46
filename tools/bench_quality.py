"""SCONE's protocol on any corpus: baselines of growing depth against SCONE arms, at equal token budgets.

  python tools/split_corpus.py --input=/usr/share/doc/linux-doc-6.1/html/_sources --pattern='**/*.txt' \\
      --output=/data/linux_doc
  python tools/bench_quality.py --source=jsonl --train_files=/data/linux_doc/train.jsonl \\
      --validation_files=/data/linux_doc/validation.jsonl --eval_files=/data/linux_doc/test.jsonl \\
      --workdir=/data/quality --tokens=10m --ablation_tokens=3m
  python tools/bench_quality.py ... --quick      # a smoke run: 2 small arms, minutes

Arms (configs/quality.py defines the models): the baseline family `baseline`, `baseline_2x`,
`baseline_4x` (2 / 4 / 8 decoder blocks: about 1x / 2x / 4x inference FLOPs per token) and the SCONE
arms on the 1x decoder: `scone` (f-gram model of 2 blocks = 1x, S = 20k, K = 5), `scone_fgram0.5x`,
`scone_fgram2x`, `scone_s5k`, `scone_s100k`, `scone_k3`. All share one tokenizer (trained on the training
split), one data order (data.shuffle_seed) and one token budget (--tokens for the 1x arms and baseline_2x,
--ablation_tokens for the rest). `baseline_short` and `scone_short` are the 1x models again at
--ablation_tokens (the 1x arms themselves when that equals --tokens): the points the ablations and baseline_4x are
compared with, since a model trained on fewer tokens is worse whatever its shape. Every arm multiplies
its token inputs by sqrt(d), the f-gram models' inputs included (configs/quality.py says why);
--override=model.embedding_multiplier=1 --override=scone.input_multiplier=1 gives the method's plain inputs.

Protocol: `baseline` and `scone` each train at the --learning_rates values in ascending order, stop
at the first whose validation perplexity is above the best of those below it, and keep the one with
the lowest validation perplexity; the other arms of each family train at their family's rate. Every arm is
then exported (`python -m scone_jax.serving.export`, bf16 table) and scored on the test split by
`python -m scone_jax.serving.evaluate`, the way a user serves it: SCONE with the f-gram table in host
RAM, baselines as decoder-only bundles. Nothing is tuned on the test split.

Each run lives in WORKDIR/<arm>/lr<rate>/ (a workdir of `python -m scone_jax.main`, its log in
train.log): a rerun skips finished runs, resumes a half-trained one from its checkpoint, and prints
progress and an ETA. A run is finished when its last step is its train.num_steps and its DONE marker says
so; a job that ends early with exit 0 (e.g. --override=train.max_steps_per_run=N) is neither exported nor
recorded: the study stops there with one line (exit 2), and a rerun resumes that run (a record of an
unfinished run, left by an older version of this tool, is dropped so that it resumes too). The jobs the
study starts stop with it (SIGTERM: the main job saves a checkpoint) if it is killed. Each finished run is
appended to the study's records (experiments/quality/runs.jsonl, or --records: tools/quality_records.py;
docs/quality.md's tables and figure are built from them by tools/plot_quality.py).
Results go to WORKDIR/results.json (and --record, after every run), a plot of test
perplexity against inference and training FLOPs to WORKDIR/quality.png (needs matplotlib: the [plot]
extra), and RESULT lines: ppl_<arm>, inference_flops_per_token_<arm>, train_flops_<arm>.
Bad input (an unknown arm, a --learning_rates value that is not a positive number, an --override with an
unknown key or a value of the wrong type, a budget under one step, splits that share documents, a corpus
smaller than the budget without --allow_epochs, a finished run in WORKDIR trained with other settings than
this invocation's, a run of this invocation that another process is using) is one line and exit 2, before
anything trains.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import time

import numpy as np
from absl import flags

from scone_jax.config import apply_override, load_config_file
from scone_jax.data import pipeline
from scone_jax.fgram.dedup import FgramBatcher
from scone_jax.fgram.matcher import Matcher
from scone_jax.model import accounting
from scone_jax.runtime import tool_main, workdir as workdir_layout
from scone_jax.training import assets, state as state_lib
import quality_checks
import quality_figure
import quality_records
import quality_runs
from quality_runs import run_cli
from quality_protocol import best_rate, family, planned_keys, sweep_stopped, variant, without_short_arms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "quality.py")
ARMS = ("baseline", "baseline_2x", "baseline_short", "baseline_4x", "scone", "scone_short", "scone_fgram0.5x",
        "scone_fgram2x", "scone_s5k",
        "scone_s100k", "scone_k3")
SWEPT = {"baseline": "baseline", "scone": "scone"}  # arm -> the family whose swept learning rate it uses
MAIN_ARMS = ("baseline", "scone", "baseline_2x")  # trained for --tokens; the others for --ablation_tokens

_SOURCE = flags.DEFINE_enum("source", "jsonl", ["text", "jsonl", "arrayrecord"], "Corpus format (data.source).")
_TRAIN = flags.DEFINE_string("train_files", None, "Training split: comma-separated globs.")
_VALIDATION = flags.DEFINE_string("validation_files", None, "Validation split (learning-rate choice).")
_TEST = flags.DEFINE_string("eval_files", None, "Test split: the reported perplexity.")
_UNIT = flags.DEFINE_enum("document_unit", "line", ["line", "file"], "text source: one document per line or file.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "jsonl source: the field holding the document.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "A tokenizer to use instead of training one on the training "
                                 "split (required for arrayrecord: the shards' tokenizer).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Root of the study's runs and results.")
_ARMS = flags.DEFINE_list("arms", list(ARMS), f"Arms to run, among {', '.join(ARMS)}.")
_TOKENS = flags.DEFINE_string("tokens", "10m", "Training tokens of baseline, scone and baseline_2x (e.g. 10m).")
_ABLATION_TOKENS = flags.DEFINE_string("ablation_tokens", "", "Training tokens of the other arms ('' = --tokens).")
_LEARNING_RATES = flags.DEFINE_list("learning_rates", ["5e-4", "1e-3", "2e-3", "4e-3"],
                                    "Peak learning rates swept by baseline and scone, lowest first (the "
                                    "default brackets both families' best rates in docs/quality.md).")
_ALLOW_EPOCHS = flags.DEFINE_bool("allow_epochs", False, "Allow budgets larger than one pass over the corpus.")
_RECORD = flags.DEFINE_string("record", "", "Also write results.json here after every run.")
_RECORDS = flags.DEFINE_string("records", quality_records.RECORDS, "The study's records: every finished run is "
                               "appended here with its overrides and seed ('' = none; with --quick, only if given).")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke run: baseline and scone, one learning rate, 64 x 8-token-rows "
                           "steps for ~50k tokens; exercises every stage, compares nothing.")
_OVERRIDES = flags.DEFINE_multi_string("override", [], "Extra KEY=VALUE config setting for every run (e.g. "
                                       "data.worker_count=1, or model.embedding_multiplier=1 and "
                                       "scone.input_multiplier=1 for the method's plain inputs, the first "
                                       "comparison of docs/quality.md); repeat it for several; use a workdir "
                                       "of its own.")


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
                 data: dict, test_files: str, quick: bool, overrides: list[str]):
        self.root, self.arms, self.rates, self.data, self.quick = root, arms, rates, data, quick
        self.test_files = test_files  # never part of a run's config: nothing in training can see it
        self.budget = {a: tokens if a in MAIN_ARMS else ablation_tokens for a in arms}
        quick_settings = ["data.seq_len=64", "model.max_seq_len=64", "data.global_batch_size=8",
                          "data.vocab_size=1024"] if quick else []
        self.overrides = quick_settings + list(overrides)  # the user's --override last: it wins
        self.results_path = os.path.join(root, "results.json")
        self.results = quality_runs.read_json(self.results_path) or {"runs": {}, "arms": {}}
        self.started, self.tokens_done = time.time(), 0
        self.skipped = set()  # (arm, rate) runs the sweep rule left out

    # --- configs -----------------------------------------------------------------------------------
    def config(self, arm: str, rate: str | None = None, extra: dict | None = None, tokenizer=None):
        config = load_config_file(f"{CONFIG}:{variant(arm)}")
        with config.unlocked():
            for item in self.overrides:
                apply_override(config, item)  # a bad --override: one line naming it
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
            for key, value in (extra or {}).items():
                apply_override(config, f"{key}={value}")
        if tokenizer is not None:
            assets.resolve_vocab_size(config, tokenizer)
        return config

    def flags_for(self, config, arm: str) -> list[str]:
        """The main job's command line for this arm: the variant plus every key the study sets."""
        flat = _flatten(config.to_dict())
        base = _flatten(load_config_file(f"{CONFIG}:{variant(arm)}").to_dict())
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
        _write_json(self.results_path, self.results)
        if record:
            _write_json(record, self.results)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _write_json(path: str, value):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def fgram_capacity(config, tokenizer, vocab, sample: int = 64) -> int:
    """Rows per step the f-gram model needs (maximal unique f-grams of a batch) over `sample` batches spread
    over the run, with 25% headroom, rounded up to 128. A batch that needs more still fails loudly; the study
    then raises the capacity and resumes (run_arm)."""
    rows = config.data.global_batch_size * config.data.seq_len
    batcher = FgramBatcher(Matcher(vocab), vocab, num_shards=1, capacity=rows)
    build = pipeline.batch_builder(config.data, tokenizer, batch_transform=batcher)
    steps = config.train.num_steps
    used = [int((build(int(b)).fgram_lengths > 0).sum()) for b in np.linspace(0, steps - 1, min(sample, steps))]
    return int(math.ceil(max(used) * 1.25 / 128) * 128)


def flops(config) -> tuple[float, float]:
    """(inference FLOPs per token of the served decoder, training FLOPs of the whole run): the model formula
    of scone_jax/model/accounting.py; inference is one forward pass (a third of training's 6N) through the
    decoder, whose input at matched positions is a table row (no f-gram model at inference)."""
    from flax import nnx

    abstract = nnx.state(nnx.eval_shape(lambda: state_lib.build_model(config)), nnx.Param)
    decoder = abstract["decoder"] if config.scone.enabled else abstract
    per_token = accounting.decoder_flops_per_token(config.model, config.data.seq_len,
                                                   accounting.param_counts(decoder)["non_embedding"])
    step = accounting.train_step_flops(config, abstract, 1)["total"]
    return per_token / 3.0, step * config.train.num_steps


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

    allow = []
    for _ in range(4):  # a capacity overflow: raise it and resume from the checkpoint the run saved
        rc, last = run_cli(["-m", "scone_jax.main", f"--config={CONFIG}:{variant(arm)}", f"--workdir={workdir}",
                      *study.flags_for(config, arm), *([f"--allow_config_change={','.join(allow)}"] if allow else [])],
                     log, show)
        if rc == 0:
            break
        if "scone.fgram_capacity" in last and config.scone.enabled:
            with config.unlocked():
                config.scone.fgram_capacity = int(config.scone.fgram_capacity * 1.5 // 128 * 128)
            allow = ["scone.fgram_capacity"]
            print(f"[{key}] capacity overflow; resuming with scone.fgram_capacity={config.scone.fgram_capacity}")
            continue
        raise RuntimeError(f"training {key} failed (exit {rc}): {last} (log: {log})")
    else:
        raise RuntimeError(f"training {key} kept overflowing scone.fgram_capacity (log: {log})")
    why = quality_runs.unfinished(workdir, config.train.num_steps)
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
    test = quality_runs.read_json(result_path)
    inference, train_flops = flops(config)
    record = {
        "arm": arm, "learning_rate": float(rate), "tokens": config.train.num_steps * config.data.global_batch_size
        * config.data.seq_len, "steps": config.train.num_steps, "validation_ppl": validation["perplexity"],
        "test_ppl": test["perplexity"], "test_bits_per_byte": test["bits_per_byte"], "test_tokens": test["tokens"],
        "hit_rate": test["hit_rate"], "inference_flops_per_token": inference, "train_flops": train_flops,
        "fgram_capacity": config.scone.fgram_capacity if config.scone.enabled else 0,
        "train_seconds": round(trained, 1), "commit": _commit(),
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
    "scone_k3": "SCONE, K = 3",
}


def markdown(results: dict) -> str:
    """The arms' table (test perplexity first) and every run of the sweep, as markdown."""
    rows = ["| arm | tokens | learning rate | validation ppl | test ppl | test bits/byte | inference FLOPs/token "
            "| training FLOPs | hit rate |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        r = results["arms"].get(arm)
        if r:
            rows.append(f"| {ARM_LABELS[arm]} (`{arm}`) | {r['tokens'] / 1e6:.1f}M | {r['learning_rate']:g} | "
                        f"{r['validation_ppl']:.2f} | **{r['test_ppl']:.2f}** | {r['test_bits_per_byte']:.4f} | "
                        f"{r['inference_flops_per_token']:.3g} | {r['train_flops']:.3g} | {r['hit_rate']:.3f} |")
    runs = ["| run | validation ppl | test ppl | minutes | commit |", "|---|---|---|---|---|"]
    for key, r in sorted(results["runs"].items()):
        runs.append(f"| `{key}` | {r['validation_ppl']:.2f} | {r['test_ppl']:.2f} | {r['train_seconds'] / 60:.0f} | "
                    f"{r['commit']} |")
    return "\n".join(rows) + "\n\nEvery run (the learning-rate sweep included):\n\n" + "\n".join(runs) + "\n"


def main():
    tool_main.require(train_files=_TRAIN.value, validation_files=_VALIDATION.value, eval_files=_TEST.value,
                      workdir=_WORKDIR.value)
    unknown = [a for a in _ARMS.value if a not in ARMS]
    if unknown:
        raise ValueError(f"Unknown arm(s) {unknown}; --arms takes {', '.join(ARMS)}.")
    arms = ["baseline", "scone"] if _QUICK.value else list(_ARMS.value)
    rates = parse_rates(_LEARNING_RATES.value)
    if _QUICK.value:
        rates = rates[:1]
    tokens = 50_000 if _QUICK.value else parse_tokens(_TOKENS.value)
    ablation = tokens if _QUICK.value or not _ABLATION_TOKENS.value else parse_tokens(_ABLATION_TOKENS.value)
    arms = without_short_arms(arms) if ablation == tokens else arms
    root = os.path.abspath(_WORKDIR.value)
    data = {"source": _SOURCE.value, "train_files": _TRAIN.value, "eval_files": _VALIDATION.value,
            "document_unit": _UNIT.value, "text_field": _TEXT_FIELD.value,
            "tokenizer_path": _TOKENIZER.value or os.path.join(root, "tokenizer.model")}
    study = Study(root, arms, tokens, ablation, rates, data, _TEST.value, _QUICK.value, _OVERRIDES.value)
    busy = quality_runs.runs_in_use(root, arms)
    if busy:
        raise ValueError(f"{', '.join(busy)} in {root} is in use by another process (a training job or export, e.g. "
                         "of a bench_quality that was stopped and is still stopping it). Fix: wait for it to end, "
                         "then rerun; nothing was changed.")
    probe = study.config(arms[0])
    rows = probe.data.global_batch_size * probe.data.seq_len
    if min(study.budget.values()) < rows:  # (num_steps rounds up: refuse budgets under one whole step)
        raise ValueError(f"A budget of {min(study.budget.values()):,} tokens is less than one step "
                         f"({probe.data.global_batch_size} x {probe.data.seq_len} = {rows:,} tokens). Fix: raise "
                         "--tokens / --ablation_tokens.")
    quality_checks.check_splits(probe, _TEST.value)
    os.makedirs(root, exist_ok=True)
    if not _TOKENIZER.value:
        tok_cfg = probe.data.copy_and_resolve_references()
        tok_cfg.tokenizer_path = ""
        assets.ensure_tokenizer(tok_cfg, root)  # trained once, on the training split, into root/tokenizer.model
    tokenizer = assets.ensure_tokenizer(probe.data, root)
    quality_runs.forget_unfinished_runs(study)
    quality_checks.check_finished_runs(study, tokenizer)
    positions = quality_checks.train_positions(probe, tokenizer)
    epochs = max(study.budget.values()) / positions
    print(f"training split: {positions:,} positions; the largest budget is {epochs:.2f} epochs", flush=True)
    if epochs > 1 and not _ALLOW_EPOCHS.value:
        raise ValueError(f"The largest budget ({max(study.budget.values()):,} tokens) is {epochs:.2f} passes over the "
                         f"training split ({positions:,} positions). Fix: lower --tokens, give more text, or pass "
                         "--allow_epochs to repeat it.")

    # Plan: the swept arms first (their rates decide the others'), then the rest.
    planned = [(a, r) for a in ("baseline", "scone") if a in arms for r in rates]
    best = {}

    def chosen(swept):
        return best_rate(study.results["runs"], swept, rates)

    for arm in arms:
        if arm not in SWEPT:
            planned.append((arm, None))
    resolved = []
    for arm, rate in planned:
        if rate is None:
            rate = str(best.get(family(arm)) or chosen(family(arm)))
        resolved.append((arm, rate))
        key = f"{arm}/lr{rate}"
        if key not in study.results["runs"] and arm in SWEPT and sweep_stopped(study.results["runs"], arm, rate, rates):
            print(f"[{key}] skipped: validation perplexity rose at the rate below it", flush=True)
            study.skipped.add((arm, rate))
            continue
        if key not in study.results["runs"]:
            extra = {}
            config = study.config(arm, rate, tokenizer=tokenizer)
            if config.scone.enabled:
                vocab_dir = os.path.join(root, f"fgrams_s{config.scone.num_fgrams}_k{config.scone.max_len}")
                vocab = assets.ensure_vocab(config.scone, config.data, tokenizer, vocab_dir)
                extra["scone.vocab_path"] = os.path.join(vocab_dir, "fgrams")
                saved = quality_runs.read_json(os.path.join(vocab_dir, "capacity.json"))
                if saved is None or saved["rows"] != config.data.global_batch_size * config.data.seq_len:
                    saved = {"capacity": fgram_capacity(config, tokenizer, vocab),
                             "rows": config.data.global_batch_size * config.data.seq_len}
                    _write_json(os.path.join(vocab_dir, "capacity.json"), saved)
                extra["scone.fgram_capacity"] = saved["capacity"]
                config = study.config(arm, rate, extra, tokenizer)
            study.results["runs"][key] = run_arm(study, arm, rate, config, tokenizer, resolved + planned[len(resolved):])
            study.save(_RECORD.value)
            if _RECORDS.value and (not _QUICK.value or flags.FLAGS["records"].present):
                quality_records.append(quality_records.from_run(study.results["runs"][key], config, study.overrides,
                                                                study.test_files), _RECORDS.value)
        if arm in SWEPT and all(f"{arm}/lr{r}" in study.results["runs"] or sweep_stopped(study.results["runs"], arm, r, rates)
                                for r in rates):
            best[arm] = chosen(arm)
    for arm in arms:
        rate = best.get(family(arm)) or chosen(family(arm))
        run = study.results["runs"].get(f"{arm}/lr{float(rate)}")
        if run:
            study.results["arms"][arm] = run
    study.save(_RECORD.value)
    with open(os.path.join(root, "quality.md"), "w") as f:
        f.write(markdown(study.results))
    print(f"table: {os.path.join(root, 'quality.md')}")
    if quality_figure.plot(study.results, os.path.join(root, "quality.png")):
        print(f"plot: {os.path.join(root, 'quality.png')}")
    for arm, r in study.results["arms"].items():
        if arm in arms:
            print(f"RESULT ppl_{arm} {r['test_ppl']:.3f}")
            print(f"RESULT inference_flops_per_token_{arm} {r['inference_flops_per_token']:.4g}")
            print(f"RESULT train_flops_{arm} {r['train_flops']:.4g}")


if __name__ == "__main__":
    tool_main.run(main, program="bench_quality")
