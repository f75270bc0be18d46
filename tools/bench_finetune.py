"""SCONE on a pretrained model at this machine's scale (issue 55; the paper's Table 4): pretrain a main model and a
larger one on one corpus with one tokenizer, then fine-tune the main model on conversations plainly and with SCONE,
its f-gram model grown from the larger model or trained from scratch.

  apt-get install dict-gcide wordnet-base
  (cut GCIDE into pieces and split it: docs/quality.md, "A second corpus"; /data/gcide below)
  python tools/make_chat_corpus.py --output=/data/wordnet_chat --max_synsets=40000
  python tools/bench_finetune.py --pretrain_train_files=/data/gcide/train.jsonl \\
      --pretrain_validation_files=/data/gcide/validation.jsonl --pretrain_test_files=/data/gcide/test.jsonl \\
      --chat_dir=/data/wordnet_chat --workdir=/data/ft --pretrain_tokens=3m --tokens=1m
  python tools/bench_finetune.py ... --main_workdir=RUN --large_workdir=RUN   # runs of ours instead of pretraining
  python tools/bench_finetune.py ... --quick     # every stage on tiny models, minutes; compares nothing

1. Tokenizer: a byte-level BPE tokenizer.json trained on the pretraining split (study/shared_tokenizer.py says why
   not SentencePiece) into WORKDIR/tokenizer.json, shared by every model.
2. Pretraining (WORKDIR/pretrain, tools/bench_quality.py's runs): configs/quality.py's `baseline` (2 blocks, the
   main model) and --large_arm (`baseline_4x`: 8 blocks; `baseline_2x`: 4) for --pretrain_tokens each at
   --pretrain_learning_rate, with model.embedding_multiplier=1 and data.add_bos=False, so both are stock GPT-2
   checkpoints once exported; scored on the test split and recorded as `pretrain_main` / `pretrain_large`.
   --main_workdir / --large_workdir take finished runs instead (one tokenizer.json for both).
3. Both are exported with --format=hf (WORKDIR/hf_main, WORKDIR/hf_large).
4. Fine-tuning (WORKDIR/seed<N>; study/finetune.py): --arms of ft_plain, ft_scone_pretrained, ft_scone_scratch on
   --chat_dir's conversations (tools/make_chat_corpus.py: train / validation / test.jsonl, chat_template.jinja),
   data.source=chat, the loss on the assistant tokens, --tokens each; the SCONE arms' rows enter as --scone_start
   says (a zero-initialised projection added to the token rows, or the first study's scalar gate). The first seed sweeps --learning_rates
   lowest first, stopping at the first rise in validation perplexity (tools/bench_quality.py's rule); the other
   seeds train at the rate the first seed's validation chose for that arm. Each run is exported, its test
   perplexity on the assistant tokens computed by scone_jax.serving.evaluate, and its greedy decode time per token
   measured (study/decode_time.py) in turns with the plain fine-tune's export of the same seed.
5. Each finished run is appended to the study's records (experiments/quality/runs.jsonl, or --records; with
   --quick only if --records is given), fine-tunes with `pretrain` naming their start; WORKDIR/finetune.md gets the
   block that `python tools/plot_quality.py` rebuilds in docs/quality.md. A rerun skips finished runs and resumes a
   half-trained one. RESULT lines: ppl_<arm>_seed<N>, decode_ms_per_token_<arm>_seed<N>.
Bad input (a missing flag, an unknown arm, a rate or seed that is not one, both pretraining splits and workdirs or
neither, a corpus folder without its files, a workdir that is not a finished run, given runs that do not read one
tokenizer.json, a WORKDIR another study uses) is one line and exit 2 before anything is written.
"""
from __future__ import annotations

import json
import os

from absl import flags

from scone_jax.data.tokenizer import HUGGINGFACE, Tokenizer
from scone_jax.runtime import logs, ownership, tool_main
from scone_jax.study import checks, finetune, finetune_table, records, runs as study_runs, shared_tokenizer
from scone_jax.study.decode_time import ms_per_token
from scone_jax.study.protocol import best_rate, sweep_stopped
from scone_jax.study.study import Study, fgram_settings, parse_rates, parse_tokens, run_arm

