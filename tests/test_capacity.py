"""scone.fgram_capacity checked from the run's data before its first step (training/capacity.py, issue 62): the rows
a sample of the batches needs, against a plain count written from docs/method.md; a capacity a later batch
overflows stops the run at start in one line naming the value to set; a rerun with that value, and a resume that
changes only the capacity, are accepted."""
import os

import numpy as np
import pytest

from scone_jax import config as config_lib, sharding
from scone_jax.data import pipeline
from scone_jax.training import capacity, run as run_lib, train
from tests import serving_run
from tests.common import record_list
from tests.method_reference import longest_matches


def reference_rows(batch, vocab, groups: int) -> list[int]:
    """Rows each group of `batch` needs, from the method alone: the longest f-gram ending at each position within
    its document (§2), the distinct ones of each group (§5), less those that are a prefix of another distinct one
    of the group (the f-gram model is causal over a left-aligned f-gram: a prefix's output is its extension's
    hidden state there, fgram/dedup.py)."""
    fgrams = {tuple(int(t) for t in row[:n]) for row, n in zip(vocab.tokens, vocab.lengths)}
    rows, _ = batch.inputs.shape
    per_group = rows // groups
    needs = []
    for g in range(groups):
        found = set()
        for r in range(g * per_group, (g + 1) * per_group):
            tokens, segments = batch.inputs[r], batch.segment_ids[r]
            for s in np.unique(segments[segments > 0]):
                piece = tokens[segments == s]
                found |= {m for m in longest_matches(piece, fgrams, vocab.max_len) if m is not None}
        needs.append(sum(1 for f in found if not any(len(o) > len(f) and o[:len(f)] == f for o in found)))
    return needs


@pytest.fixture(scope="module")
def parts(tokenizer_path, tmp_path_factory):
    """(config, its batcher, batch number -> batch before the batcher) of a 12-step SCONE run."""
    config = serving_run.scone_config(tokenizer_path)
    config.train.num_steps = 12
    run = run_lib.build(config, str(tmp_path_factory.mktemp("parts")), sharding.make_mesh(config.mesh),
                        start=run_lib.FRESH)
    build = pipeline.batch_builder(config.data, run.tokenizer)
    return config, run.batcher, build, run.vocab


def test_needed_rows_equal_a_count_written_from_the_method(parts):
    """Caught: counting every distinct f-gram of a group (prefixes of others too: more rows than the batcher
    writes), and counting over the whole batch instead of per data shard."""
    config, batcher, build, vocab = parts
    assert batcher.num_groups > 1  # the small config's 8 data shards
    for b in (0, 5, 11):
        want = max(reference_rows(build(b), vocab, batcher.num_groups))
        assert capacity.needed(batcher, build, [b]) == (want, b)


def test_the_sample_spans_the_run_from_its_first_to_its_last_batch():
    """Caught (mutate_diff): `last <= first` taken for an empty range (a resume one step before the end checked
    nothing)."""
    assert capacity.sample_batches(0, 11) == list(range(12))
    spread = capacity.sample_batches(100, 10_099, sample=5)
    assert spread[0] == 100 and spread[-1] == 10_099 and len(spread) == 5
    assert capacity.sample_batches(5, 4) == [] and capacity.sample_batches(7, 7) == [7]  # a run's last step alone
    assert capacity.suggested(1041) == 1408 and capacity.suggested(100, micro_batches=2) == 256


@pytest.mark.slow  # runs whole jobs
def test_a_capacity_a_later_batch_overflows_stops_the_run_before_its_first_step(parts, tmp_path):
    """The capacity the first batch needs, which a later batch overflows: refused at start in one line naming
    the batch and the value to set, nothing trained or saved; the rerun with that value trains; a resume that
    raises only the capacity is accepted. Caught: the check over the first batch alone (the run started and
    stopped at the overflowing batch, its checkpoint saved); the capacity kept a STATE key (the resume refused)."""
    config, batcher, build, _ = parts
    first = capacity.needed(batcher, build, [0])[0]
    worst, where = capacity.needed(batcher, build, list(range(12)))
    assert worst > first and where > 0  # the case: the first batch fits, a later one does not
    workdir = str(tmp_path / "run")
    too_small = config.copy_and_resolve_references()
    too_small.scone.fgram_capacity = first * batcher.micro_batches
    with pytest.raises(ValueError) as refused:
        train.run(too_small, workdir)
    message = str(refused.value)
    assert "\n" not in message
    fix = capacity.suggested(worst)
    assert (f"batch {where} (one of 12 checked" in message and f"needs {worst} f-gram rows" in message
            and f"--config.scone.fgram_capacity={fix}" in message and "micro-batch" not in message), message
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    assert not os.listdir(os.path.join(workdir, "checkpoints"))

    fixed = config.copy_and_resolve_references()
    fixed.scone.fgram_capacity = fix
    fixed.train.num_steps, fixed.train.max_steps_per_run = 12, 2
    train.run(fixed, workdir)
    assert [r["step"] for r in record_list(workdir)] == [1, 2]
    raised = fixed.copy_and_resolve_references()
    raised.scone.fgram_capacity = fix + 128
    assert "scone.fgram_capacity" not in config_lib.RESUME_KEYS
    train.run(raised, workdir)
    assert [r["step"] for r in record_list(workdir)] == [1, 2, 3, 4]
