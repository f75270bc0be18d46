"""The quality study's records (scone_jax/study/records.py, experiments/quality/runs.jsonl) and the command that
builds docs/quality.md's tables and figure from them (tools/plot_quality.py, scone_jax/study/tables.py)."""
import json
import os
from collections import Counter

import pytest

from scone_jax.config import load_config_file
from tests.common import REPO, run_tool
from scone_jax.study import records as quality_records, tables as quality_tables

QUALITY = os.path.join(REPO, "configs", "quality.py")


def record(arm="scone_short", test_ppl=80.62, seed=0, rate=0.001, tokens=3006464, **overrides):
    r = dict.fromkeys(quality_records.FIELDS)
    r.update(arm=arm, overrides={**overrides, **({"train.seed": seed} if seed else {})}, seed=seed,
             learning_rate=rate, tokens=tokens, steps=tokens // 8192, validation_ppl=test_ppl - 10, test_ppl=test_ppl,
             test_bits_per_byte=2.7, test_tokens=413397, hit_rate=0.72 if arm.startswith("scone") else 0.0,
             train_flops=2.61e13, inference_flops_per_token=1580032.0, fgram_capacity=0, train_seconds=600.0,
             commit="abc1234", corpus="linux_doc", platform="cpu")
    return r


def test_records_round_trip_with_typed_overrides_and_the_seed(tmp_path):
    """A run's record reads back as written, its overrides typed as its config holds them and its seed in
    both places. Caught: the override's text kept ('false', '40': a table row for False/40 matched nothing);
    SCONE's settings kept on a baseline (its row then missed the baseline a study with them trained)."""
    settings = ["scone.output_norm", "train.fgram_model_delay_steps", "model.embedding_multiplier", "train.seed"]
    configs = {}
    for arm in ("scone", "baseline"):
        configs[arm] = load_config_file(f"{QUALITY}:{arm}")
        with configs[arm].unlocked():
            configs[arm].scone.output_norm = False
            configs[arm].train.fgram_model_delay_steps = 40
            configs[arm].model.embedding_multiplier = 1.0
            configs[arm].train.seed = 1
    scone = quality_records.overrides_of(configs["scone"], settings)
    assert scone == {"model.embedding_multiplier": 1.0, "scone.output_norm": False,
                     "train.fgram_model_delay_steps": 40, "train.seed": 1}
    assert type(scone["model.embedding_multiplier"]) is float and type(scone["train.seed"]) is int
    # a run without SCONE never reads SCONE's settings: left out, so it is the same baseline as any other
    assert quality_records.overrides_of(configs["baseline"], settings) == {"model.embedding_multiplier": 1.0,
                                                                           "train.seed": 1}
    path = str(tmp_path / "runs.jsonl")
    written = [record(), record(seed=1, test_ppl=81.10, **{"train.fgram_model_delay_steps": 40})]
    for r in written:
        quality_records.append(r, path)
    assert quality_records.read(path) == written
    assert list(quality_records.read(path)[0]) == list(quality_records.FIELDS)  # one field order on every line


def test_splits_hash_follows_the_bytes_not_the_paths(tmp_path):
    """Caught: hashing the files' names (a corpus moved unchanged got another hash)."""
    def splits(root, test_text="c\n"):
        root.mkdir()
        for name, text in (("train", "a\n"), ("validation", "b\n"), ("test", test_text)):
            (root / f"{name}.jsonl").write_text(json.dumps({"text": text}) + "\n")
        return [str(root / f"{n}.jsonl") for n in ("train", "validation", "test")]

    first = quality_records.splits_sha256(*splits(tmp_path / "a"))
    assert quality_records.splits_sha256(*splits(tmp_path / "moved")) == first
    assert quality_records.splits_sha256(*splits(tmp_path / "edited", test_text="d\n")) != first
    assert quality_records.corpus_name(str(tmp_path / "a" / "train.jsonl")) == "a"


