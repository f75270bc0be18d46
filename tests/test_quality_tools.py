"""tools/split_corpus.py (hash split by path) and tools/bench_quality.py (its refusals and a --quick run);
tools/plot_quality.py and the study's records: tests/test_quality_records.py."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from scone_jax.study import protocol as quality_protocol, records as quality_records, runs as quality_runs
from tests.common import OPTIMISED, REPO, run_tool, xla_flags
from scone_jax.study import geometry
from tools import embedding_scale, split_corpus


def make_tree(root, count=60):
    """`count` files of 25 KJV paragraphs each (real text, so a tokenizer of a few hundred pieces trains)."""
    from scone_jax.data import corpus

    paragraphs = corpus.kjv_documents("train", 0.02)
    for i in range(count):
        path = root / f"dir{i % 4}" / f"doc{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(paragraphs[25 * i: 25 * (i + 1)]) + "\n")
    (root / "empty.txt").write_text("  \n")


def test_sweep_stops_at_the_first_rise_and_keeps_the_best_rate():
    """Rates in ascending order; a rate is skipped once the one below it scored worse than the best so far.
    Caught: comparing against the previous rate only (the 4e-3 case), and deciding before the runs below exist."""
    rates = ["0.0005", "0.001", "0.002", "0.004", "0.008"]

    def runs(**ppl):
        return {f"scone/lr{r}": {"validation_ppl": v, "learning_rate": float(r)}
                for r, v in zip(rates, ppl["values"])}

    falling_then_rising = runs(values=[50.0, 47.9, 49.0])  # 5e-4, 1e-3, 2e-3 done
    assert not quality_protocol.sweep_stopped(falling_then_rising, "scone", "0.002", rates)
    assert quality_protocol.sweep_stopped(falling_then_rising, "scone", "0.004", rates)
    assert quality_protocol.sweep_stopped(falling_then_rising, "scone", "0.008", rates)
    assert quality_protocol.best_rate(falling_then_rising, "scone", rates) == 0.001
    # Still falling: go on. A rise that stays below the best (47 -> 48 after 50 -> 47) is a rise too.
    assert not quality_protocol.sweep_stopped(runs(values=[50.0, 48.0, 47.0]), "scone", "0.004", rates)
    assert quality_protocol.sweep_stopped(runs(values=[50.0, 47.0, 48.0, 46.0]), "scone", "0.008", rates)
    # A run below not finished yet: nothing is decided; the other family is not looked at.
    partial = {"scone/lr0.0005": {"validation_ppl": 50.0, "learning_rate": 5e-4}}
    assert not quality_protocol.sweep_stopped(partial, "scone", "0.002", rates)
    assert not quality_protocol.sweep_stopped(falling_then_rising, "baseline", "0.004", rates)
    assert quality_protocol.best_rate({}, "scone", rates) == 0.0005


def test_short_arms_asked_for_at_one_budget_run_as_their_1x_arms(capsys):
    """With --ablation_tokens equal to --tokens, `baseline_short` is `baseline`: it runs in its place, once, and
    says so. Caught: the short arms were dropped without a word (a seed study trained no baseline)."""
    assert quality_protocol.without_short_arms(["baseline_short", "scone_short", "scone_s5k"]) == [
        "baseline", "scone", "scone_s5k"]
    assert "baseline_short: --ablation_tokens equals --tokens, so it is baseline" in capsys.readouterr().out
    assert quality_protocol.without_short_arms(["baseline", "baseline_short", "scone_k3"]) == ["baseline", "scone_k3"]
    assert capsys.readouterr().out == ""  # the default arm list: nothing to say


def test_progress_counts_runs_an_earlier_invocation_finished():
    """An ablation arm's rate is its family's best so far, so its finished run counts as done. Caught: runs whose
    rate the sweep decides counted as left ("0/4 runs done, 12.0M tokens left" with two of four finished)."""
    runs = {"scone/lr0.001": {"validation_ppl": 48.0, "learning_rate": 0.001},
            "scone/lr0.002": {"validation_ppl": 49.0, "learning_rate": 0.002},
            "scone_s5k/lr0.001": {"validation_ppl": 45.0, "learning_rate": 0.001}}
    planned = [("scone", "0.001"), ("scone", "0.002"), ("scone_s5k", None), ("baseline_4x", None)]
    keys = quality_protocol.planned_keys(planned, runs, ["0.001", "0.002"])
    assert keys == ["scone/lr0.001", "scone/lr0.002", "scone_s5k/lr0.001", "baseline_4x/lr0.001"]
    assert [k in runs for k in keys] == [True, True, True, False]


def test_bench_quality_names_the_line_that_says_why_a_job_stopped(tmp_path):
    """A failed job is reported by its last one-line error, else its last line, of this attempt only. Caught:
    the whole log searched for "error:" in any case, so a SIGTERM'd run was reported by libtpu's CPU warning
    ("INVALID_ARGUMENT: Error: unexpected worker hostname ...") instead of "Stopped by SIGTERM ... rerun to resume"."""
    log = tmp_path / "train.log"
    log.write_text("scone_jax: error: an earlier attempt's error\n")
    seen = []
    stopped = ("print('E0000 common_lib.cc:906] INVALID_ARGUMENT: Error: unexpected worker hostname'); "
               "print('W main.py:81] Stopped by SIGTERM after saving a checkpoint at step 600; rerun to resume.'); "
               "print(); raise SystemExit(143)")
    rc, line = quality_runs.run_cli(["-c", stopped], str(log), seen.append)
    assert (rc, line) == (143, "W main.py:81] Stopped by SIGTERM after saving a checkpoint at step 600; rerun to resume.")
    assert seen[0].endswith("unexpected worker hostname") and "earlier attempt" in log.read_text()
    refused = "import sys; print('scone_jax: error: unknown key foo'); print('I exiting', file=sys.stderr); sys.exit(2)"
    assert quality_runs.run_cli(["-c", refused], str(log), seen.append) == (2, "scone_jax: error: unknown key foo")


def read_split(out, name):
    with open(out / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


def test_split_depends_on_paths_only_and_never_on_order(tmp_path):
    """Every file lands in the split its path hashes to (the rule written out here from the docstring), each
    exactly once; renaming the root or adding files moves no other file. Empty files are skipped."""
    import hashlib

    root = tmp_path / "tree"
    make_tree(root)
    record = split_corpus.split_files(str(root), "**/*.txt", str(tmp_path / "out"), 0.2, 0.2)
    seen = {}
    for name in split_corpus.SPLITS:
        for doc in read_split(tmp_path / "out", name):
            u = int(hashlib.sha256(doc["path"].encode()).hexdigest()[:16], 16) / 2**64
            assert name == ("test" if u < 0.2 else "validation" if u < 0.4 else "train"), doc["path"]
            assert doc["text"] == (root / doc["path"]).read_text()
            seen[doc["path"]] = name
    assert len(seen) == 60 and "empty.txt" not in seen
    assert {n: record["splits"][n]["files"] for n in split_corpus.SPLITS} == {
        n: sum(v == n for v in seen.values()) for n in split_corpus.SPLITS}
    assert min(record["splits"][n]["files"] for n in split_corpus.SPLITS) >= 5
    moved = tmp_path / "moved"
    os.rename(root, moved)
    (moved / "dir9").mkdir()
    (moved / "dir9" / "new.txt").write_text("a new document\n")
    split_corpus.split_files(str(moved), "**/*.txt", str(tmp_path / "out2"), 0.2, 0.2)
    again = {d["path"]: n for n in split_corpus.SPLITS for d in read_split(tmp_path / "out2", n)}
    assert {p: n for p, n in again.items() if p != "dir9/new.txt"} == seen


@pytest.mark.parametrize("args,message", [
    (["--input={tmp}/nowhere", "--output={tmp}/o"], "is not a directory"),
    (["--input={tmp}/tree", "--pattern=*.md", "--output={tmp}/o"], "No file under"),
    (["--input={tmp}/tree", "--output={tmp}/o", "--test_fraction=0.7", "--validation_fraction=0.5"], "sum to less"),
])
@pytest.mark.slow
def test_split_bad_input_is_one_line(tmp_path, args, message):
    make_tree(tmp_path / "tree", 6)
    result = run_tool("tools/split_corpus.py", [a.format(tmp=tmp_path) for a in args])
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    make_tree(root / "tree", 80)
    split_corpus.split_files(str(root / "tree"), "**/*.txt", str(root / "split"), 0.15, 0.15)
    return root / "split"


def quality_args(corpus, workdir, *extra):
    return [f"--train_files={corpus}/train.jsonl", f"--validation_files={corpus}/validation.jsonl",
            f"--eval_files={corpus}/test.jsonl", f"--workdir={workdir}", *extra]


@pytest.mark.parametrize("extra,message", [
    (["--arms=baseline,scone_huge"], "Unknown arm(s) ['scone_huge']; --arms takes baseline,"),
    (["--tokens=1000"], "is less than one step (32 x 256 = 8,192 tokens)"),
    (["--tokens=5m", "--config.data.vocab_size=512"], "passes over the training split"),
    (["--validation_files={corpus}/train.jsonl"], "The train and validation splits share"),
    # caught: check_splits comparing the training split with the validation split only
    (["--eval_files={corpus}/train.jsonl"], "The train and test splits share"),
    # caught: config.apply_override without its unknown-key check (the KeyError traceback bench_quality's own _set
    # gave); the other two are its other refusals (a wrong type, no '=')
    (["--config.train.sed=1"], "bench_quality: error: --config.train.sed=1: Unknown config key 'train.sed': "
                                 "train has no field 'sed'. Valid keys there: ["),
    (["--config.train.num_steps=abc"], "--config.train.num_steps=abc: train.num_steps takes an integer"),
    (["--config.train"], "--config.train has no '='. Fix: write KEY=VALUE"),
    # caught: parse_rates calling float() unguarded ("could not convert string to float: 'abc'", no flag named)
    (["--learning_rates=1e-3,abc"], "bench_quality: error: --learning_rates=1e-3,abc: 'abc' is not a positive "
                                    "learning rate. Fix: write numbers"),
    (["--learning_rates=0"], "--learning_rates=0: '0' is not a positive learning rate"),
])
@pytest.mark.slow
def test_bench_quality_refuses_bad_input_before_training(corpus, tmp_path, extra, message):
    args = quality_args(corpus, tmp_path / "study", *[e.format(corpus=corpus) for e in extra])
    result = run_tool("tools/bench_quality.py", args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if "error:" in line]) == 1
    assert not (tmp_path / "study" / "baseline").exists()  # nothing trained


def quality_run(arm, test_ppl, tokens=3_000_000, rate=0.001):
    """A results.json run entry as bench_quality writes it (the fields this file's tests read)."""
    return {"arm": arm, "test_ppl": test_ppl, "validation_ppl": test_ppl - 5, "tokens": tokens, "learning_rate": rate,
            "inference_flops_per_token": 1.58e6, "train_flops": 2e13}


@pytest.mark.slow
def test_bench_quality_quick_runs_every_stage_and_a_rerun_skips_finished_runs(corpus, tmp_path):
    """--quick --arms=baseline,scone,oe trains the three arms, exports them and scores the test split through
    serving.evaluate; the RESULT lines carry the test perplexities it recorded, a rerun trains nothing (and without
    --arms names baseline and scone only), and a rerun with other settings is refused. A job stopped early with
    exit 0 (train.max_steps_per_run) is neither exported nor recorded, and the next invocation resumes it, also when
    an older bench_quality recorded it; the recorded validation perplexity is the validation split's (served again
    here). Caught: finished runs reused whatever the settings (check_finished_runs not called); run_arm without its
    quality_runs.unfinished check (the 60-step run exported and recorded, exit 0); forget_unfinished_runs not
    called (the recorded 60-step run skipped); the validation perplexity read from the last training log record
    (split "train") instead of the evaluation; --quick replacing the --arms given by baseline and scone."""
    study, records = tmp_path / "study", tmp_path / "runs.jsonl"
    common = quality_args(corpus, study, "--quick", "--allow_epochs", "--config.data.vocab_size=512",
                          f"--records={records}")
    args = [*common, "--arms=baseline,scone,oe"]
    stopped = run_tool("tools/bench_quality.py", [*args, "--config.train.max_steps_per_run=60"], timeout=900,
                       env=OPTIMISED)
    assert stopped.returncode == 2, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert ("bench_quality: error: baseline/lr0.0005 stopped before finishing (its last step is 60 of 98), so it was "
            "not exported, scored or recorded. Rerun the same command to resume it") in stopped.stderr
    run = study / "baseline" / "lr0.0005"
    assert not (run / "export").exists() and not (run / "DONE").exists() and not (study / "results.json").exists()
    assert not records.exists()  # nothing recorded
    # As an older bench_quality recorded such a run (exit 0 taken for the end of training): the rerun resumes it.
    (study / "results.json").write_text(json.dumps({"arms": {}, "runs": {"baseline/lr0.0005": {
        **quality_run("baseline", 50.0, rate=0.0005), "steps": 98, "test_bits_per_byte": 1.0, "test_tokens": 1000,
        "hit_rate": 0.0, "fgram_capacity": 0, "train_seconds": 1.0, "commit": ""}}}))
    first = run_tool("tools/bench_quality.py", args, timeout=1200, env=OPTIMISED)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert ("[baseline/lr0.0005] recorded, but its run did not finish (its last step is 60 of 98): it resumes"
            in first.stdout)
    assert "Resumed from step 60" in (run / "train.log").read_text()
    results = json.loads((study / "results.json").read_text())
    assert set(results["arms"]) == {"baseline", "scone", "oe"}
    # each finished run appended to the records with the study's settings (caught: the append call removed)
    appended = quality_records.read(str(records))
    assert [r["arm"] for r in appended] == ["baseline", "scone", "oe"] and {r["seed"] for r in appended} == {0}
    assert {r["defaults_version"] for r in appended} == {quality_records.DEFAULTS_VERSION}
    assert all(r["overrides"]["data.vocab_size"] == 512 and r["overrides"]["data.seq_len"] == 64 for r in appended)
    assert [r["test_ppl"] for r in appended] == [results["arms"][a]["test_ppl"] for a in ("baseline", "scone", "oe")]
    assert len({r["splits_sha256"] for r in appended}) == 1 and appended[0]["corpus"] == corpus.name
    for arm in ("baseline", "scone", "oe"):
        r = results["arms"][arm]
        assert f"RESULT ppl_{arm} {r['test_ppl']:.3f}" in first.stdout
        served = json.loads((tmp_path / "study" / arm / f"lr{r['learning_rate']}" / "test_eval.json").read_text())
        assert served["perplexity"] == r["test_ppl"] and served["data"]["eval_files"].endswith("test.jsonl")
        assert 1 < r["test_ppl"] < 600
    assert results["arms"]["scone"]["hit_rate"] > 0.2 and results["arms"]["baseline"]["hit_rate"] == 0
    assert results["arms"]["scone"]["inference_flops_per_token"] == results["arms"]["baseline"]["inference_flops_per_token"]
    assert results["arms"]["scone"]["train_flops"] > results["arms"]["baseline"]["train_flops"]
    _check_over_encoding_record(appended[2], study, first.stdout)
    # The recorded validation perplexity is the validation split's: the baseline's export scored there again.
    baseline = results["arms"]["baseline"]
    assert json.loads((run / "DONE").read_text())["step"] == baseline["steps"] == 98
    scored = run_tool("-m scone_jax.serving.evaluate", [f"--export={run / 'export'}", f"--result={tmp_path / 'v.json'}",
                                                        f"--config.data.eval_files={corpus}/validation.jsonl"])
    assert scored.returncode == 0, scored.stderr[-2000:]
    validation = json.loads((tmp_path / "v.json").read_text())["perplexity"]
    assert baseline["validation_ppl"] == pytest.approx(validation, rel=1e-4)
    assert abs(validation / baseline["test_ppl"] - 1) > 1e-2  # the two splits differ: the check tells them apart
    again = run_tool("tools/bench_quality.py", common, timeout=600, env=OPTIMISED)  # --quick's arms: baseline, scone
    assert again.returncode == 0 and "training" not in again.stdout.replace("training split", "")
    assert [a for a in ("baseline", "scone", "oe") if f"RESULT ppl_{a} " in again.stdout] == ["baseline", "scone"]
    assert len(quality_records.read(str(records))) == 3  # a skipped run is not recorded again
    # a finished run is not reused for other settings (here the method's plain input layer): refused in one line
    before = (tmp_path / "study" / "results.json").read_text()
    changed = run_tool("tools/bench_quality.py", [*args, "--config.model.embedding_multiplier=1"], timeout=600,
                       env=OPTIMISED)
    assert changed.returncode == 2, changed.stdout[-2000:] + changed.stderr[-2000:]
    assert "baseline/lr0.0005 in" in changed.stderr and "model.embedding_multiplier: 11.31" in changed.stderr
    assert "Traceback" not in changed.stderr and "training" not in changed.stdout.replace("training split", "")
    assert (tmp_path / "study" / "results.json").read_text() == before


def _check_over_encoding_record(record, study, stdout):
    """The `oe` arm's record from --quick: exported as a decoder bundle holding its n-gram tables, scored on the test
    split through serving.evaluate, with the figures the comparison with SCONE needs: accelerator bytes (the decoder
    with its tables: theirs is most of it), no host table, the projection's inference FLOPs, training tokens/s.
    Caught: the record's accelerator bytes taken from the decoder without its tables."""
    from scone_jax.study import study as quality_study

    assert record["arm"] == "oe" and set(quality_records.SERVING_FIELDS) <= set(record)
    assert not set(quality_records.FINETUNE_FIELDS) & set(record)  # a pretraining arm: no fine-tuning fields
    served = json.loads((study / "oe" / "lr0.0005" / "test_eval.json").read_text())
    assert served["perplexity"] == record["test_ppl"] and 1 < record["test_ppl"] < 600 and record["hit_rate"] == 0
    assert record["host_table_bytes"] == 0 and record["train_tokens_per_s"] > 0
    tables = 4 * 16 * sum(20_011 + 2 * s + 1 for s in range(8))  # 8 float32 tables of width 16, their rows unpadded
    vocab = json.loads((study / "oe" / "lr0.0005" / "config.json").read_text())["model"]["vocab_size"]
    baseline = quality_study.flops(_quick_config(quality_study, "baseline", vocab))
    assert record["accelerator_bytes"] == quality_study.flops(_quick_config(quality_study, "oe", vocab))[2]
    assert 0 <= record["accelerator_bytes"] - baseline[2] - tables - 4 * 128 * 128 < 4 * 16 * 128  # + projection, pad
    assert record["inference_flops_per_token"] - baseline[0] == 2 * 128 * 128  # the [d, d] projection
    assert f"RESULT accelerator_bytes_oe {record['accelerator_bytes']:.4g}" in stdout
    assert f"RESULT train_tokens_per_s_oe {record['train_tokens_per_s']:.4g}" in stdout


def _quick_config(quality_study, arm, vocab_size):
    """The config bench_quality's --quick run of `arm` trains with, its model.vocab_size the tokenizer's."""
    study = quality_study.Study("/unused", [arm], 50_000, 50_000, ["5e-4"], {}, "", True, {"data.vocab_size": 512})
    config = study.config(arm, "5e-4")
    with config.unlocked():
        config.model.vocab_size = vocab_size
    return config


@pytest.mark.slow
def test_bench_quality_names_a_run_that_another_process_holds(corpus, tmp_path):
    """A rerun while a run of its arms is in use (the job of a killed study still saving its checkpoint, a second
    study on the same WORKDIR) says so in one line, exit 2, before anything else. Caught: no
    quality_runs.runs_in_use check (the study went on, and that run's job failed on the lease: a traceback, exit 1)."""
    from scone_jax.runtime import ownership

    run = tmp_path / "study" / "baseline" / "lr0.0005"
    run.mkdir(parents=True)
    owner = ownership.acquire(str(run))
    try:
        result = run_tool("tools/bench_quality.py", quality_args(corpus, tmp_path / "study", "--quick"))
    finally:
        owner.release()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert (f"bench_quality: error: baseline/lr0.0005 (host {socket.gethostname()}, process {os.getpid()}, started "
            in result.stderr)
    assert f"in {tmp_path / 'study'} is in use by another process" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "study" / "tokenizer.model").exists()  # stopped before anything


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an orphan whose reaper has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_the_training_job_of_a_killed_bench_quality_stops_with_it(corpus, tmp_path):
    """bench_quality killed with SIGKILL (no handler of its own runs) while its main job trains: the job stops
    within seconds the way a preempted one does (SIGTERM: a checkpoint at the step reached, the workdir's lease
    released, so a rerun resumes at once) instead of training on unseen and holding the run. Caught: run_cli
    without parent_watch.child_environment, and main.py without stop_with_parent_if_asked (the job trained on)."""
    study = tmp_path / "study"
    run = study / "baseline" / "lr0.001"
    args = quality_args(corpus, study, "--arms=baseline", "--learning_rates=1e-3", "--tokens=2m", "--allow_epochs",
                        "--config.data.seq_len=64", "--config.model.max_seq_len=64",
                        "--config.data.global_batch_size=8", "--config.data.vocab_size=512")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "XLA_FLAGS": xla_flags()}
    parent = subprocess.Popen([sys.executable, "tools/bench_quality.py", *args], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = None
    try:
        deadline = time.monotonic() + 600
        while parent.poll() is None and time.monotonic() < deadline and not (
                (run / "train.log").exists() and "Step 1 done" in (run / "train.log").read_text()):
            time.sleep(1)
        assert parent.poll() is None, "bench_quality ended before its job trained a step"
        job = json.loads((run / "OWNER").read_text())["pid"]
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 120
        while running(job) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not running(job), "the training job outlived its bench_quality by 2 minutes"
    finally:
        if parent.poll() is None:
            parent.kill()
        if job is not None and running(job):
            os.kill(job, signal.SIGKILL)
    # Its own last lines went to the dead study's pipe; what it left says how it stopped: the lease released and a
    # checkpoint at the step reached (checkpoint_every is 200 here: only the SIGTERM stop saves before that).
    assert not (run / "OWNER").exists() and not (run / "DONE").exists()
    saved = [int(name) for name in os.listdir(run / "checkpoints") if name.isdigit()]
    assert saved and 0 < max(saved) < 200, saved


@pytest.mark.slow  # exports the shared serving run (once per session)
def test_embedding_scale_reads_final_norm_rows_against_the_token_rows(tmp_path_factory):
    """At initialisation (norm scale 1, bias 0) a final-norm output has norm sqrt(d) exactly, up to the norm's epsilon
    (docs/method.md §4), and the token rows have about init_std * sqrt(d): the figures the tool prints for the study."""
    from tests import serving_run

    path = serving_run.exported(tmp_path_factory, "float32")
    fgram_rows, token_rows = embedding_scale.rows(path)
    fgram, token = geometry.mean_norm(fgram_rows), geometry.mean_norm(token_rows)
    d, init_std = 64, 0.5  # tests/serving_run.py's model
    assert abs(fgram - d ** 0.5) < 0.01 * d ** 0.5
    assert abs(token - init_std * d ** 0.5) < 0.05 * init_std * d ** 0.5
    result = run_tool("tools/embedding_scale.py", [f"--export={path}"])
    assert result.returncode == 0, result.stderr[-2000:]
    name = embedding_scale.export_name(path)
    assert f"RESULT fgram_over_token_{name} {fgram / token:.4f}" in result.stdout
    assert f"RESULT token_row_alignment_{name} {geometry.alignment(token_rows):.4f}" in result.stdout
    # model.embedding_multiplier travels with the export and scales the token rows the decoder reads
    scaled = serving_run.exported_variant(tmp_path_factory, "multiplier3", embedding_multiplier=3.0)
    fgram_scaled, token_scaled = (geometry.mean_norm(x) for x in embedding_scale.rows(scaled))
    assert abs(token_scaled - 3 * init_std * d ** 0.5) < 0.05 * 3 * init_std * d ** 0.5
    assert abs(fgram_scaled - d ** 0.5) < 0.01 * d ** 0.5


def test_alignment_is_one_for_collapsed_rows_and_small_for_unrelated_ones():
    """The collapse measure: rows that are one direction at different lengths give 1; independent Gaussian rows give
    about 1/sqrt(rows); a shared offset three times the rows' own part gives 3/sqrt(10). Rows of zero norm (unused
    table rows) do not count. Caught: dividing every row by its norm (the zero rows made it nan)."""
    rng = np.random.default_rng(0)
    direction = rng.normal(size=64)
    collapsed = np.outer(rng.uniform(1, 5, 100), direction)
    assert abs(geometry.alignment(np.vstack([collapsed, np.zeros((3, 64))])) - 1) < 1e-6
    unrelated = rng.normal(size=(10_000, 64))
    assert abs(geometry.alignment(unrelated) - 0.01) < 0.005
    offset = 3 * np.sqrt(64) * direction / np.linalg.norm(direction)
    own = rng.normal(size=(10_000, 64)) * 100  # long rows, offset relative to each row's own scale below
    own = own / np.linalg.norm(own, axis=1, keepdims=True) * np.sqrt(64)
    assert abs(geometry.alignment(own + offset) - 3 / np.sqrt(10)) < 0.02


@pytest.mark.slow
def test_trace_steps_replays_a_run_through_the_production_step(tmp_path_factory):
    """tools/trace_steps.py on a SCONE run: every step's loss (the production train step's) is the mean of the
    losses it reads before that step at matched and unmatched positions, both kinds present; the rows' alignment
    is a cosine-like figure in (0, 1]; --positions_from splits a baseline's losses at the same positions. Caught: reading the state after the step (the split then missed the step's
    loss by 21% here) and splitting by the batch's loss mask instead of its f-gram slots
    (no matched positions). Bad input is one line and exit 2."""
    from scone_jax import config as config_lib
    from tests import serving_run

    run = serving_run.trained_run(tmp_path_factory)
    config = run["config"].copy_and_resolve_references()
    with config.unlocked():
        config.scone.vocab_path = os.path.join(run["workdir"], "fgrams")
        config.train.learning_rate = 0.05  # large enough that one update moves the next step's loss visibly
        config.scone.fgram_capacity = 512  # one device here, so one data shard holds every row
    replay = str(tmp_path_factory.mktemp("replay"))
    config_lib.write_config(config, replay)
    output = os.path.join(replay, "trace.jsonl")
    result = run_tool("tools/trace_steps.py", [f"--run={replay}", "--steps=3", f"--output={output}", "--print_every=1"])
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in open(output)]
    assert [r["step"] for r in records] == [1, 2, 3] and result.stdout.count("step ") == 3
    for r in records:
        assert r["matched_positions"] > 0 and r["unmatched_positions"] > 0
        split = (r["loss_matched"] * r["matched_positions"] + r["loss_unmatched"] * r["unmatched_positions"]) / (
            r["matched_positions"] + r["unmatched_positions"])
        np.testing.assert_allclose(split, r["loss"], rtol=1e-5)
        assert 0 < r["fgram_row_alignment"] <= 1 and 0 < r["fgram/model_grad_norm"] < r["grad_norm"]
    assert abs(records[2]["loss"] - records[0]["loss"]) > 1e-3  # it trains: the state moves between steps

    # --positions_from: the run's own vocabulary splits the positions as its slots do; a baseline gets the split too.
    vocab = os.path.join(run["workdir"], "fgrams")
    own = run_tool("tools/trace_steps.py", [f"--run={replay}", "--steps=1", f"--positions_from={vocab}",
                                            f"--output={output}"])
    assert own.returncode == 0, own.stderr[-2000:]
    first = json.loads(open(output).readline())
    assert first["matched_positions"] == records[0]["matched_positions"] and first["loss"] == records[0]["loss"]
    with config.unlocked():
        config.scone.enabled = False
    baseline = str(tmp_path_factory.mktemp("replay_baseline"))
    config_lib.write_config(config, baseline)
    plain = run_tool("tools/trace_steps.py", [f"--run={baseline}", "--steps=1", f"--positions_from={vocab}",
                                              f"--output={output}"])
    assert plain.returncode == 0, plain.stderr[-2000:]
    first = json.loads(open(output).readline())
    assert first["matched_positions"] == records[0]["matched_positions"] and "fgram_row_alignment" not in first

    missing = run_tool("tools/trace_steps.py", [f"--run={tmp_path_factory.mktemp('empty')}"])
    assert missing.returncode == 2 and "config.json" in missing.stderr and "Traceback" not in missing.stderr
    # --config.KEY=VALUE replays under another setting: another init seed, another first loss (caught: the
    # overrides read but never set on the run's config, which replayed the run's own seed).
    reseeded = run_tool("tools/trace_steps.py", [f"--run={replay}", "--steps=1", f"--output={output}",
                                                 "--config.train.seed=7"])
    assert reseeded.returncode == 0, reseeded.stderr[-2000:]
    assert json.loads(open(output).readline())["loss"] != records[0]["loss"]
    unknown = run_tool("tools/trace_steps.py", [f"--run={replay}", "--config.train.sed=1"])
    assert unknown.returncode == 2 and "train.sed" in unknown.stderr and "Traceback" not in unknown.stderr
