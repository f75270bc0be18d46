"""Tests for the grain pipelines: packing invariants, process slices, exact resume, and evaluation."""
import collections
import threading

import grain
import ml_collections
import numpy as np
import pytest

from scone_jax.data import corpus, pipeline, sources, tokenizer

KEYS = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
        "loss_mask": np.float32}


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "kjv500.model"
    return tokenizer.train_tokenizer(corpus.kjv_documents("train", 0.02)[:300], str(path), vocab_size=500)


def _data_cfg(**overrides):
    cfg = dict(source="kjv", train_files="", eval_files="", text_field="text", document_unit="line",
               eval_fraction=0.02, tokenizer_path="", vocab_size=500, seq_len=32, global_batch_size=4,
               shuffle_seed=3, worker_count=0, prefetch_buffer=2)
    cfg.update(overrides)
    return ml_collections.ConfigDict(cfg)


def _take(ds, n, state=None):
    it = iter(ds)
    if state is not None:
        it.set_state(state)
    try:
        batches = [next(it) for _ in range(n)]
        return batches, it.get_state()
    finally:
        it.close()


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
        for inputs, positions in zip(batch["inputs"].reshape(-1), batch["positions"].reshape(-1)):
            if positions == 1:
                ids.append(int(inputs))
    return ids


def _check_packing_invariants(batch, tok):
    seg, pos, mask = batch["segment_ids"], batch["positions"], batch["loss_mask"]
    np.testing.assert_array_equal(mask, (seg > 0).astype(np.float32))
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    np.testing.assert_array_equal(batch["targets"][:, :-1][same], batch["inputs"][:, 1:][same])
    np.testing.assert_array_equal(pos[:, 1:][same], pos[:, :-1][same] + 1)
    np.testing.assert_array_equal(pos[:, 1:][~same & (seg[:, 1:] > 0)], 0)
    assert (batch["inputs"][seg == 0] == tok.pad_id).all()


def test_train_batches_shapes_dtypes_and_packing(tok):
    batches, _ = _take(pipeline.make_train_dataset(_data_cfg(), tok), 4)
    for batch in batches:
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: ((4, 32), d) for k, d in KEYS.items()}
        _check_packing_invariants(batch, tok)
    assert all(b["loss_mask"].all() for b in batches)  # an endless stream has no padding


def test_rows_unpack_to_the_shuffled_tokenized_documents(tok, tmp_path):
    docs = sorted(corpus.kjv_documents("eval", 0.02), key=len)[:12]  # short ones: several fit in a row
    (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n")
    cfg = _data_cfg(source="text", train_files=str(tmp_path / "docs.txt"), seq_len=256, global_batch_size=6)
    batches, _ = _take(pipeline.make_train_dataset(cfg, tok, process_index=1, process_count=2), 2)
    order = grain.MapDataset.range(len(docs)).shuffle(seed=cfg.shuffle_seed)[1::2].repeat(4)  # 6 per epoch
    expected = [docs[i] for i in order]
    # Rows are filled back to back: inputs = [bos] + ids and targets = ids + [eos] of each document in turn.
    for key, stream in [
        ("inputs", np.concatenate([np.append(tok.bos_id, tok.encode(d)) for d in expected])),
        ("targets", np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in expected])),
    ]:
        rows = np.concatenate([b[key] for b in batches]).reshape(-1)  # 6 rows of 256
        np.testing.assert_array_equal(rows, stream[: rows.size])
    complete = []  # documents whose whole piece lies in one row: [bos] + ids as inputs, eos as last target
    for batch in batches:
        for inputs, targets, seg, pos in zip(batch["inputs"], batch["targets"], batch["segment_ids"],
                                             batch["positions"]):
            for s in np.unique(seg[seg > 0]):
                piece = seg == s
                assert pos[piece][0] == 0  # also for the continued piece at the start of a row
                if inputs[piece][0] == tok.bos_id and targets[piece][-1] == tok.eos_id:
                    complete.append(tok.decode(inputs[piece][1:]))
    assert len(complete) >= 12
    remaining = iter(expected)
    assert all(doc in remaining for doc in complete)  # in the shuffled order