def test_appending_never_rewrites_earlier_lines(tmp_path):
    """Earlier lines stay byte for byte; a last line cut short by a crash is ended, not joined to the next record,
    and read() names it. Caught: opening the file with "w" (every append rewrote the file: one record left)."""
    path = tmp_path / "runs.jsonl"
    quality_records.append(record(), str(path))
    quality_records.append(record(seed=1, test_ppl=81.10), str(path))
    before = path.read_bytes()
    quality_records.append(record(arm="baseline_short", test_ppl=88.65), str(path))
    after = path.read_bytes()
    assert after.startswith(before) and after.count(b"\n") == 3
    path.write_bytes(after + b'{"arm": "scone_s')  # a crash mid-line
    quality_records.append(record(arm="scone_s5k", test_ppl=77.94), str(path))
    lines = path.read_bytes().split(b"\n")
    assert lines[:3] == after.split(b"\n")[:3] and json.loads(lines[4])["test_ppl"] == 77.94
    with pytest.raises(ValueError, match=r"runs.jsonl:4 is not a JSON record"):
        quality_records.read(str(path))
    with pytest.raises(ValueError, match=r"lacks the fields \['seed'\]; nothing was appended"):
        quality_records.append({k: v for k, v in record().items() if k != "seed"}, str(path))


def test_the_migration_kept_every_run_of_the_old_result_files():
    """The 32 docs/quality_results*.json files of commit 341741f held 94 runs ("runs"; their "arms" were copies of
    runs), none the same run twice: 94 records, each file's count as it held, with the settings their names and
    docs/quality.md gave them. Caught: a record deleted; delay20 migrated as D = 40; a seed-1 file as seed 0."""
    records = quality_records.read()
    migrated = [r for r in records if r["source"]]
    assert len(migrated) == 94
    per_file = Counter(os.path.basename(r["source"]) for r in migrated)
    assert len(per_file) == 32 and per_file["quality_results.json"] == 16
    assert per_file["quality_results_plain.json"] == 18 and per_file["quality_results_3m_delay.json"] == 5
    assert sum(len(seeds) for seeds in quality_records.by_seed(migrated).values()) == 94  # no two share settings

    def only(source, arm):
        [r] = [r for r in migrated if r["source"] == f"docs/{source}" and r["arm"] == arm]
        return r

    assert only("quality_results_3m_delay20.json", "scone_short")["overrides"] == {
        "train.fgram_model_delay_steps": 20}
    assert only("quality_results_10m_delay_seed1.json", "scone")["overrides"] == {
        "train.fgram_model_delay_steps": 40, "train.seed": 1}
    assert only("quality_results_10m_delay_seed1.json", "scone")["seed"] == 1
    assert only("quality_results_3m_nonorm_lr1e-3.json", "scone_short")["overrides"] == {"scone.output_norm": False}
    assert only("quality_results_plain_seed1.json", "baseline_short")["overrides"] == {
        "model.embedding_multiplier": 1.0, "train.seed": 1}
    assert only("quality_results_3m_seed2.json", "scone_s5k")["overrides"] == {"scone.input_multiplier": 1.0,
                                                                                 "train.seed": 2}
    assert only("quality_results_10m_fgram_input_seed1.json", "scone")["overrides"] == {"train.seed": 1}
    assert all(r["splits_sha256"] is None and r["corpus"] == "linux_doc" for r in migrated)


def test_tables_reproduce_the_recorded_figures():
    """The 10M table's baseline row from the committed records: 50.81 / 50.98 (validation 44.03 / 44.19), mean
    50.90, as docs/quality.md has reported since the runs; the delayed runs stay out of the undelayed row.
    Caught: rows matched on arm, budget and rate without the overrides (the delayed, no-norm and seed
    reruns of `scone` overwrote its seeds: 40.87 / 40.33 where 38.33 / 41.74 belong)."""
    records = quality_records.read()
    ten = quality_tables.table("10m", records).splitlines()
    assert "| `baseline` (2 blocks) | 50.81 (44.03) | 50.98 (44.19) | 50.90 | 4.74e13 |  |" in ten
    assert "| `scone` (f-gram model 2 blocks, S = 20k, K = 5) | 38.33 (32.99) | 41.74 (35.60) | 40.04 | 8.67e13 | 0.72 |" \
        in ten
    assert "| `scone`, f-gram updates delayed 40 steps | 37.11 (31.83) | 37.36 (32.00) | 37.24 | 8.67e13 | 0.72 |" in ten
    # the page as committed is what the records give (tools/plot_quality.py was run)
    with open(os.path.join(REPO, "docs", "quality.md")) as f:
        page = f.read()
    assert quality_tables.fill(page, records) == page


