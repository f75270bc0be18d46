"""SCONE's protocol on any corpus: baselines of growing depth against SCONE arms, at equal token budgets.

  python tools/split_corpus.py --input=/usr/share/doc/linux-doc-6.1/html/_sources --pattern='**/*.txt' \\
      --output=/data/linux_doc
  python tools/bench_quality.py --source=jsonl --train_files=/data/linux_doc/train.jsonl \\
      --validation_files=/data/linux_doc/validation.jsonl --eval_files=/data/linux_doc/test.jsonl \\
      --workdir=/data/quality --tokens=10m --ablation_tokens=3m
  python tools/bench_quality.py ... --quick      # a smoke run: 2 small arms, minutes
  python tools/bench_quality.py ... --quick --arms=oe   # the smoke run of the arms named instead

Arms (configs/quality.py defines the models): the baseline family `baseline`, `baseline_2x`,
`baseline_4x` (2 / 4 / 8 decoder blocks: about 1x / 2x / 4x inference FLOPs per token) and the SCONE
arms on the 1x decoder: `scone` (f-gram model of 2 blocks = 1x, S = 20k, K = 5), `scone_fgram0.5x`,
`scone_fgram2x`, `scone_s5k`, `scone_s100k`, `scone_k3`, and SCONE's baseline, Over-Encoding (hashed n-gram
input embeddings, docs/method.md §8) on the same decoder: `oe` (tables of about SCONE's size, m = 20k) and
`oe_5x` (m = 100k), and DeepSeek's Engram (hashed n-gram memory gated into the residual stream before the second
block, docs/method.md §9): `engram` (tables of about SCONE's size). All share one tokenizer (trained on the
training split), one data order (data.shuffle_seed) and one token budget (--tokens for the 1x arms and baseline_2x,
--ablation_tokens for the rest; `oe`, `oe_5x` and `engram` for --tokens too). `baseline_short` and
`scone_short` are the 1x models again at --ablation_tokens (the 1x arms themselves when that equals --tokens):
the points the ablations and baseline_4x are compared with, since a model trained on fewer tokens is worse
whatever its shape. Every arm multiplies its token inputs by sqrt(d), the f-gram models' inputs included
(configs/quality.py says why);
--config.model.embedding_multiplier=1 --config.scone.input_multiplier=1 gives the method's plain inputs.
Any config setting of configs/quality.py goes on every run the same way, ml_collections' --config.KEY=VALUE
(e.g. --config.train.fgram_model_delay_fraction=0 for the method's undelayed f-gram model).

Protocol: `baseline`, `scone`, `oe` and `engram` each train at the --learning_rates values in ascending order, stop
at the first whose validation perplexity is above the best of those below it, and keep the one with
the lowest validation perplexity; the other arms of each family train at their family's rate. Every arm is
then exported (`python -m scone_jax.serving.export`, bf16 table) and scored on the test split by
`python -m scone_jax.serving.evaluate`, the way a user serves it: SCONE with the f-gram table in host
RAM, baselines as decoder-only bundles, Over-Encoding and Engram as decoder bundles holding their n-gram tables
(the host computes each batch's n-gram ids). Nothing is tuned on the test split.

Each run lives in WORKDIR/<arm>/lr<rate>/ (a workdir of `python -m scone_jax.main`, its log in
train.log): a rerun skips finished runs, resumes a half-trained one from its checkpoint, and prints
progress and an ETA. A run is finished when its last step is its train.num_steps and its DONE marker says
so; a job that ends early with exit 0 (e.g. --config.train.max_steps_per_run=N) is neither exported nor
recorded: the study stops there with one line (exit 2), and a rerun resumes that run (a record of an
unfinished run, left by an older version of this tool, is dropped so that it resumes too). The jobs the
study starts stop with it (SIGTERM: the main job saves a checkpoint) if it is killed. Each finished run is
appended to the study's records (experiments/quality/runs.jsonl, or --records: scone_jax/study/records.py;
docs/quality.md's tables and figure are built from them by one command, python tools/plot_quality.py).
Results go to WORKDIR/results.json (and --record, after every run), a plot of test
perplexity against inference and training FLOPs to WORKDIR/quality.png (needs matplotlib: the [plot]
extra), and RESULT lines: ppl_<arm>, inference_flops_per_token_<arm>, train_flops_<arm>, accelerator_bytes_<arm>
(the served decoder's parameters: Over-Encoding's tables on the accelerator, SCONE's f-gram table not; that one is
host_table_bytes in the record) and train_tokens_per_s_<arm> (the run's median training throughput).
Bad input (an unknown arm, a --learning_rates value that is not a positive number, a --config.KEY=VALUE with an
unknown key or a value of the wrong type, a budget under one step, splits that share documents, a corpus
smaller than the budget without --allow_epochs, a finished run in WORKDIR trained with other settings than
this invocation's, a run of this invocation that another process is using, a WORKDIR another bench_quality is
using) is one line and exit 2, before anything trains.
"""
from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from scone_jax.config import define_override_flag, load_config_file, override_flag_error
from scone_jax.runtime import ownership, tool_main
from scone_jax.study import checks, figure, records, runs as study_runs
from scone_jax.study.protocol import best_rate, family, sweep_stopped, without_short_arms
from scone_jax.study.study import (ARMS, CONFIG, SWEPT, Study, fgram_settings, markdown, parse_rates,
                                   parse_tokens, run_arm)
