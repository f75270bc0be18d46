"""Tests for the input pipelines: packing invariants end to end, process shares, resume by batch
number, worker processes, evaluation."""
import collections
import threading

import ml_collections
import numpy as np
import pytest

from scone_jax.batch import BASE_DTYPES as KEYS, Batch
from scone_jax.data import corpus, documents, pipeline, sources


def _data_cfg(**overrides):
    cfg = dict(source="kjv", train_files="", eval_files="", text_field="text", document_unit="line",
               eval_fraction=0.02, tokenizer_path="", vocab_size=500, seq_len=32, global_batch_size=4,
               shuffle_seed=3, worker_count=0, prefetch_buffer=2, add_bos=True)
    cfg.update(overrides)
    return ml_collections.ConfigDict(cfg)


@pytest.fixture
def single_token_docs(tmp_path):
    """48 training and 10 held-out documents, document k = the single token id 100 + k."""
    sources.write_token_arrayrecord(str(tmp_path / "train.arrayrecord"), [[100 + k] for k in range(48)])
    sources.write_token_arrayrecord(str(tmp_path / "eval.arrayrecord"), [[200 + k] for k in range(10)])
    return _data_cfg(source="arrayrecord", train_files=str(tmp_path / "train.arrayrecord"),
                     eval_files=str(tmp_path / "eval.arrayrecord"), seq_len=8)


def _doc_ids(batches):
    """The document token of each (bos, token) segment, in order."""
    ids = []
    for batch in batches:
        for inputs, positions in zip(batch.inputs.reshape(-1), batch.positions.reshape(-1)):
            if positions == 1:
                ids.append(int(inputs))
    return ids


def _check_packing_invariants(batch, tok):
    seg, pos, mask = batch.segment_ids, batch.positions, batch.loss_mask
    np.testing.assert_array_equal(mask, (seg > 0).astype(np.float32))
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    np.testing.assert_array_equal(batch.targets[:, :-1][same], batch.inputs[:, 1:][same])
    np.testing.assert_array_equal(pos[:, 1:][same], pos[:, :-1][same] + 1)
    np.testing.assert_array_equal(pos[:, 1:][~same & (seg[:, 1:] > 0)], 0)
    assert (batch.inputs[seg == 0] == tok.pad_id).all()


def test_train_batches_shapes_dtypes_and_packing(tok):
    batches = pipeline.first_batches(pipeline.make_train_dataset(_data_cfg(), tok), 4)
    for batch in batches:
        assert {k: (v.shape, v.dtype) for k, v in batch.arrays().items()} == {k: ((4, 32), d) for k, d in KEYS.items()}
        _check_packing_invariants(batch, tok)
    assert all(b.loss_mask.all() for b in batches)  # an endless stream has no padding


