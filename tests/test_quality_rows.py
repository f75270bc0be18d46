"""What a row of docs/quality.md's tables holds (scone_jax/study/tables.py, records.py): runs compared by what
changes their result, on the committed records (experiments/quality/runs.jsonl), whose 10M baseline row is
50.81 / 50.98, mean 50.90. Each test names the slip it was seen to catch."""
import copy
import json

import pytest

from scone_jax.study import records as quality_records, tables as quality_tables

BASELINE_10M = quality_tables.TABLES["10m"][0]  # `baseline` (2 blocks), 10m at 2e-3


def _cells(spec, records):
    return {seed: round(entry["test_ppl"], 2) for seed, entry in quality_tables.runs_of(spec, records).items()}


def _mean(spec, records):
    return round(quality_tables.mean_run(quality_tables.runs_of(spec, records))["test_ppl"], 2)


@pytest.fixture(scope="module")
def committed():
    records = quality_records.read()
    [seed1] = [r for r in records if r["arm"] == "baseline" and r["learning_rate"] == 2e-3 and r["seed"] == 1
               and r["tokens"] == 10002432 and r["platform"] == "cpu" and r["corpus"] == "linux_doc"
               and not quality_records.effective(r)]
    return records, seed1


def test_loop_keys_never_split_a_rows_seeds_and_stay_in_the_record(committed):
    """Seed 1 of the 10M baseline run again with data.worker_count and train.max_steps_per_run (the documented way
    to fit job slots; config_keys.py declares both LOOP): the row still has both seeds, mean 50.90, and the record
    still holds the overrides. A SETTING key (train.weight_decay) does make another row. Caught: records.effective
    without its LOOP filter (the row lost seed 1: 50.81)."""
    records, seed1 = committed
    rerun = copy.deepcopy(seed1)
    rerun["overrides"].update({"data.worker_count": 1, "train.max_steps_per_run": 300, "train.log_every": 5})
    replaced = [r for r in records if r is not seed1] + [rerun]
    assert _cells(BASELINE_10M, replaced) == {0: 50.81, 1: 50.98} and _mean(BASELINE_10M, replaced) == 50.90
    assert rerun["overrides"]["data.worker_count"] == 1 and quality_records.effective(rerun) == {}
    decayed = dict(copy.deepcopy(seed1), overrides={"train.seed": 1, "train.weight_decay": 0.0})
    assert _cells(BASELINE_10M, [r for r in records if r is not seed1] + [decayed]) == {0: 50.81}
    # every LOOP key, and no other but the seed (a column of its own), is left out of the comparison
    from scone_jax import config_keys
    for key in config_keys.KEYS:
        if key.name == "train.seed":
            continue
        probe = dict(seed1, overrides={key.name: "x"})
        assert (quality_records.effective(probe) == {}) == (key.role is config_keys.LOOP), key.name


def test_other_token_budgets_are_other_rows_in_any_order(committed):
    """A 9.6M-token run (1,172 steps) is not another seed of the 10M row, and a 10.4M run (1,270 steps) of seed 1
    does not replace its seed 1, whichever comes first in the file; a row of budget 9.6m holds the 9.6M run.
    Before: rows matched on the budget rounded to millions (50.90 -> 57.26 with the 9.6M run; seed 1 -> 45.00 with
    the 10.4M one appended after, kept at 50.98 when it came first). Caught: tables.trained_for comparing budgets
    rounded to millions again (the row matched three step counts)."""
    records, seed1 = committed
    short = dict(copy.deepcopy(seed1), seed=2, steps=1172, tokens=1172 * 8192, test_ppl=70.0,
                 overrides={"train.seed": 2})
    long = dict(copy.deepcopy(seed1), steps=1270, tokens=1270 * 8192, test_ppl=45.0)
    for order in (records + [short, long], [long, short] + records):
        assert _cells(BASELINE_10M, order) == {0: 50.81, 1: 50.98} and _mean(BASELINE_10M, order) == 50.90
    assert _cells(dict(BASELINE_10M, budget="9.6m"), records + [short, long]) == {2: 70.0}
    assert _cells(dict(BASELINE_10M, budget="10.4m"), records + [short, long]) == {1: 45.0}
    assert quality_tables.budget_tokens("500k") == 500_000 and quality_tables.budget_tokens("8m") == 8_000_000