from scone_jax.training import assets

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
_RECORDS = flags.DEFINE_string("records", records.RECORDS, "The study's records: every finished run is "
                               "appended here with its overrides and seed ('' = none; with --quick, only if given).")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke run: baseline and scone (or the --arms given), one learning rate, "
                           "64-token rows x 8 per step for ~50k tokens; exercises every stage, compares nothing.")
# Every key of configs/quality.py's arms (the scone arm has them all), typed as the config holds it.
_QUALITY = load_config_file(f"{CONFIG}:scone")

_CONFIG = define_override_flag(
    "bench_quality", _QUALITY, "--config.KEY=VALUE: a config setting for every run on top of configs/quality.py's "
    "arm (e.g. --config.data.worker_count=1, or --config.model.embedding_multiplier=1 "
    "--config.scone.input_multiplier=1 for the method's plain inputs, the first comparison of "
    "docs/quality.md); repeat it for several; use a workdir of its own.")


def main():
    tool_main.require(train_files=_TRAIN.value, validation_files=_VALIDATION.value, eval_files=_TEST.value,
                      workdir=_WORKDIR.value)
    unknown = [a for a in _ARMS.value if a not in ARMS]
    if unknown:
        raise ValueError(f"Unknown arm(s) {unknown}; --arms takes {', '.join(ARMS)}.")
    arms = ["baseline", "scone"] if _QUICK.value and not flags.FLAGS["arms"].present else list(_ARMS.value)
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
    study = Study(root, arms, tokens, ablation, rates, data, _TEST.value, _QUICK.value,
                  config_flags.get_override_values(flags.FLAGS["config"]))
    busy = study_runs.runs_in_use(root, arms)
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
    checks.check_splits(probe, _TEST.value)
    os.makedirs(root, exist_ok=True)
    # One study per WORKDIR: a second started beside it (both past the check above) would train, record and
    # write results.json over the first's. Its lease (runtime/ownership.py, as a training job holds its workdir)
    # refuses the second in one line, and is released however this one ends.
    with ownership.hold(root):
        run_study(study, probe, arms, rates)


def run_study(study: Study, probe, arms: list[str], rates: list[str]):
    """Train, export, score and record every planned run of `study` (the module docstring's protocol)."""
    root = study.root
    study.load_results()  # as it is now that this study owns WORKDIR (another may have finished meanwhile)
    if not _TOKENIZER.value:
        tok_cfg = probe.data.copy_and_resolve_references()
        tok_cfg.tokenizer_path = ""
        assets.ensure_tokenizer(tok_cfg, root)  # trained once, on the training split, into root/tokenizer.model
    tokenizer = assets.ensure_tokenizer(probe.data, root)
    study_runs.forget_unfinished_runs(study)
    checks.check_finished_runs(study, tokenizer)
    positions = checks.train_positions(probe, tokenizer)
    epochs = max(study.budget.values()) / positions
    print(f"training split: {positions:,} positions; the largest budget is {epochs:.2f} epochs", flush=True)
    if epochs > 1 and not _ALLOW_EPOCHS.value:
        raise ValueError(f"The largest budget ({max(study.budget.values()):,} tokens) is {epochs:.2f} passes over the "
                         f"training split ({positions:,} positions). Fix: lower --tokens, give more text, or pass "
                         "--allow_epochs to repeat it.")

    # Plan: the swept arms first (their rates decide the others'), then the rest.
    planned = [(a, r) for a in SWEPT if a in arms for r in rates]
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
            config = study.config(arm, rate, tokenizer=tokenizer)
            if config.scone.enabled:
                config = study.config(arm, rate, fgram_settings(study, config, tokenizer), tokenizer)
            study.results["runs"][key] = run_arm(study, arm, rate, config, tokenizer, resolved + planned[len(resolved):])
            study.save(_RECORD.value)
            if _RECORDS.value and (not _QUICK.value or flags.FLAGS["records"].present):
                records.append(records.from_run(study.results["runs"][key], config, study.overrides,
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
    if figure.plot(study.results, os.path.join(root, "quality.png")):
        print(f"plot: {os.path.join(root, 'quality.png')}")
    for arm, r in study.results["arms"].items():
        if arm in arms:
            print(f"RESULT ppl_{arm} {r['test_ppl']:.3f}")
            print(f"RESULT inference_flops_per_token_{arm} {r['inference_flops_per_token']:.4g}")
            print(f"RESULT train_flops_{arm} {r['train_flops']:.4g}")
            for key in ("accelerator_bytes", "train_tokens_per_s"):
                if key in r:  # a run recorded before these fields has none
                    print(f"RESULT {key}_{arm} {r[key]:.4g}")


if __name__ == "__main__":
    tool_main.run(main, program="bench_quality", flag_error=lambda argv: override_flag_error(argv, _QUALITY))