_PRE_TRAIN = flags.DEFINE_string("pretrain_train_files", "", "Pretraining corpus, training split (JSONL 'text').")
_PRE_VALIDATION = flags.DEFINE_string("pretrain_validation_files", "", "Pretraining corpus, validation split.")
_PRE_TEST = flags.DEFINE_string("pretrain_test_files", "", "Pretraining corpus, test split.")
_MAIN_RUN = flags.DEFINE_string("main_workdir", "", "A finished run of ours to fine-tune instead of pretraining one.")
_LARGE_RUN = flags.DEFINE_string("large_workdir", "", "A finished larger run of ours, the f-gram model's source.")
_CHAT = flags.DEFINE_string("chat_dir", None, "tools/make_chat_corpus.py's output: the fine-tuning conversations.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Root of the study's runs.")
_ARMS = flags.DEFINE_list("arms", list(finetune.ARMS), f"Fine-tuning arms, among {', '.join(finetune.ARMS)}.")
_LARGE_ARM = flags.DEFINE_enum("large_arm", "baseline_4x", ["baseline_2x", "baseline_4x"],
                               "configs/quality.py's arm pretrained as the larger model (8 or 4 blocks).")
_PRE_TOKENS = flags.DEFINE_string("pretrain_tokens", "3m", "Pretraining tokens of each model.")
_PRE_RATE = flags.DEFINE_string("pretrain_learning_rate", "2e-3", "Pretraining peak learning rate "
                                "(docs/quality.md: the rate validation chose on GCIDE and the kernel documentation).")
_START = flags.DEFINE_enum("scone_start", "projection", list(finetune.STARTS),
                           "How the SCONE arms' f-gram rows enter at step 0: `projection` adds them to the token rows "
                           "through a d_f x d projection that starts at zero (scone.combine=add, "
                           "scone.output_projection_init=zeros); `gate` mixes raw rows in through a scalar gate from "
                           "g = 0 (the first study's start). Step 0 is the plain fine-tune either way.")
_TOKENS = flags.DEFINE_string("tokens", "1m", "Fine-tuning tokens of each run (rows of 16 x 256 positions).")
_RATES = flags.DEFINE_list("learning_rates", ["5e-4", "2e-3", "8e-3"], "Fine-tuning peak rates swept by the first seed.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1"], "Fine-tuning seeds (train.seed); the first sweeps the rates.")
_VOCAB = flags.DEFINE_integer("vocab_size", 2048, "Pieces of the tokenizer trained on the pretraining split.")
_RECORDS = flags.DEFINE_string("records", records.RECORDS, "The study's records ('' = none; with --quick, only if given).")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke run: tiny models, 20k pretraining and 4k fine-tuning tokens, the "
                           "first rate and seed only, 2 decode timing rounds; exercises every stage, compares nothing.")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 64, "Tokens decoded per timing round.")
_DECODE_REPEATS = flags.DEFINE_integer("decode_repeats", 5, "Timing rounds per export (the median is kept).")

PRETRAIN_NAMES = {"baseline": "pretrain_main"}  # and --large_arm -> pretrain_large
PLAIN_INPUTS = {"model.embedding_multiplier": 1.0, "data.add_bos": False}  # a stock GPT-2 checkpoint once exported


def _parse_seeds(values: list[str]) -> list[int]:
    try:
        seeds = [int(v) for v in values]
    except ValueError:
        seeds = [-1]
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds={','.join(values)}: give distinct integers >= 0, e.g. --seeds=0,1.")
    return seeds


def main():
    logs.quiet_libraries()
    tool_main.require(chat_dir=_CHAT.value, workdir=_WORKDIR.value)
    unknown = [a for a in _ARMS.value if a not in finetune.ARMS]
    if unknown or not _ARMS.value:
        raise ValueError(f"--arms={','.join(_ARMS.value)}: unknown arm(s) {unknown}; choose among {', '.join(finetune.ARMS)}.")
    arms = [a for a in finetune.ARMS if a in _ARMS.value]  # the plain fine-tune first: SCONE's decode reference
    rates, seeds = parse_rates(_RATES.value), _parse_seeds(_SEEDS.value)
    pre_rate = parse_rates([_PRE_RATE.value])[0]
    tokens, pre_tokens = parse_tokens(_TOKENS.value), parse_tokens(_PRE_TOKENS.value)
    if _QUICK.value:
        rates, seeds, tokens, pre_tokens = rates[:1], seeds[:1], 4_000, 20_000
    splits = [_PRE_TRAIN.value, _PRE_VALIDATION.value, _PRE_TEST.value]
    given = [_MAIN_RUN.value, _LARGE_RUN.value]
    if any(splits) == any(given) or (any(splits) and not all(splits)) or (any(given) and not all(given)):
        raise ValueError("Give either all three --pretrain_*_files (pretrain here) or both --main_workdir and "
                         "--large_workdir (finished runs), not both and not part of either.")
    if all(given):
        _check_given_runs(given)
    missing = [n for n in ("train.jsonl", "validation.jsonl", "test.jsonl", "chat_template.jinja")
               if not os.path.isfile(os.path.join(_CHAT.value, n))]
    if missing:
        raise ValueError(f"--chat_dir={_CHAT.value} lacks {', '.join(missing)}. Fix: make it with "
                         "tools/make_chat_corpus.py --output=DIR.")
    root = os.path.abspath(_WORKDIR.value)
    os.makedirs(root, exist_ok=True)
    with ownership.hold(root):
        run_study(root, arms, rates, seeds, tokens, pre_tokens, pre_rate, given)