@pytest.mark.parametrize("add_bos", [True, False])
def test_rows_unpack_to_the_shuffled_tokenized_documents(tok, tmp_path, add_bos):
    """The pipeline end to end on a text file: process 1 of 2 reads its share of the documents
    (documents.process_share), in epoch order permutation((shuffle_seed, epoch)), as
    [bos] + ids / ids + [eos] back to back; with data.add_bos=False as ids / ids[1:] + [eos]. Caught: the
    training stream still counting len + 1 positions per document without bos (pipeline.batch_builder)."""
    docs = sorted(corpus.kjv_documents("eval", 0.02), key=len)[:12]  # short ones: several fit in a row
    (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n")
    cfg = _data_cfg(source="text", train_files=str(tmp_path / "docs.txt"), seq_len=256, global_batch_size=6,
                    add_bos=add_bos)
    batches = pipeline.first_batches(pipeline.make_train_dataset(cfg, tok, process_index=1, process_count=2), 2)
    mine = documents.process_share(len(docs), cfg.shuffle_seed, 1, 2)  # 6 documents
    order = np.concatenate([mine[np.random.default_rng([cfg.shuffle_seed, e]).permutation(6)] for e in range(4)])
    expected = [tok.encode(docs[i]) for i in order]
    bos = [tok.bos_id] if add_bos else []
    for key, stream in [
        ("inputs", np.concatenate([np.concatenate([bos, d]) for d in expected])),
        ("targets", np.concatenate([np.append(d if add_bos else d[1:], tok.eos_id) for d in expected])),
    ]:
        rows = np.concatenate([getattr(b, key) for b in batches]).reshape(-1)  # 6 rows of 256
        np.testing.assert_array_equal(rows, stream[: rows.size])
    for batch in batches:
        _check_packing_invariants(batch, tok)


def test_process_slices_are_disjoint_and_cover_each_epoch(tok, single_token_docs):
    epochs = collections.defaultdict(list)  # epoch -> document ids read by all processes
    for p in range(4):
        ds = pipeline.make_train_dataset(single_token_docs, tok, process_index=p, process_count=4)
        batches = pipeline.first_batches(ds, 6)  # 12 documents x 2 tokens = 3 rows of 8 per epoch; local batch 1
        assert batches[0].inputs.shape == (1, 8)
        ids = _doc_ids(batches)
        assert len(ids) == 24
        epochs[0] += ids[:12]
        epochs[1] += ids[12:]
    for ids in epochs.values():
        assert sorted(ids) == list(range(100, 148))
    assert epochs[0] != epochs[1]  # a new order every epoch


def test_starting_at_a_batch_number_resumes_exactly_and_the_transform_applies(tok):
    """Batch b is a function of b alone: a dataset started at batch 5 continues an uninterrupted
    one exactly (what resume relies on), and batch_transform runs on every batch."""
    def add_doubled(batch):  # any field the transform adds, e.g. the matcher's ids
        return batch.replace(fgram_ids=batch.inputs * 2)

    straight = pipeline.first_batches(pipeline.make_train_dataset(_data_cfg(), tok, batch_transform=add_doubled), 10)
    resumed = pipeline.first_batches(pipeline.make_train_dataset(_data_cfg(), tok, batch_transform=add_doubled, start_batch=5), 5)
    for expected, got in zip(straight[5:], resumed):
        assert expected.arrays().keys() == got.arrays().keys()
        for k, array in expected.arrays().items():
            assert array.tobytes() == got.arrays()[k].tobytes()
    np.testing.assert_array_equal(straight[0].fgram_ids, straight[0].inputs * 2)
    assert len({b.inputs.tobytes() for b in straight}) == 10


def test_batches_are_prepared_ahead_on_a_background_thread(tok):
    """worker_count=0 prefetches on a thread (grain's ThreadPrefetchIterDataset): while the consumer
    holds batch 0 and asks for nothing, batch 1's batch_transform runs, on another thread.
    Catches: the prefetch stage dropped (batches made on demand in the consumer's thread; tried: the
    second transform call never came). An event with a timeout, not a sleep: a correct pipeline
    sets it in milliseconds, only a broken one waits the timeout out."""
    calls, second = [], threading.Event()

    def record(batch):
        calls.append(threading.get_ident())
        if len(calls) == 2:
            second.set()
        return batch

    it = iter(pipeline.make_train_dataset(_data_cfg(prefetch_buffer=2), tok, batch_transform=record))
    try:
        next(it)
        assert second.wait(timeout=20), "batch 1 was not prepared while batch 0 was held"
        assert threading.get_ident() not in calls
    finally:
        it.close()


def test_eval_covers_every_held_out_document_once(tok, single_token_docs):
    cfg = single_token_docs
    cfg.seq_len, cfg.global_batch_size = 6, 3  # 10 documents of 2 tokens over 3 processes: 4, 3, 3
    seen, totals, tokens = [], set(), 0
    for p in range(3):
        ev = pipeline.make_eval_batches(cfg, tok, process_index=p, process_count=3)
        batches = list(ev)
        assert len(batches) == ev.num_batches == 2  # process 0 needs 2 rows of 6 tokens
        for b in batches:
            assert {k: (v.shape, v.dtype) for k, v in b.arrays().items()} == {k: ((1, 6), d) for k, d in KEYS.items()}
        if p > 0:  # 6 tokens fill one row; the second batch is padding only
            assert batches[1].segment_ids.sum() == 0 and batches[1].loss_mask.sum() == 0
        seen += _doc_ids(batches)
        tokens += int(sum(b.loss_mask.sum() for b in batches))
        totals.add(ev.num_tokens)
    assert sorted(seen) == list(range(200, 210))
    assert totals == {tokens} == {20}


@pytest.mark.parametrize("add_bos", [True, False])
def test_eval_on_kjv_pads_the_last_batch_and_counts_tokens(tok, add_bos):
    """Held-out documents count len + 1 positions each, len without bos (data.add_bos=False), and then no
    input is a bos. Caught: EvalBatches counting len + 1 whatever add_bos says."""
    cfg = _data_cfg(seq_len=64, global_batch_size=8, add_bos=add_bos)
    ev = pipeline.make_eval_batches(cfg, tok)
    batches = list(ev)
    expected_tokens = sum(len(tok.encode(d)) + add_bos for d in corpus.kjv_documents("eval", 0.02))
    assert add_bos or not any((b.inputs == tok.bos_id).any() for b in batches)
    assert ev.num_tokens == ev.local_num_tokens == expected_tokens
    assert sum(b.loss_mask.sum() for b in batches) == expected_tokens
    assert len(batches) == ev.num_batches == -(-expected_tokens // (64 * 8))
    last = batches[-1]
    assert last.segment_ids[-1].sum() == 0 and last.loss_mask[-1].sum() == 0
    for b in batches:
        _check_packing_invariants(b, tok)
    again = list(ev)
    assert all(a.inputs.tobytes() == b.inputs.tobytes() for a, b in zip(batches, again))


def test_more_processes_than_held_out_documents_still_agree_on_batch_count(tok, single_token_docs):
    single_token_docs.global_batch_size = 12
    runs = [list(pipeline.make_eval_batches(single_token_docs, tok, process_index=p, process_count=12))
            for p in (0, 11)]  # process 11 has no documents
    assert [len(r) for r in runs] == [1, 1]
    assert runs[0][0].loss_mask.sum() == 2 and runs[1][0].loss_mask.sum() == 0


def test_batch_must_divide_across_processes(tok):
    with pytest.raises(ValueError, match="global_batch_size=4 is not divisible by the 3 JAX processes"):
        pipeline.make_train_dataset(_data_cfg(), tok, process_count=3)
    with pytest.raises(ValueError, match="global_batch_size=4 is not divisible"):
        pipeline.make_eval_batches(_data_cfg(), tok, process_count=3)


def test_too_few_documents_for_the_processes(tok, tmp_path):
    sources.write_token_arrayrecord(str(tmp_path / "t.arrayrecord"), [[7], [8]])
    cfg = _data_cfg(source="arrayrecord", train_files=str(tmp_path / "t.arrayrecord"))
    with pytest.raises(ValueError, match="2 documents, fewer than the 4 processes"):
        pipeline.make_train_dataset(cfg, tok, process_index=3, process_count=4)


def test_pre_tokenized_ids_outside_the_vocabulary_are_rejected(tok, tmp_path):
    sources.write_token_arrayrecord(str(tmp_path / "t.arrayrecord"), [[7, 9999]])
    cfg = _data_cfg(source="arrayrecord", train_files=str(tmp_path / "t.arrayrecord"))
    with pytest.raises(ValueError, match=r"token id 9999.*\[0, 500\)"):
        pipeline.first_batches(pipeline.make_train_dataset(cfg, tok), 1)


def _add_row_sums(batch):
    """A batch transform that runs in the workers (module level: workers unpickle it by name)."""
    return batch.replace(fgram_unique=batch.inputs.sum(axis=1))


@pytest.mark.slow  # starts 1 and 2 grain worker processes
def test_batches_do_not_depend_on_the_number_of_worker_processes(tok):
    """0 (a thread), 1 and 2 worker processes give the same batches, transform included, also
    when started mid-stream. Catches a pipeline that packs per worker (grain's mp_prefetch
    slices its input: each worker would pack every other document)."""
    want = pipeline.first_batches(pipeline.make_train_dataset(_data_cfg(worker_count=0), tok, batch_transform=_add_row_sums), 6)
    for workers, start in ((1, 0), (2, 2)):
        got = pipeline.first_batches(pipeline.make_train_dataset(_data_cfg(worker_count=workers, prefetch_buffer=1), tok,
                                                batch_transform=_add_row_sums, start_batch=start), 6 - start)
        for expected, batch in zip(want[start:], got):
            assert expected.arrays().keys() == batch.arrays().keys()
            for k, array in expected.arrays().items():
                assert (array.dtype, array.shape) == (batch.arrays()[k].dtype, batch.arrays()[k].shape), (workers, k)
                assert array.tobytes() == batch.arrays()[k].tobytes(), (workers, k)



def test_batches_travel_joined_in_one_array_and_split_back_unchanged():
    """Workers hand batches over joined (one shared-memory segment per element). Every dtype and
    shape (scalar, empty, non-contiguous input) comes back bit-identical, as views into the one
    array at aligned offsets. Seen to catch: the layout's dtype dropped (int32 bits read back as
    float32), offsets advanced by element count instead of bytes (arrays overlapping)."""
    rng = np.random.default_rng(0)
    batches = [Batch(inputs=rng.integers(0, 500, (4, 8), dtype=np.int32),
                     loss_mask=rng.random((4, 8)).astype(np.float32),
                     fgram_rows=np.arange(30, dtype=np.float64).reshape(5, 6)[:, ::2],
                     fgram_matched=rng.random(7) > 0.5, fgram_tokens=np.zeros((0, 3), np.int32),
                     fgram_unique=np.array(k, np.int32)) for k in range(3)]
    element = pipeline.join_batches(batches)
    assert set(element) == {"bytes", "layout"} and element["bytes"].dtype == np.uint8
    got = pipeline.split_element(element)
    assert len(got) == 3
    for want, batch in zip(batches, got):
        assert list(batch.arrays()) == list(want.arrays())
        for k, expected in want.arrays().items():
            array = batch.arrays()[k]
            assert (array.dtype, array.shape) == (expected.dtype, expected.shape), k
            np.testing.assert_array_equal(array, expected)
            assert array.size == 0 or np.shares_memory(array, element["bytes"])
            assert (array.__array_interface__["data"][0] - element["bytes"].ctypes.data) % 64 == 0


def test_worker_count_minus_one_is_half_the_cores(monkeypatch):
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    assert pipeline.worker_count(_data_cfg(worker_count=-1)) == 4
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda _: {0}, raising=False)
    assert pipeline.worker_count(_data_cfg(worker_count=-1)) == 1
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda _: set(range(224)), raising=False)
    assert pipeline.worker_count(_data_cfg(worker_count=-1)) == pipeline.MAX_AUTO_WORKERS
    assert pipeline.worker_count(_data_cfg(worker_count=3)) == 3
    with pytest.raises(ValueError, match=r"data.worker_count=-2 is not valid: use -1"):
        pipeline.worker_count(_data_cfg(worker_count=-2))
