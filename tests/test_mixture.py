"""Training mixtures (data/mixture.py): the schedule against a plain count, each row from its component's
own stream at that component's next position, the same batches for any worker count and after resume,
token shares that follow the weights, the refusals, and extraction counting the mixture by weight."""
import re

import ml_collections
import numpy as np
import pytest

from scone_jax import config as config_lib
from scone_jax.data import documents, mixture, packing, pipeline, sources
from tests.common import REPO, small_config


def test_a_plain_glob_list_is_no_mixture_and_weights_are_relative():
    assert mixture.parse("/d/a/*.txt,/d/b.txt") is None and mixture.parse("") is None
    assert mixture.parse("web=/d/web/*.jsonl,/d/w2.jsonl@3; books=/d/books/*.jsonl.gz@1") == {
        "web": {"files": "/d/web/*.jsonl,/d/w2.jsonl", "weight": 3.0, "order": 0},
        "books": {"files": "/d/books/*.jsonl.gz", "weight": 1.0, "order": 1}}
    data = config_lib.resolve_data({"train_files": "web=/d/web/*.jsonl,/d/w2.jsonl@3; books=/d/books/*.jsonl.gz@1"})
    got = mixture.components(ml_collections.ConfigDict(data))
    assert [(c.name, c.files, c.weight) for c in got] == [("web", "/d/web/*.jsonl,/d/w2.jsonl", 0.75),
                                                           ("books", "/d/books/*.jsonl.gz", 0.25)]
    assert data["train_files"] == "" and mixture.all_files(ml_collections.ConfigDict(data)) == (
        "/d/web/*.jsonl,/d/w2.jsonl,/d/books/*.jsonl.gz")
    plain = ml_collections.ConfigDict(config_lib.resolve_data({"train_files": "/d/a/*.txt"}))
    assert mixture.components(plain) is None and mixture.all_files(plain) == "/d/a/*.txt"


@pytest.mark.parametrize("value,message", [
    ("web=/a@0.5;web=/b@0.5", "the component name 'web' is used twice"),
    ("web=/a@0.5;books=/b@x", "component 'books' has weight 'x', not a positive number"),
    ("web=/a@0.5;books=/b@-1", "component 'books' has weight '-1', not a positive number"),
    ("web=/a@0.5;books=/b@0", "component 'books' has weight '0', not a positive number"),
    ("web=/a@0.5;books=@0.5", "component 'books' names no files"),
    ("web=/a@0.5;/b/*.txt", "'/b/*.txt' is not NAME=GLOBS@WEIGHT"),
    ("web=/a@1e308;books=/b@1e308", "the components' weights sum to inf, not a finite number"),
    ("web=/a@1;books=/b@0.0001", "component 'books' has 0.0001 of the total weight, below 1/4096"),
])
def test_bad_mixtures_are_refused_before_anything_runs(value, message):
    """Caught (the last two cases): weights summing to inf accepted as they were, every share 0 (the run took its
    workdir, then the pipeline died on an IndexError); a component under 1/4096 of the weight refused only by
    the Schedule, after the workdir, tokenizer and f-grams were made, without naming the component."""
    config = small_config()
    config.data.train_files = value
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        config_lib.validate(config)
    assert "Fix:" in str(e.value) and "\n" not in str(e.value)