def test_fill_rebuilds_the_blocks_and_keeps_the_prose():
    """Caught: the text after the last block dropped; a rerun of a seed counted twice (it is one entry)."""
    records = [record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=50.0),
               record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=50.81),  # a rerun of seed 0
               record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=50.98, seed=1)]
    spec = quality_tables.TABLES["10m"][0]
    assert {s: r["test_ppl"] for s, r in quality_tables.runs_of(spec, records).items()} == {0: 50.405, 1: 50.98}
    page = "intro\n<!-- records:all -->\nstale\n<!-- /records -->\nafter\n"
    filled = quality_tables.fill(page, records)
    assert filled.startswith("intro\n<!-- records:all -->\n| arm |") and filled.endswith("<!-- /records -->\nafter\n")
    assert "stale" not in filled and filled.count("| `baseline` |") == 3
    assert quality_tables.fill(filled, records) == filled
    with pytest.raises(ValueError, match="No record holds these rows of the table '10m': "):
        quality_tables.fill("<!-- records:10m -->\n<!-- /records -->", records)
    with pytest.raises(ValueError, match="Unknown records table '10M'"):
        quality_tables.fill("<!-- records:10M -->\n<!-- /records -->", records)


def test_runs_on_another_platform_or_corpus_are_other_rows_not_seeds():
    """The H200 reruns of the CPU study's settings (same arm, budget, rate and overrides) stand in their own
    rows: their numerics and corpus revision differ. Caught: the platform left out of `settings` (the H200's
    seed-0 run replaced the CPU's 50.81 in the CPU row), and the corpus left out (an English-only run joined)."""
    cpu = record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=50.81)
    h200 = dict(record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=49.0), platform="NVIDIA H200")
    english = dict(record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=48.0, seed=1), corpus="linux_doc_en")
    spec = quality_tables.TABLES["10m"][0]
    assert {s: r["test_ppl"] for s, r in quality_tables.runs_of(spec, [cpu, h200, english]).items()} == {0: 50.81}
    on_h200 = quality_tables.row("x", "baseline", "10m", 2e-3, platform="NVIDIA H200")
    assert {s: r["test_ppl"] for s, r in quality_tables.runs_of(on_h200, [cpu, h200, english]).items()} == {0: 49.0}


def test_plot_quality_rebuilds_the_tables_from_records_and_refuses_bad_input_in_one_line(tmp_path):
    path = tmp_path / "runs.jsonl"
    for r in (record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=50.81),
              record(arm="baseline", tokens=10002432, rate=2e-3, test_ppl=50.98, seed=1)):
        quality_records.append(r, str(path))
    page = tmp_path / "quality.md"
    page.write_text("prose\n<!-- records:all -->\n<!-- /records -->\n")
    result = run_tool("tools/plot_quality.py", [f"--records={path}", f"--markdown={page}", "--png="])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| `baseline` | linux_doc | 10.0M | 0.002 |  | 1 | 50.98 (40.98) | cpu | abc1234 |  |" in page.read_text()
    page.write_text("<!-- records:10m -->\n<!-- /records -->\n")
    refused = run_tool("tools/plot_quality.py", [f"--records={path}", f"--markdown={page}", "--png="])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "plot_quality: error: No record holds these rows of the table '10m': ['`baseline_2x` (4 blocks)'" in refused.stderr
    assert page.read_text() == "<!-- records:10m -->\n<!-- /records -->\n"  # nothing written on refusal
    path.write_text("not json\n")
    broken = run_tool("tools/plot_quality.py", [f"--records={path}", "--markdown=", "--png="])
    assert broken.returncode == 2 and f"{path}:1 is not a JSON record" in broken.stderr


