"""tools/bench_finetune.py (issue 55's fine-tuning comparison): its --quick run end to end, its refusals, and the
docs/quality.md block built from its records (scone_jax/study/finetune_table.py)."""
import json
import math
import os

import pytest

from scone_jax.study import finetune_table, records as quality_records, tables
from tests.common import OPTIMISED, run_tool
from tests.test_quality_tools import corpus  # noqa: F401 - a fixture: KJV text split into train/validation/test

WORDNET = "/usr/share/wordnet"
ARMS = ("ft_plain", "ft_scone_pretrained", "ft_scone_scratch")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    if not os.path.isfile(os.path.join(WORDNET, "data.noun")):
        pytest.skip("WordNet is not installed (apt-get install wordnet-base)")
    out = tmp_path_factory.mktemp("chat")
    result = run_tool("tools/make_chat_corpus.py", [f"--output={out}", "--max_synsets=300"])
    assert result.returncode == 0, result.stderr
    return out


def _args(corpus, chat, workdir, *extra):
    return [f"--pretrain_train_files={corpus}/train.jsonl", f"--pretrain_validation_files={corpus}/validation.jsonl",
            f"--pretrain_test_files={corpus}/test.jsonl", f"--chat_dir={chat}", f"--workdir={workdir}", *extra]