def test_a_setting_and_seed_recorded_twice_is_one_entry_whatever_the_order(committed):
    """The same run appended twice (two bench_quality runs on one workdir did that) is one entry and one line of the
    `all` table; two runs of one setting and seed that measured differently are one entry, their mean, saying
    '2 runs', the same in either file order. Caught: records.latest (the last line won: seed 1 was 45.00 or 50.98
    by file order; the duplicate was listed twice); records.distinct keeping duplicates (the cell said '2 runs')."""
    records, seed1 = committed
    twice = records + [copy.deepcopy(seed1)]
    assert _cells(BASELINE_10M, twice) == {0: 50.81, 1: 50.98}
    assert "2 runs" not in quality_tables.table("10m", twice)
    assert quality_tables.every_run(twice) == quality_tables.every_run(records)
    other = dict(copy.deepcopy(seed1), test_ppl=45.0, validation_ppl=40.0, commit="fedcba9")
    tables = {quality_tables.table("10m", order) for order in (records + [other], [other] + records)}
    assert len(tables) == 1
    [ten] = tables
    mean1 = (seed1["test_ppl"] + 45.0) / 2
    assert f"| `baseline` (2 blocks) | 50.81 (44.03) | {mean1:.2f} ({(seed1['validation_ppl'] + 40) / 2:.2f}), 2 runs |" \
        in ten
    assert quality_tables.every_run(records + [other]).count("| `baseline` | linux_doc | 10.0M | 0.002 |  | 1 |") == 2


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


@pytest.mark.parametrize("field,value,message", [
    ("seed", "1", 'has seed="1", which must be an integer >= 0'),
    ("seed", True, "has seed=true, which must be an integer >= 0"),
    ("test_ppl", None, "has test_ppl=null, which must be a finite perplexity (a number >= 1)"),
    ("learning_rate", "2e-3", 'has learning_rate="2e-3", which must be a number > 0'),
    ("tokens", 1.5, "has tokens=1.5, which must be an integer > 0"),
    ("overrides", ["train.seed"], 'has overrides=["train.seed"], which must be an object of dotted keys'),
    ("platform", 7, "has platform=7, which must be a non-empty string"),
    ("defaults_version", 9, "has defaults_version=9, which must be one of [1, 2, 3]"),
])
def test_a_mistyped_record_is_refused_naming_its_line_and_field(tmp_path, committed, field, value, message):
    """A record whose field has the wrong type reads as one line naming the file, the line and the field, and is
    never appended. Caught: read() checking only that the fields exist ('seed': '1' made seed '1' a column of its
    own; test_ppl null was a TypeError traceback in the table)."""
    _, seed1 = committed
    path = tmp_path / "runs.jsonl"
    _write(path, [json.dumps(seed1), json.dumps(dict(seed1, **{field: value}))])
    with pytest.raises(ValueError) as refused:
        quality_records.read(str(path))
    assert str(refused.value) == f"{path}:2 {message}. Fix: restore that line from git (the file is append-only)."
    with pytest.raises(ValueError, match="nothing was appended"):
        quality_records.append(dict(seed1, **{field: value}), str(path))
    assert len(path.read_text().splitlines()) == 2


def test_blank_lines_are_not_records_and_not_errors(tmp_path, committed):
    """An editor's blank last line (or a blank line between records) is skipped; an append after it stays one
    line per record. Caught: json.loads on every line ('runs.jsonl:3 is not a JSON record')."""
    _, seed1 = committed
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(seed1) + "\n\n" + json.dumps(dict(seed1, seed=2)) + "\n  \n")
    assert [r["seed"] for r in quality_records.read(str(path))] == [1, 2]
    quality_records.append(dict(seed1, seed=3), str(path))
    assert [r["seed"] for r in quality_records.read(str(path))] == [1, 2, 3]
    assert quality_records.read(str(path))[0] == seed1


def test_a_run_without_a_seed_override_is_seed_0_as_the_migrated_records_are():
    """bench_quality records `seed` from the run's config and puts train.seed in the overrides only when given; the
    94 migrated runs without it are seed 0. So every arm of configs/quality.py, and the declared default, must train
    seed 0, or new runs without an override would stand in another seed's column. Caught: train.seed's declared
    default changed to 1."""
    from scone_jax.config import base_config, load_config_file
    from scone_jax.study.study import ARMS, CONFIG
    from scone_jax.study.protocol import variant

    assert base_config().train.seed == 0
    assert {load_config_file(f"{CONFIG}:{variant(arm)}").train.seed for arm in ARMS} == {0}
    migrated = [r for r in quality_records.read() if r["source"]]
    assert {r["seed"] for r in migrated if "train.seed" not in r["overrides"]} == {0}