def test_process_slices_are_disjoint_and_cover_each_epoch(tok, single_token_docs):
    epochs = collections.defaultdict(list)  # epoch -> document ids read by all processes
    for p in range(4):
        ds = pipeline.make_train_dataset(single_token_docs, tok, process_index=p, process_count=4)
        batches, _ = _take(ds, 6)  # 12 documents x 2 tokens = 3 rows of 8 per epoch; local batch 1
        assert batches[0]["inputs"].shape == (1, 8)
        ids = _doc_ids(batches)
        assert len(ids) == 24
        epochs[0] += ids[:12]
        epochs[1] += ids[12:]
    for ids in epochs.values():
        assert sorted(ids) == list(range(100, 148))
    assert epochs[0] != epochs[1]  # a new order every epoch


def test_resume_is_exact_and_batch_transform_applies(tok):
    def add_doubled(batch):
        return {**batch, "doubled": batch["inputs"] * 2}

    ds = pipeline.make_train_dataset(_data_cfg(), tok, batch_transform=add_doubled)
    first, state = _take(ds, 5)
    more, _ = _take(ds, 10)
    resumed, _ = _take(ds, 5, state=state)
    for expected, got in zip(more[5:], resumed):
        assert expected.keys() == got.keys()
        for k in expected:
            assert expected[k].tobytes() == got[k].tobytes()
    np.testing.assert_array_equal(first[0]["doubled"], first[0]["inputs"] * 2)


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
            assert {k: (v.shape, v.dtype) for k, v in b.items()} == {k: ((1, 6), d) for k, d in KEYS.items()}
        if p > 0:  # 6 tokens fill one row; the second batch is padding only
            assert batches[1]["segment_ids"].sum() == 0 and batches[1]["loss_mask"].sum() == 0
        seen += _doc_ids(batches)
        tokens += int(sum(b["loss_mask"].sum() for b in batches))
        totals.add(ev.num_tokens)
    assert sorted(seen) == list(range(200, 210))
    assert totals == {tokens} == {20}


def test_eval_on_kjv_pads_the_last_batch_and_counts_tokens(tok):
    cfg = _data_cfg(seq_len=64, global_batch_size=8)
    ev = pipeline.make_eval_batches(cfg, tok)
    batches = list(ev)
    expected_tokens = sum(len(tok.encode(d)) + 1 for d in corpus.kjv_documents("eval", 0.02))
    assert ev.num_tokens == ev.local_num_tokens == expected_tokens
    assert sum(b["loss_mask"].sum() for b in batches) == expected_tokens
    assert len(batches) == ev.num_batches == -(-expected_tokens // (64 * 8))
    last = batches[-1]
    assert last["segment_ids"][-1].sum() == 0 and last["loss_mask"][-1].sum() == 0
    for b in batches:
        _check_packing_invariants(b, tok)
    again = list(ev)
    assert all(a["inputs"].tobytes() == b["inputs"].tobytes() for a, b in zip(batches, again))


def test_more_processes_than_held_out_documents_still_agree_on_batch_count(tok, single_token_docs):
    single_token_docs.global_batch_size = 12
    runs = [list(pipeline.make_eval_batches(single_token_docs, tok, process_index=p, process_count=12))
            for p in (0, 11)]  # process 11 has no documents
    assert [len(r) for r in runs] == [1, 1]
    assert runs[0][0]["loss_mask"].sum() == 2 and runs[1][0]["loss_mask"].sum() == 0


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
        _take(pipeline.make_train_dataset(cfg, tok), 1)


def test_resume_is_exact_with_worker_processes(tok):
    ds = pipeline.make_train_dataset(_data_cfg(worker_count=2, prefetch_buffer=1), tok)
    it = iter(ds)
    try:
        [next(it) for _ in range(3)]
        state = it.get_state()
        more = [next(it) for _ in range(3)]
    finally:
        it.close()
    resumed, _ = _take(ds, 3, state=state)  # a fresh iterator, as after a restart
    for expected, got in zip(more, resumed):
        for k in expected:
            assert expected[k].tobytes() == got[k].tobytes()