def test_runs_meet_on_their_effective_settings_whatever_defaults_they_were_recorded_under(tmp_path):
    """configs/quality.py's SCONE arms now default to an 80-step delay (defaults version 2); records made before
    carry no defaults_version and their overrides are relative to the method's defaults (no delay). An old run
    with the override delay=80 and a new one with none are one table row; an old run without overrides stays
    the undelayed row, as does a new one that asked for delay 0. Caught: a record without defaults_version read
    as the current version (`record.get("defaults_version", DEFAULTS_VERSION)`: the old undelayed runs joined
    the 80-step row), and configs/quality.py's default changed without a new version."""
    def scone(test_ppl, seed, version=None, **overrides):
        r = record(arm="scone", tokens=10002432, rate=2e-3, test_ppl=test_ppl, seed=seed, **overrides)
        return r if version is None else dict(r, defaults_version=version)

    delay80 = {"train.fgram_model_delay_steps": 80}
    old_80, new_80 = scone(37.38, 0, **delay80), scone(37.39, 1, version=2)
    old_plain, new_plain = scone(38.33, 0), scone(41.74, 1, version=2, **{"train.fgram_model_delay_steps": 0})
    path = str(tmp_path / "runs.jsonl")
    for r in (old_80, new_80, old_plain, new_plain):
        quality_records.append(r, path)
    records = quality_records.read(path)
    assert "defaults_version" not in records[0] and records[1]["defaults_version"] == 2  # written as given
    delayed = quality_tables.row("x", "scone", "10m", 2e-3, delay80)
    plain = quality_tables.row("x", "scone", "10m", 2e-3)
    assert {s: r["test_ppl"] for s, r in quality_tables.runs_of(delayed, records).items()} == {0: 37.38, 1: 37.39}
    assert {s: r["test_ppl"] for s, r in quality_tables.runs_of(plain, records).items()} == {0: 38.33, 1: 41.74}
    assert [quality_records.effective(r) for r in records] == [delay80, delay80, {}, {}]
    # a baseline reads no SCONE default: its old and new records are one setting
    base = [record(arm="baseline", test_ppl=50.81), dict(record(arm="baseline", test_ppl=50.98, seed=1),
                                                         defaults_version=2)]
    assert [quality_records.effective(r) for r in base] == [{}, {}]
    # the newest version is what configs/quality.py holds now
    now = quality_records.DEFAULTS[quality_records.DEFAULTS_VERSION]
    config = load_config_file(f"{QUALITY}:scone")
    assert {k: quality_records._get(config, k) for k in now} == now
    assert load_config_file(f"{QUALITY}:baseline").train.fgram_model_delay_steps == 0


def test_a_delay_given_as_a_share_of_the_run_meets_the_runs_held_back_as_many_steps(tmp_path):
    """Defaults version 3 holds the f-gram model back for 0.065 of the run (configs/quality.py HOLD_BACK):
    ceil(0.065 x 1,221) = 80 steps at 10M, ceil(0.065 x 367) = 24 at 3M. A run is compared by the steps its
    delay gave, however it was asked: today's 10M default is the old 80-step row, today's 3M default the row of
    runs given 24 steps, the share set to 0 the method. Caught: the share turned into steps with round() or
    int() (79 and 23 at 10M and 3M: today's runs left every older row); the share kept as a key of its own
    (today's 10M runs apart from the 80-step runs made under version 2)."""
    def scone(arm, tokens, version, **overrides):
        return dict(record(arm=arm, tokens=tokens, **overrides), defaults_version=version)

    ten, three = 10002432, 3006464
    steps24 = {"train.fgram_model_delay_steps": 24}
    assert quality_records.DEFAULTS[3] == {"train.fgram_model_delay_steps": 0,
                                           "train.fgram_model_delay_fraction": 0.065}
    found = [quality_records.effective(r) for r in (
        scone("scone", ten, 3), scone("scone", ten, 2), scone("scone", ten, 1, **{"train.fgram_model_delay_steps": 80}),
        scone("scone_short", three, 3), scone("scone_short", three, 2, **steps24), scone("scone_short", three, 2),
        scone("scone", ten, 3, **{"train.fgram_model_delay_fraction": 0.0}),
        scone("scone", ten, 3, **{"train.fgram_model_delay_fraction": 0.0,
                                  "train.fgram_model_delay_steps_per_layer": 20}),
        scone("scone", ten, 1, **{"train.fgram_model_delay_fraction": 0.5}),
        scone("baseline", ten, 3))]
    assert found == [{"train.fgram_model_delay_steps": 80}] * 3 + [steps24] * 2 + [
        {"train.fgram_model_delay_steps": 80}, {}, {"train.fgram_model_delay_steps_per_layer": 20},
        {"train.fgram_model_delay_steps": 611}, {}]
    path = str(tmp_path / "runs.jsonl")
    for seed, version, overrides in ((0, 3, {}), (1, 2, steps24), (2, 2, {})):
        quality_records.append(dict(record(test_ppl=70.0 + seed, seed=seed, **overrides), defaults_version=version),
                               path)
    row = quality_tables.row("x", "scone_short", "3m", 1e-3, steps24)
    assert {s: r["test_ppl"] for s, r in quality_tables.runs_of(row, quality_records.read(path)).items()} == {
        0: 70.0, 1: 71.0}