def _check_given_runs(runs: list[str]) -> None:
    """--main_workdir and --large_workdir: finished runs that read one tokenizer.json (the f-gram model grown from
    the larger one must read the main model's ids as the same tokens: hf/fgram_source.py)."""
    paths = []
    for run in runs:
        config = study_runs.read_json(os.path.join(run, "config.json")) or {"train": {"num_steps": -1}, "data": {}}
        why = study_runs.unfinished(run, config["train"]["num_steps"])
        if why:
            raise ValueError(f"{run} is not a finished run ({why}). Fix: name a run that trained to its last step.")
        path = config["data"].get("tokenizer_path", "")
        if not path or Tokenizer.load(path).kind != HUGGINGFACE:
            raise ValueError(f"{run} was trained with a SentencePiece tokenizer ({path or 'its workdir tokenizer.model'}), "
                             "but an f-gram model grown from a checkpoint needs the tokenizer.json both models read. "
                             "Fix: pretrain them with this tool (the --pretrain_*_files flags), or train both with one "
                             "tokenizer.json (data.tokenizer_path).")
        paths.append(path)
    if open(paths[0], "rb").read() != open(paths[1], "rb").read():
        raise ValueError(f"{runs[0]} and {runs[1]} read different tokenizers ({paths[0]}, {paths[1]}). Fix: two runs "
                         "trained with one tokenizer.json.")


def _append(record: dict, rename: str | None = None) -> None:
    if _RECORDS.value and (not _QUICK.value or flags.FLAGS["records"].present):
        records.append({**record, "arm": rename or record["arm"]}, _RECORDS.value)


def pretrain(root: str, tokens: int, rate: str) -> tuple[str, str]:
    """Train the main and the larger model (module docstring, 2.) unless finished; their run directories."""
    tokenizer_path = os.path.join(root, "tokenizer.json")
    data = {"source": "jsonl", "train_files": _PRE_TRAIN.value, "eval_files": _PRE_VALIDATION.value,
            "document_unit": "line", "text_field": "text", "tokenizer_path": tokenizer_path}
    arms = ["baseline", _LARGE_ARM.value]
    study = Study(os.path.join(root, "pretrain"), arms, tokens, tokens, [rate], data, _PRE_TEST.value, _QUICK.value,
                  dict(PLAIN_INPUTS))
    probe = study.config(arms[0])
    if not os.path.exists(tokenizer_path):
        checks.check_splits(probe, _PRE_TEST.value)
        shared_tokenizer.train(probe.data, tokenizer_path, 512 if _QUICK.value else _VOCAB.value)
    tokenizer = Tokenizer.load(tokenizer_path)
    study_runs.forget_unfinished_runs(study)
    checks.check_finished_runs(study, tokenizer)
    planned = [(arm, rate) for arm in arms]
    for arm in arms:
        key = f"{arm}/lr{rate}"
        if key in study.results["runs"]:
            print(f"[pretrain {key}] finished before: skipped", flush=True)
            continue
        config = study.config(arm, rate, tokenizer=tokenizer)
        result = run_arm(study, arm, rate, config, tokenizer, planned)
        study.save("")
        _append(records.from_run(result, config, study.overrides, study.test_files),
                PRETRAIN_NAMES.get(arm, "pretrain_large"))
    return study.run_dir("baseline", rate), study.run_dir(_LARGE_ARM.value, rate)


def export_hf(run: str, output: str) -> str:
    """`run` as a Hugging Face checkpoint at `output` (a finished export is left as it is)."""
    rc, last = study_runs.run_cli(["-m", "scone_jax.serving.export", f"--workdir={run}", f"--output={output}",
                                   "--format=hf"], output + ".log", lambda _: None)
    if rc:
        raise RuntimeError(f"exporting {run} with --format=hf failed (exit {rc}): {last} (log: {output}.log)")
    return output