@pytest.mark.slow
def test_quick_run_records_every_arm_from_the_serving_path_and_a_rerun_trains_nothing(corpus, chat, tmp_path):
    """--quick pretrains both models, exports them as Hugging Face checkpoints, fine-tunes the three arms and records
    five runs whose test perplexity is the one serving.evaluate wrote for the run's export. Caught: the f-gram source
    exported from the main run instead of the larger one (hf_large's config had 2 layers, and the source arm's
    record said scone.num_layers=2); a record made from the validation figure instead of test_eval.json's; a seed
    that set train.seed alone (ft_plain's seed 1 repeated seed 0 to the last digit: it has no random parameter)."""
    workdir, path = tmp_path / "ft", tmp_path / "runs.jsonl"
    args = _args(corpus, chat, workdir, "--quick", "--large_arm=baseline_2x", "--seeds=1", f"--records={path}")
    result = run_tool("tools/bench_finetune.py", args, timeout=1500, env=OPTIMISED)
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = quality_records.read(str(path))
    assert [r["arm"] for r in recorded] == ["pretrain_main", "pretrain_large", *ARMS]
    large = json.load(open(workdir / "hf_large" / "config.json"))
    assert large["model_type"] == "gpt2" and large["n_layer"] == 4  # configs/quality.py's baseline_2x
    assert json.load(open(workdir / "hf_main" / "config.json"))["n_layer"] == 2
    fine = {r["arm"]: r for r in recorded[2:]}
    for arm, r in fine.items():
        served = json.load(open(workdir / "seed1" / arm / f"lr{r['learning_rate']}" / "test_eval.json"))
        assert r["seed"] == r["overrides"]["train.seed"] == r["overrides"]["data.shuffle_seed"] == 1
        assert r["test_ppl"] == served["perplexity"] and math.isfinite(r["test_ppl"]) and r["test_ppl"] > 1
        assert r["test_bits_per_byte"] is None and r["corpus"] == os.path.basename(chat)
        assert r["decode_ms_per_token"] > 0 and r["pretrain"].startswith("split, ")
    assert len({r["test_tokens"] for r in fine.values()}) == 1  # the same assistant tokens for every arm
    assert fine["ft_scone_pretrained"]["overrides"]["scone.num_layers"] == 4
    assert fine["ft_scone_scratch"]["overrides"]["scone.num_layers"] == 4
    assert "scone.num_layers" not in fine["ft_plain"]["overrides"]
    for arm in ARMS[1:]:
        assert fine[arm]["decode_ms_per_token_plain"] > 0 and fine[arm]["host_table_bytes"] > 0
        assert (fine[arm]["overrides"]["scone.combine"], fine[arm]["overrides"]["scone.gate"]) == ("add", False)
    assert "**The paper's direction" in (workdir / "finetune.md").read_text()
    logs = {p: p.stat().st_size for p in workdir.rglob("train.log")}

    again = run_tool("tools/bench_finetune.py", args, timeout=600, env=OPTIMISED)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished before: skipped") == 5  # 2 pretrained models + 3 fine-tunes
    assert len(quality_records.read(str(path))) == 5
    assert {p: p.stat().st_size for p in workdir.rglob("train.log")} == logs


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", [
    (["--arms=ft_plain,ft_huge"], "--arms=ft_plain,ft_huge: unknown arm(s) ['ft_huge']"),
    (["--seeds=0,0"], "--seeds=0,0: give distinct integers >= 0"),
    (["--seeds=a"], "--seeds=a: give distinct integers >= 0"),
    (["--learning_rates=x"], "'x' is not a positive learning rate"),
    (["--main_workdir=/nonexistent", "--large_workdir=/nonexistent"], "Give either all three --pretrain_*_files"),
    (["--chat_dir={tmp}"], "lacks train.jsonl, validation.jsonl, test.jsonl, chat_template.jinja. Fix: make it"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_written(corpus, chat, tmp_path, extra, message):
    """Caught: the flag checks placed after the workdir was created (WORKDIR existed after a refusal)."""
    workdir = tmp_path / "never"
    args = _args(corpus, chat, workdir) + [e.format(tmp=tmp_path) for e in extra]
    result = run_tool("tools/bench_finetune.py", args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("bench_finetune: error: ") and message in lines[-1], lines[-1]
    assert not workdir.exists()


@pytest.mark.slow
def test_an_unfinished_run_given_as_the_main_model_is_refused(chat, tmp_path):
    """Caught: --main_workdir taken without the finished-run check (the HF export then failed inside the study)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": {"num_steps": 10}}))
    result = run_tool("tools/bench_finetune.py", [f"--main_workdir={run}", f"--large_workdir={run}",
                                                  f"--chat_dir={chat}", f"--workdir={tmp_path / 'w'}"])
    assert result.returncode == 2
    assert f"{run} is not a finished run (its last step is 0 of 10)" in result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_finished_runs_given_must_share_one_tokenizer_json(chat, tmp_path):
    """--main_workdir / --large_workdir: a run with the workdir's SentencePiece tokenizer, or two runs of different
    tokenizer.json files, are refused before anything is written. Caught: the tokenizers left unchecked (the study
    went on with the runs: no exit 2 before WORKDIR was written)."""
    def finished(name, tokenizer_path):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"train": {"num_steps": 3}, "data": {"tokenizer_path": tokenizer_path}}))
        (run / "metrics.jsonl").write_text(json.dumps({"split": "step", "step": 3}) + "\n")
        (run / "DONE").write_text(json.dumps({"step": 3}))
        return run

    def refused(main, large):
        result = run_tool("tools/bench_finetune.py", [f"--main_workdir={main}", f"--large_workdir={large}",
                                                      f"--chat_dir={chat}", f"--workdir={tmp_path / 'w'}"])
        assert result.returncode == 2 and not (tmp_path / "w").exists()
        return result.stderr.strip().splitlines()[-1]

    from tokenizers import Tokenizer, models, pre_tokenizers

    paths = []
    for i, words in enumerate((["a", "b"], ["b", "a"])):
        tok = Tokenizer(models.WordLevel({w: j for j, w in enumerate(words + ["<|endoftext|>"])}, unk_token="a"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(["<|endoftext|>"])
        tok.save(str(tmp_path / f"tok{i}.json"))
        paths.append(str(tmp_path / f"tok{i}.json"))
    sentencepiece = finished("sp", "")
    one, other = finished("one", paths[0]), finished("other", paths[1])
    assert "sp was trained with a SentencePiece tokenizer (its workdir tokenizer.model)" in refused(sentencepiece, one)
    assert "read different tokenizers" in refused(one, other)


def _record(arm, seed, rate, validation, test, **extra):
    base = {"arm": arm, "overrides": {"train.seed": seed}, "seed": seed, "learning_rate": rate, "tokens": 4096,
            "steps": 1, "validation_ppl": validation, "test_ppl": test, "test_bits_per_byte": None,
            "test_tokens": 100, "hit_rate": 0.0 if arm == "ft_plain" else 0.7, "inference_flops_per_token": 1.0,
            "train_flops": 1e12, "fgram_capacity": 0, "train_seconds": 60.0, "train_tokens_per_s": 3000.0, "commit": "x", "corpus": "wordnet_chat",
            "splits_sha256": None, "source": None, "platform": "cpu", "pretrain": "gcide, 2M tokens",
            "decode_ms_per_token": 1.0, "host_table_bytes": 0 if arm == "ft_plain" else 5_000_000}
    if arm != "ft_plain":
        base.update(decode_ms_per_token=1.1, decode_ms_per_token_plain=1.0, train_flops=3e12, train_tokens_per_s=1000.0)
    base.update(extra)
    quality_records.check(base) and pytest.fail(quality_records.check(base))
    return base


def test_the_block_picks_each_arms_rate_by_the_first_seeds_validation_and_says_whether_the_direction_holds():
    """Hand-made records: each arm's chosen rate is the one of lowest seed-0 validation (not test) perplexity, the
    means are over the seeds at that rate, and the sentence compares the pretrained arm with the other two.
    Caught: the arms unpacked in the wrong order (plain taken for the pretrained arm: the sentence said 'holds' with
    the plain fine-tune's figure as SCONE's), the rate chosen by test perplexity, and a second setting of an arm at
    one rate silently replacing the first."""
    runs = [_record("ft_plain", 0, 5e-4, 20.0, 21.0), _record("ft_plain", 0, 2e-3, 19.0, 22.0),
            _record("ft_plain", 1, 2e-3, 19.5, 22.4),
            _record("ft_scone_pretrained", 0, 5e-4, 18.0, 19.0), _record("ft_scone_pretrained", 1, 5e-4, 18.2, 19.4),
            _record("ft_scone_scratch", 0, 5e-4, 19.9, 20.5), _record("ft_scone_scratch", 1, 5e-4, 19.8, 20.9)]
    best = finetune_table.chosen(runs)
    assert best["ft_plain"][0] == 2e-3 and sorted(best["ft_plain"][1]) == [0, 1]
    text = finetune_table.verdict(best)
    assert text.startswith("**The paper's direction holds here**: SCONE with its f-gram model grown")
    assert "seed by seed it is ahead of the plain fine-tune on 2 of 2 and of the one from scratch on 2 of 2." in text
    assert "reaches 19.20 test perplexity" in text and "against 22.20 for the plain fine-tune (-13.5%)" in text
    assert "20.70 for the same f-gram model trained from scratch (-7.2%)" in text
    assert "decoding 1.10 ms per token against 1.00 for the plain export timed alongside (+10.0%)" in text
    assert "5.0 MB in host RAM" in text and "Cost: 3.00x the plain fine-tune's training FLOPs (1,000 training tokens/s " \
        "against 3,000 here)" in text
    worse = runs[:3] + [_record("ft_scone_pretrained", s, 5e-4, 18.0, 23.0) for s in (0, 1)] + runs[5:]
    assert "does not hold" in finetune_table.verdict(finetune_table.chosen(worse))
    page = tables.fill("a\n<!-- records:finetune -->\nold\n<!-- /records -->\nb\n", runs)
    assert "| plain fine-tune (`ft_plain`) | 0.002 | 22.00 (19.00) | 22.40 (19.50) | 22.20 | 1e12 (3,000) | 1.00 | 0.0 |  |" \
        in page
    assert page.startswith("a\n<!-- records:finetune -->\nFine-tuning corpus `wordnet_chat`") and page.endswith("b\n")
    other = _record("ft_plain", 0, 2e-3, 10.0, 11.0, overrides={"train.seed": 0, "data.seq_len": 128})
    with pytest.raises(ValueError, match="hold ft_plain at 0.002 under two settings"):  # not one silently kept
        finetune_table.chosen(runs + [other])


def test_fine_tunes_from_other_pretraining_are_other_settings_and_a_null_bits_per_byte_is_a_record():
    """`pretrain` tells runs apart (records.settings), and test_bits_per_byte may be null (conversations) but not a
    string; a data order equal to the seed is the seed, another one a setting. Caught: settings() without
    `pretrain` (two studies' seed-0 runs merged into one averaged entry); effective() keeping data.shuffle_seed
    (the fine-tuning study's seeds 0 and 1 became two settings of one seed each)."""
    a, b = _record("ft_plain", 0, 1e-3, 20.0, 21.0), _record("ft_plain", 0, 1e-3, 30.0, 31.0, pretrain="other")
    assert quality_records.settings(a) != quality_records.settings(b)
    assert len(quality_records.by_seed([a, b])) == 2
    assert "test_bits_per_byte" in quality_records.check({**a, "test_bits_per_byte": "x"})
    seed0 = _record("ft_plain", 0, 1e-3, 20.0, 21.0, overrides={"train.seed": 0, "data.shuffle_seed": 0})
    seed1 = _record("ft_plain", 1, 1e-3, 20.5, 21.5, overrides={"train.seed": 1, "data.shuffle_seed": 1})
    other_order = _record("ft_plain", 1, 1e-3, 20.5, 21.5, overrides={"train.seed": 1, "data.shuffle_seed": 7})
    assert list(quality_records.by_seed([seed0, seed1]).values()) == [{0: dict(seed0, runs=1), 1: dict(seed1, runs=1)}]
    assert len(quality_records.by_seed([seed0, other_order])) == 2  # a data order other than the seed's: a setting


def test_the_block_lists_the_pretrained_models_its_study_started_from():
    """Pretraining records of two budgets (2M, then 10M for a second study still pretraining): the block of the 2M
    study lists the 2M models, not the newest of each arm. Caught: the latest record of each pretrained arm (the 10M
    main model beside the 2M larger one, under a header saying the fine-tunes started from 2M)."""
    started = "gcide, 2,007,040 tokens; main 2 blocks, f-gram source 4 blocks, width 128; tokenizer x"
    def pretraining(arm, ppl, tokens):  # a pretraining record names no `pretrain`
        return {k: v for k, v in _record(arm, 0, 2e-3, ppl, ppl, corpus="gcide", tokens=tokens).items()
                if k != "pretrain"}

    pre = [pretraining("pretrain_main", 80.0, 2_007_040), pretraining("pretrain_large", 83.0, 2_007_040)]
    runs = [_record("ft_plain", 0, 2e-3, 19.0, 22.0, pretrain=started),
            _record("ft_scone_pretrained", 0, 2e-3, 18.0, 19.0, pretrain=started)]
    newer = [pretraining("pretrain_main", 28.0, 10_002_432)]
    text = finetune_table.section(pre + runs + newer)
    assert "| `pretrain_main` | gcide | 2.01M | 80.00 (80.00) |" in text
    assert "| `pretrain_large` | gcide | 2.01M | 83.00 (83.00) |" in text and "28.00" not in text
    given = [dict(r, pretrain="runs given: ...") for r in runs]  # no budget named: no pretrained table
    assert "The pretrained models" not in finetune_table.section(pre + given + newer)
