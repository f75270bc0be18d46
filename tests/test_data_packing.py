"""Packing (data/packing.py + pipeline.window) against a plain reference that walks the stream
position by position; the batch layout's properties on hand-checked values."""
import numpy as np
import pytest

from scone_jax.batch import BASE_DTYPES
from scone_jax.data import packing, pipeline
from scone_jax.data.documents import InMemoryDocuments

BOS, EOS, PAD = 2, 3, 0


def corpus(lengths, seed=0):
    """Documents of the given lengths with distinct-ish token ids (10..), as InMemoryDocuments."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(10, 500, n).astype(np.int32) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return docs, InMemoryDocuments(np.concatenate(docs + [np.zeros(0, np.int32)]), offsets)


def reference_batch(docs, seed, batch_index, rows, seq_len, finite=False, bos=BOS):
    """The spec, one position at a time: epochs of documents in the order permutation((seed, e))
    (given order if seed is None), each document as [bos]+ids / ids+[eos] (bos None, data.add_bos=False:
    t_1..t_n / t_2..t_n, eos; an empty document adds nothing), rows cut back to back, segment ids counted
    per row, positions restarting at every piece."""
    stream = []  # (input, target, starts_a_document)
    epoch = 0
    need = (batch_index + 1) * rows * seq_len
    while len(stream) < need:
        order = range(len(docs)) if seed is None else np.random.default_rng([seed, epoch]).permutation(len(docs))
        for d in order:
            ids = list(docs[d])
            pairs = zip([bos] + ids, ids + [EOS]) if bos is not None else zip(ids, ids[1:] + [EOS])
            for i, (x, y) in enumerate(pairs):
                stream.append((x, y, i == 0))
        epoch += 1
        if finite:
            break
    window = stream[batch_index * rows * seq_len: need]
    out = {k: np.zeros((rows, seq_len), dtype) for k, dtype in BASE_DTYPES.items()}
    for r in range(rows):
        segment = position = 0
        for c in range(seq_len):
            k = r * seq_len + c
            if k >= len(window):
                out["inputs"][r, c] = out["targets"][r, c] = PAD
                continue
            x, y, starts = window[k]
            if starts or c == 0:
                segment, position = segment + 1, 0
            out["inputs"][r, c], out["targets"][r, c] = x, y
            out["segment_ids"][r, c], out["positions"][r, c] = segment, position
            out["loss_mask"][r, c] = 1.0
            position += 1
    return out


def built(docs_store, lengths, seed, batch_index, rows, seq_len, finite=False, bos=BOS):
    stream = packing.Stream(packing.example_lengths(lengths, bos), seed=seed)
    size = rows * seq_len
    return pipeline.window(docs_store, stream, batch_index * size, size, rows, seq_len, bos, EOS, PAD,
                           stream_end=stream.epoch_positions if finite else None)


@pytest.mark.parametrize("bos", [BOS, None], ids=["bos", "no_bos"])
@pytest.mark.parametrize("lengths,rows,seq_len", [
    ([3, 0, 7, 1, 12, 5, 2], 2, 8),     # an empty document, pieces across rows
    ([40, 3, 25], 2, 16),               # documents longer than a row and than a batch
    (list(range(1, 30)), 4, 32),        # many short documents per row
])
def test_batches_equal_the_position_by_position_reference(lengths, rows, seq_len, bos):
    """Batches 0..11 (several epochs, windows starting inside documents) equal the reference, with a bos
    and without (data.add_bos=False). Catches positions that continue across a row break instead of
    restarting, a new epoch in the previous epoch's order, and a window offset by the first piece's start
    (all seen to fail); without bos: a document's last target left at its own last id instead of eos,
    targets running into the next document, and streams still counting n + 1 positions (each seen)."""
    docs, store = corpus(lengths)
    for b in range(12):
        got = built(store, lengths, 7, b, rows, seq_len, bos=bos)
        want = reference_batch(docs, 7, b, rows, seq_len, bos=bos)
        assert sorted(got.arrays()) == sorted(BASE_DTYPES)
        for key, array in got.arrays().items():
            np.testing.assert_array_equal(array, want[key], err_msg=f"batch {b} {key}")
            assert array.dtype == BASE_DTYPES[key]


def test_a_finite_stream_pads_its_last_row_and_stops():
    lengths = [5, 9, 2]
    docs, store = corpus(lengths)
    got = built(store, lengths, None, 0, 3, 8, finite=True)  # 19 positions in 24
    want = reference_batch(docs, None, 0, 3, 8, finite=True)
    for key, array in got.arrays().items():
        np.testing.assert_array_equal(array, want[key])
    assert got.loss_mask.sum() == 19 and (got.segment_ids[2, 3:] == 0).all()
    assert (got.inputs[2, 3:] == PAD).all() and (got.positions[2, 3:] == 0).all()
    empty = built(store, lengths, None, 1, 3, 8, finite=True)
    assert empty.loss_mask.sum() == 0 and (empty.inputs == PAD).all()


def test_without_bos_a_document_is_its_ids_then_eos_by_hand():
    """[5, 9, 2]-token documents without bos: 16 positions (n each, not n + 1), by hand for the first two."""
    docs, store = corpus([5, 9, 2])
    got = built(store, [5, 9, 2], None, 0, 2, 8, finite=True, bos=None)
    d0, d1 = (list(d) for d in docs[:2])
    assert got.inputs[0].tolist() == d0 + d1[:3] and got.targets[0].tolist() == d0[1:] + [EOS] + d1[1:4]
    assert got.segment_ids[0].tolist() == [1] * 5 + [2] * 3 and got.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert got.loss_mask.sum() == 16 and BOS not in got.inputs


def test_every_epoch_visits_each_document_once_in_a_new_order():
    lengths = [1] * 10  # each document: 2 positions, [bos, t] / [t, eos]
    docs, store = corpus(lengths)
    firsts = []
    for b in range(5):  # 5 batches x 2 rows x 4 positions = 40 positions = 2 epochs
        batch = built(store, lengths, 3, b, 2, 4)
        firsts += [int(t) for t, p in zip(batch.inputs.ravel(), batch.positions.ravel()) if p == 1]
    first_ids = [int(d[0]) for d in docs]
    assert sorted(firsts[:10]) == sorted(first_ids) == sorted(firsts[10:])
    assert firsts[:10] != firsts[10:]


def test_gather_returns_the_documents_in_the_asked_order():
    docs, store = corpus([4, 0, 6, 1])
    ids, lengths = store.gather(np.array([2, 0, 1, 2, 3]))
    np.testing.assert_array_equal(lengths, [6, 4, 0, 6, 1])
    np.testing.assert_array_equal(ids, np.concatenate([docs[2], docs[0], docs[2], docs[3]]))


def test_a_stream_needs_documents():
    for lengths in (np.zeros(0, np.int64), np.zeros(3, np.int64)):  # none; only empty ones (no bos)
        with pytest.raises(ValueError, match="documents of at least one position in all"):
            packing.Stream(lengths, seed=0)