def describe(main_run: str, large_run: str, tokenizer_path: str) -> str:
    """The `pretrain` field of the fine-tunes' records: what both models were pretrained on and their sizes."""
    main, large = (study_runs.read_json(os.path.join(r, "config.json")) for r in (main_run, large_run))
    rows = main["data"]["global_batch_size"] * main["data"]["seq_len"]
    fingerprint = Tokenizer.load(tokenizer_path).fingerprint
    return (f"{records.corpus_name(main['data']['train_files'])}, {main['train']['num_steps'] * rows:,} tokens; main "
            f"{main['model']['num_layers']} blocks, f-gram source {large['model']['num_layers']} blocks, width "
            f"{main['model']['d_model']}; tokenizer {fingerprint}")


def run_study(root, arms, rates, seeds, tokens, pre_tokens, pre_rate, given):
    """The module docstring's steps 1-5."""
    main_run, large_run = given if all(given) else pretrain(root, pre_tokens, pre_rate)
    hf_main = export_hf(main_run, os.path.join(root, "hf_main"))
    hf_large = export_hf(large_run, os.path.join(root, "hf_large"))
    pretrained = describe(main_run, large_run, os.path.join(hf_main, "tokenizer.json"))
    chosen: dict[str, str] = {}
    for seed in seeds:
        study = finetune.FinetuneStudy(os.path.join(root, f"seed{seed}"), arms, tokens, rates, _CHAT.value, hf_main,
                                       hf_large, seed, _QUICK.value, {}, _START.value)
        tokenizer = Tokenizer.load(os.path.join(hf_main, "tokenizer.json"))
        study_runs.forget_unfinished_runs(study)
        checks.check_finished_runs(study, tokenizer)
        first = seed == seeds[0]
        planned = [(arm, r) for arm in arms for r in (rates if first else [chosen.get(arm, rates[0])])]
        plain_export = None
        for arm in arms:
            for rate in (rates if first else [chosen[arm]]):
                key = f"{arm}/lr{rate}"
                if first and key not in study.results["runs"] and sweep_stopped(study.results["runs"], arm, rate, rates):
                    print(f"[seed {seed} {key}] skipped: validation perplexity rose at the rate below it", flush=True)
                    study.skipped.add((arm, rate))
                    continue
                if key in study.results["runs"]:
                    print(f"[seed {seed} {key}] finished before: skipped", flush=True)
                    continue
                config = study.config(arm, rate, tokenizer=tokenizer)
                if config.scone.enabled:
                    config = study.config(arm, rate, fgram_settings(study, config, tokenizer), tokenizer)
                result = run_arm(study, arm, rate, config, tokenizer, planned)
                result["pretrain"] = pretrained
                timed = [os.path.join(study.run_dir(arm, rate), "export")] + ([plain_export] if plain_export else [])
                ms = ms_per_token(timed, _first_question(), _DECODE_TOKENS.value,
                                  2 if _QUICK.value else _DECODE_REPEATS.value)
                result["decode_ms_per_token"] = round(ms[0], 4)
                if plain_export:
                    result["decode_ms_per_token_plain"] = round(ms[1], 4)
                study.save("")
                _append(records.from_run(result, config, study.recorded_keys(config), study.test_files))
            if first:
                chosen[arm] = str(best_rate(study.results["runs"], arm, rates))
            if arm == "ft_plain":
                plain_export = os.path.join(study.run_dir(arm, chosen[arm]), "export")
        for arm in arms:
            run = study.results["runs"].get(f"{arm}/lr{chosen[arm]}")
            if run:
                print(f"RESULT ppl_{arm}_seed{seed} {run['test_ppl']:.3f}")
                print(f"RESULT decode_ms_per_token_{arm}_seed{seed} {run['decode_ms_per_token']:.3f}")
    _summary(root)


def _first_question() -> str:
    """The prompt the decode timing continues: the first test conversation's question."""
    with open(os.path.join(_CHAT.value, "test.jsonl")) as f:
        return json.loads(f.readline())["messages"][0]["content"]


def _summary(root: str) -> None:
    """WORKDIR/finetune.md: the block docs/quality.md shows, built from the records (when this study keeps any)."""
    if _RECORDS.value and (not _QUICK.value or flags.FLAGS["records"].present):
        path = os.path.join(root, "finetune.md")
        with open(path, "w") as f:
            f.write(finetune_table.section(records.read(_RECORDS.value)) + "\n")
        print(f"table: {path}")


if __name__ == "__main__":
    tool_main.run(main, program="bench_finetune")