def test_a_component_of_exactly_one_row_per_period_is_accepted_and_gets_it():
    """The refusal's threshold is the schedule's own: 1/4096 of the weight is one row per period, not zero."""
    components = mixture.components(_resolved(f"web=/a@{mixture.PERIOD - 1};books=/b@1"))
    assert components[1].weight == 1 / mixture.PERIOD
    owner, _ = mixture.Schedule([c.weight for c in components], seed=0).rows(0, 3 * mixture.PERIOD)
    assert [int((owner[p * mixture.PERIOD:(p + 1) * mixture.PERIOD] == 1).sum()) for p in range(3)] == [1, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("weights,message", [
    ("@1e308;b={path}@1e308", "weights sum to inf"),
    ("@1;b={path}@1e-5", "component 'b' has 1e-05 of the total weight"),
])
def test_the_training_job_refuses_a_bad_mixture_in_one_line_before_writing_anything(tokenizer_path, tmp_path,
                                                                                   weights, message):
    """`python -m scone_jax.main`: exit 2, one line on stderr, an empty workdir. Caught: the overflowing sum
    (it wrote config.json, metrics.jsonl and checkpoints/, then died on a pipeline IndexError) and the tiny
    component (refused only once the data pipeline was built, its workdir already written)."""
    import os
    import subprocess
    import sys

    text = tmp_path / "a.txt"
    text.write_text("In the beginning God created the heaven and the earth.\n" * 20)
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "scone_jax.main", f"--config=tests/small_config.py:{tokenizer_path}",
         f"--workdir={workdir}", "--config.data.source=text",
         f"--config.data.train_files=a={text}{weights.format(path=text)}"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Fix:" in lines[0], result.stderr[-3000:]
    assert not workdir.exists() or not os.listdir(workdir)


def _resolved(train_files):
    return ml_collections.ConfigDict(config_lib.resolve_data({"train_files": train_files}))


def test_periods_are_dealt_in_different_orders_fixed_by_seed_and_period():
    """Each period deals its quotas in an order of its own (drawn from the seed and the period's number), so no
    component's rows fall at the same offsets every period; the same seed deals the same orders again. Caught:
    the order drawn from the seed alone (`default_rng([self.seed, 0x313C])`), every period dealt alike."""
    weights = [0.5, 0.3, 0.2]
    schedule = mixture.Schedule(weights, seed=5, period=64)
    orders = [schedule.rows(p * 64, 64)[0] for p in range(4)]
    assert len({o.tobytes() for o in orders}) == 4  # four periods, four different orders
    for order in orders:  # each still exactly its quotas
        np.testing.assert_array_equal(np.bincount(order, minlength=3), mixture.quotas(weights, 64))
    again = mixture.Schedule(weights, seed=5, period=64)
    np.testing.assert_array_equal(again.rows(0, 4 * 64)[0], np.concatenate(orders))
    other_seed = mixture.Schedule(weights, seed=6, period=64).rows(0, 64)[0]
    assert other_seed.tobytes() != orders[0].tobytes()


def _reference_rows(schedule, count):
    """Component and rank of rows 0..count-1 by walking them in order and counting (no closed form)."""
    owners, ranks, seen = [], [], {}
    for r in range(count):
        owner = int(schedule._period(r // schedule.period)[0][r % schedule.period])
        owners.append(owner)
        ranks.append(seen.get(owner, 0))
        seen[owner] = seen.get(owner, 0) + 1
    return np.array(owners), np.array(ranks)


def test_the_schedule_gives_each_row_its_component_and_rank_as_a_plain_count_does():
    """Windows that cross period boundaries (period 64 here). Bug it caught: ranks of a later period
    offset by the period's row count instead of that component's quota."""
    schedule = mixture.Schedule([0.5, 0.3, 0.2], seed=7, period=64)
    owners, ranks = _reference_rows(schedule, 64 * 5)
    for start, count in ((0, 64 * 5), (50, 30), (127, 2), (200, 100)):
        got_owner, got_rank = schedule.rows(start, count)
        np.testing.assert_array_equal(got_owner, owners[start:start + count])
        np.testing.assert_array_equal(got_rank, ranks[start:start + count])
    np.testing.assert_array_equal(np.bincount(owners[:64], minlength=3), mixture.quotas([0.5, 0.3, 0.2], 64))
    np.testing.assert_array_equal(mixture.quotas([0.5, 0.3, 0.2], 64), [32, 19, 13])  # largest remainder


@pytest.fixture
def two_corpora(tmp_path):
    """Component 'a': 48 documents of the one token 100 + k; component 'b': 30 of 300 + k."""
    sources.write_token_arrayrecord(str(tmp_path / "a.arrayrecord"), [[100 + k] * (1 + k % 5) for k in range(48)])
    sources.write_token_arrayrecord(str(tmp_path / "b.arrayrecord"), [[300 + k] * (1 + k % 3) for k in range(30)])
    return tmp_path


def _cfg(tmp_path, **overrides):
    """The data config of `--config.data.train_files='a=...@3;b=...@1'`, resolved (data.mixture) as a run's is."""
    cfg = dict(source="arrayrecord", train_files=f"a={tmp_path}/a.arrayrecord@3;b={tmp_path}/b.arrayrecord@1",
               eval_files="", text_field="text", document_unit="line", eval_fraction=0.02, tokenizer_path="",
               vocab_size=500, seq_len=16, global_batch_size=4, shuffle_seed=3, worker_count=0, prefetch_buffer=2,
               add_bos=True)
    cfg.update(overrides)
    return ml_collections.ConfigDict(config_lib.resolve_data(cfg))


def test_each_row_is_its_components_next_stretch_of_its_own_stream(two_corpora, tok):
    """Row r of component c is c's stream positions [k T, (k+1) T) for its rank k, however the rows
    of a batch interleave (the stream: c's documents alone, its own shuffle, its own epochs)."""
    cfg = _cfg(two_corpora)
    build = pipeline.batch_builder(cfg, tok)
    components = mixture.components(cfg)
    streams = []
    for i, c in enumerate(components):
        part = mixture.component_config(cfg, c)
        docs = documents.load(part, "train", tok, np.arange)
        streams.append((docs, packing.Stream(docs.lengths + 1, seed=(cfg.shuffle_seed, i))))
    schedule = mixture.Schedule([c.weight for c in components], cfg.shuffle_seed)
    seen = np.zeros(2, np.int64)
    for b in range(40):  # 160 rows: several epochs of both components
        batch = build(b)
        owner, rank = schedule.rows(b * 4, 4)
        np.testing.assert_array_equal(batch.row_source, owner)
        for row in range(4):
            docs, stream = streams[owner[row]]
            want = pipeline.window(docs, stream, int(rank[row]) * 16, 16, 1, 16, tok.bos_id, tok.eos_id, tok.pad_id)
            for key, array in want.arrays().items():
                np.testing.assert_array_equal(getattr(batch, key)[row], array[0], err_msg=f"batch {b} row {row} {key}")
            body = batch.inputs[row][(batch.inputs[row] != tok.bos_id)]
            lo = 100 if owner[row] == 0 else 300
            assert ((body >= lo) & (body < lo + 50)).all()  # only its own component's tokens
        seen += np.bincount(owner, minlength=2)
    assert seen.sum() == 160 and abs(seen[0] / 160 - 0.75) < 4 * np.sqrt(0.75 * 0.25 / 160)


@pytest.mark.slow
def test_mixture_batches_are_the_same_for_any_worker_count_and_after_resume(two_corpora, tok):
    want = pipeline.first_batches(pipeline.make_train_dataset(_cfg(two_corpora), tok), 8)
    for workers, start in ((1, 0), (2, 3)):
        got = pipeline.first_batches(pipeline.make_train_dataset(
            _cfg(two_corpora, worker_count=workers, prefetch_buffer=1), tok, start_batch=start), 8 - start)
        for expected, batch in zip(want[start:], got):
            assert expected.arrays().keys() == batch.arrays().keys()
            for key, array in expected.arrays().items():
                assert array.tobytes() == batch.arrays()[key].tobytes(), (workers, key)


def test_component_token_shares_follow_the_weights_over_many_batches():
    """Within a period every component gets exactly its quota of rows; over any long stretch its share
    of rows (all training rows are full, so of tokens) is its weight within sampling error."""
    weights = [0.6, 0.3, 0.1]
    schedule = mixture.Schedule(weights, seed=11)
    owner, _ = schedule.rows(0, mixture.PERIOD)
    np.testing.assert_array_equal(np.bincount(owner, minlength=3), mixture.quotas(weights, mixture.PERIOD))
    owner, _ = schedule.rows(1234, 2000)  # a stretch across a period boundary
    shares = np.bincount(owner, minlength=3) / 2000
    assert np.all(np.abs(shares - weights) < 4 * np.sqrt(np.array(weights) * (1 - np.array(weights)) / 2000))


def test_extraction_counts_each_component_by_its_weight(two_corpora, tok, tmp_path, monkeypatch):
    """F-gram extraction reads weight x scone.extract_max_tokens tokens of each component."""
    from scone_jax.training import assets

    counted = []
    real = assets.tokenize.model_documents

    def spy(source, tokenizer, *, max_tokens=0, **kwargs):
        docs = list(real(source, tokenizer, max_tokens=max_tokens, **kwargs))
        counted.append((len(source), sum(len(d) for d in docs)))
        return iter(docs)

    monkeypatch.setattr(assets.tokenize, "model_documents", spy)
    scone = ml_collections.ConfigDict(dict(vocab_path="", max_len=3, num_fgrams=20, min_count=1,
                                           extract_max_tokens=100))
    vocab = assets.ensure_vocab(scone, _cfg(two_corpora), tok, str(tmp_path / "run"))
    assert counted == [(48, 75), (30, 25)]  # documents in each component, tokens counted from it
    assert vocab.tokens_counted == 100


@pytest.mark.slow
def test_training_on_a_mixture_records_each_components_tokens(two_corpora, tokenizer_path, tmp_path):
    from scone_jax.training import train
    from tests.common import record_list

    config = small_config()
    config.data.update(dict(source="arrayrecord", tokenizer_path=tokenizer_path, seq_len=16,
                            train_files=f"a={two_corpora}/a.arrayrecord@3;b={two_corpora}/b.arrayrecord@1"))
    config.model.max_seq_len = 16
    config.train.update(dict(num_steps=4, log_every=2, eval_every=0))
    train.run(config, str(tmp_path / "run"))
    steps = record_list(str(tmp_path / "run"))
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    schedule = mixture.Schedule([0.75, 0.25], config.data.shuffle_seed)
    for r in steps:  # every row is full: 16 tokens per row, rows dealt by the schedule
        owner, _ = schedule.rows((r["step"] - 1) * 16, 16)
        assert (r["mix/tokens_a"], r["mix/tokens_b"]) == (16.0 * (owner == 0).sum(), 16.0 * (owner == 1).sum())
    logged = record_list(str(tmp_path / "run"), "train")
    assert logged[-1]["mix/tokens_a"] + logged[-1]["mix/tokens_b"] == 2 * 16 * 16  # the window's two steps


def test_a_config_file_mixture_gives_the_shorthands_rows_in_its_written_order(two_corpora, tok):
    """data.mixture set as a config file does (a dict, its names out of alphabetical order) is resolved to what
    the shorthand gives, and both build the same batches, byte for byte; the component dealt first is the one of
    order 0 ('zeta': b's tokens, weight 3), not the first by name. Caught: mixture.components ordering the
    components by name (`sorted(group.items())`: 'alpha' dealt first, with weight 1/4)."""
    short = _cfg(two_corpora, train_files=f"zeta={two_corpora}/b.arrayrecord@3;alpha={two_corpora}/a.arrayrecord@1")
    config = small_config()
    config.data.update(dict(source="arrayrecord", seq_len=16, global_batch_size=4, shuffle_seed=3))
    config.data.mixture = {"alpha": {"files": f"{two_corpora}/a.arrayrecord", "weight": 1, "order": 1},
                           "zeta": {"files": f"{two_corpora}/b.arrayrecord", "weight": 3.0, "order": 0}}
    config_lib.validate(config)
    assert config.data.mixture.to_dict() == short.mixture.to_dict() and config.data.train_files == ""
    assert [c.name for c in mixture.components(config.data)] == ["zeta", "alpha"]
    by_group, by_shorthand = pipeline.batch_builder(config.data, tok), pipeline.batch_builder(short, tok)
    owners = []
    for b in range(12):
        got, want = by_group(b), by_shorthand(b)
        for key, array in want.arrays().items():
            assert array.tobytes() == getattr(got, key).tobytes(), (b, key)
        zeta_rows = got.inputs[got.row_source == 0]
        assert ((zeta_rows == tok.bos_id) | ((zeta_rows >= 300) & (zeta_rows < 350))).all()  # b's tokens
        owners.append(got.row_source)
    np.testing.assert_array_equal(np.concatenate(owners), mixture.Schedule([0.75, 0.25], 3).rows(0, 48)[0])


@pytest.mark.parametrize("group,message", [
    ({"web": {"files": "/a", "weight": 1.0, "order": 0}, "books": {"files": "/b", "weight": 1.0, "order": 0}},
     "the components' orders are [0, 0], not 0, 1, ... once each"),
    ({"web": {"files": "/a", "weight": -2.0, "order": 0}}, "component 'web' has files '/a' and weight -2.0"),
    ({"web": {"files": "", "weight": 1.0, "order": 0}}, "component 'web' has files '' and weight 1.0"),
    ({"web": {"files": "/a", "weight": 1.0}}, "component 'web' is"),
    ({"web": {"files": "/a", "weight": 1.0, "order": 0}, "books": {"files": "/b", "weight": 1e-4, "order": 1}},
     "data.mixture: component 'books' has 0.0001 of the total weight, below 1/4096"),
])
def test_a_bad_config_file_mixture_is_refused_naming_the_component(group, message):
    """The group's own checks, in the words of data.mixture. Caught: the orders left unchecked (two components
    of order 0 resolved, and dealt in whichever order the ConfigDict's sorted names gave)."""
    config = small_config()
    config.data.mixture = group
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        config_lib.validate(config)
    assert "Fix:" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("entry", [
    {2: {"files": "/d/a.txt", "weight": 1.0, "order": 0}},  # a number for a name: re's TypeError, a traceback
    {"web": {"files": "/d/a.txt", "weight": 0.0, "order": 0}},  # never dealt a row
])
def test_a_config_file_component_without_a_name_or_a_share_is_refused_in_one_line(entry):
    """data.mixture set in a config file: a component named by a number, or of weight 0, is one line naming it.
    Caught: the isinstance(name, str) check removed or joined by `and` (a TypeError traceback); the weight test
    loosened to >= 0 (a ZeroDivisionError further on)."""
    config = small_config()
    with config.unlocked():
        config.data.mixture = entry
    [(name, fields)] = entry.items()
    with pytest.raises(ValueError) as refused:
        config_lib.validate(config)
    assert str(refused.value) == (
        f"data.mixture: component {name!r} has files '/d/a.txt' and weight {fields['weight']!r}. Fix: a name (a "
        "string) of letters, digits, _ . -, comma-separated globs, and a positive weight (weights are relative: "
        "they need not sum to 1).")
