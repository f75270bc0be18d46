"""Rows of whole conversations: the layout against a plain greedy packer, segments that keep conversations
apart in the model, overlong conversations refused or truncated and counted, shards equal to JSONL, held-out
batches counting the masked targets, f-grams counted on the rendered corpus."""
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax.data import conversation_docs, conversation_rows, pipeline, tokenizer as tokenizer_lib
from scone_jax.model.transformer import Decoder
from tests.chat_data import chat_config, qa_pairs, tokenizer_dir, write_conversations
from tests.common import run_tool


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(tokenizer.json path, conversations file of 60 KJV question/answer pairs) with the Qwen-style template."""
    root = tmp_path_factory.mktemp("chat_rows")
    path = tokenizer_dir(str(root / "qwen"), "qwen")
    return path, write_conversations(str(root / "c.jsonl"), qa_pairs(60))


def _greedy_reference(lengths, order, seq_len):
    """Rows as a person packs them: walk the order, start a new row when the next conversation does not fit."""
    rows, row, used = [], [], 0
    for c in order:
        if used + lengths[c] > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(int(c))
        used += lengths[c]
    return rows + [row]


def test_rows_are_the_greedy_packing_of_each_epochs_order_and_any_row_can_be_built_alone():
    """Caught: a row that took a conversation that no longer fits (searchsorted side='left' there: 'right' is the
    first that overflows), and epochs numbered from the wrong first row after the first epoch."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 17, 50)
    layout = conversation_rows.RowLayout(lengths, 16, seed=3)
    want = []
    for epoch in range(3):
        want += _greedy_reference(lengths, np.random.default_rng([3, epoch]).permutation(50), 16)
    got = layout.rows(0, len(want))
    assert [r.tolist() for r in got] == want
    assert all(lengths[r].sum() <= 16 for r in got)
    fresh = conversation_rows.RowLayout(lengths, 16, seed=3)  # a resumed worker: row 70 first, then row 5
    assert [r.tolist() for r in fresh.rows(70, 3)] == want[70:73] and fresh.rows(5, 1)[0].tolist() == want[5]


def test_a_batch_holds_whole_conversations_in_segments_of_their_own(qwen):
    """Each conversation appears once per epoch, whole, as one segment whose inputs, targets and positions are
    its example's and whose loss mask is its reply's tokens; padding is segment 0 with no loss. Caught: the mask
    taken from the token mask instead of the targets' (one position early without a bos); positions counted from
    the row's start instead of each conversation's."""
    path, conversations_file = qwen
    config = chat_config(path, conversations_file, seq_len=128, global_batch_size=4)
    tok = tokenizer_lib.Tokenizer.load(path)
    build = pipeline.batch_builder(config.data, tok)
    docs = build._stream.docs
    seen = []
    assert (build(0).segment_ids.max(1) >= 2).all()  # rows of several conversations
    for b in range(20):
        batch = build(b)
        for r in range(4):
            seg = batch.segment_ids[r]
            assert (batch.loss_mask[r][seg == 0] == 0).all() and (seg[seg > 0] == np.sort(seg[seg > 0])).all()
            for s in range(1, seg.max() + 1):
                cols = np.flatnonzero(seg == s)
                inputs = batch.inputs[r, cols]
                match = [i for i in range(len(docs)) if docs.lengths[i] == len(cols)
                         and (docs.gather(np.array([i]))[0] == inputs).all()]
                assert len(match) >= 1 and (batch.positions[r, cols] == np.arange(len(cols))).all()
                ids, mask, _ = docs.gather(np.array([match[0]]))
                assert (batch.targets[r, cols] == np.append(ids[1:], tok.eos_id)).all()
                assert (batch.loss_mask[r, cols] == mask[1:]).all() and mask[1:].sum() > 0
                seen.append(match[0])
    assert sorted(seen[:60]) == list(range(60))  # the first epoch: every conversation once


def test_a_tokens_logits_do_not_change_when_another_conversation_in_its_row_does(qwen):
    """The model reads the segment ids: conversation 2 of a row gets the same logits whatever conversation 1
    holds, and the same as alone. Caught: every position given segment 1 (attention across conversations). (With
    RoPE, positions counted from the row's start give the same logits: the test above catches that.)"""
    path, conversations_file = qwen
    config = chat_config(path, conversations_file, seq_len=128, global_batch_size=8)
    config.model.max_seq_len = 128
    batch = pipeline.batch_builder(config.data, tokenizer_lib.Tokenizer.load(path))(0)
    r = int(np.flatnonzero(batch.segment_ids.max(1) >= 2)[0])
    model = Decoder(config.model, nnx.Rngs(0))

    def logits(inputs, segments, positions):
        return np.asarray(model(jnp.asarray(inputs[None]), jnp.asarray(segments[None]), jnp.asarray(positions[None]))[0])

    seg, pos = batch.segment_ids[r], batch.positions[r]
    base = logits(batch.inputs[r], seg, pos)
    changed = batch.inputs[r].copy()
    changed[seg == 1] = (changed[seg == 1] * 7 + 3) % 300
    second = seg == 2
    np.testing.assert_allclose(logits(changed, seg, pos)[second], base[second], atol=1e-5)
    alone = logits(batch.inputs[r][second], np.ones(second.sum(), np.int32), pos[second])
    np.testing.assert_allclose(alone, base[second], atol=1e-5)
    assert not np.allclose(logits(changed, np.ones_like(seg), np.arange(128, dtype=np.int32))[second], base[second],
                           atol=1e-5)


def test_an_overlong_conversation_is_refused_with_the_count_or_truncated_and_said_once(qwen, tmp_path, caplog):
    """Caught: the count dropped from the refusal; the truncated conversation's final eos target left in the
    loss (it would teach the model to stop where the text was cut)."""
    path, _ = qwen
    long_answer = " ".join(["and the LORD spake unto Moses"] * 12)
    pairs = qa_pairs(10) + [("Say it twice", long_answer), ("Again", long_answer)]
    files = write_conversations(str(tmp_path / "long.jsonl"), pairs)
    tok = tokenizer_lib.Tokenizer.load(path)
    config = chat_config(path, files, seq_len=48, loss_on="all")
    with pytest.raises(ValueError, match=r"2 of the 12 train conversations are longer than a row of "
                                         rf"data.seq_len=48 positions, the first {files}:11 with \d+\. Fix: raise"):
        conversation_docs.load(config.data, "train", tok, np.arange)
    config.data.overlong = "truncate"
    with caplog.at_level(logging.WARNING):
        docs = conversation_docs.load(config.data, "train", tok, np.arange)
    said = [r.getMessage() for r in caplog.records if "longer than a row" in r.getMessage()]
    assert len(said) == 1 and "2 of the 12 train conversations" in said[0] and "truncated" in said[0]
    assert docs.lengths[10] == docs.lengths[11] == 48
    ids, mask, _ = docs.gather(np.array([10]))
    assert mask[:-1].all() and mask[-1] == 0 and (mask[1:] == 1).sum() == 47
    full = conversation_docs.load(chat_config(path, files, seq_len=512, loss_on="all").data, "train", tok, np.arange)
    assert (full.gather(np.array([10]))[0][:48] == ids).all()
    rows = conversation_rows.TrainRows(docs, 48, (None, tok.eos_id, tok.pad_id), seed=0).rows(0, 12)
    assert rows.segment_ids.max() >= 1 and (rows.segment_ids >= 0).all()


def test_a_template_that_writes_the_bos_is_refused_with_add_bos(tmp_path):
    """Llama 3's template writes <|begin_of_text|> itself; data.add_bos would make it two. Caught: the check dropped."""
    path = tokenizer_dir(str(tmp_path / "llama"), "llama", merges=False)
    config = chat_config(path, write_conversations(str(tmp_path / "c.jsonl"), qa_pairs(3)), add_bos=True, seq_len=256)
    with pytest.raises(ValueError, match="writes the bos token itself.*Fix: set data.add_bos=False"):
        conversation_docs.load(config.data, "train", tokenizer_lib.Tokenizer.load(path), np.arange)
    config.data.add_bos = False
    assert len(conversation_docs.load(config.data, "train", tokenizer_lib.Tokenizer.load(path), np.arange)) == 3


def test_pretokenized_chat_shards_give_the_jsonl_batches_and_are_refused_elsewhere(qwen, tmp_path):
    """tools/pretokenize.py --format=chat stores ids and masks; training from them equals training from the JSONL,
    truncation included. Caught: the mask bytes read as ids (records split at 4n + 4)."""
    path, conversations_file = qwen
    out = tmp_path / "shards"
    result = run_tool("tools/pretokenize.py", ["--format=chat", f"--input={conversations_file}", f"--tokenizer={path}",
                                               f"--output={out}", "--workers=1", "--num_shards=2"])
    assert result.returncode == 0, result.stderr[-2000:]
    tok = tokenizer_lib.Tokenizer.load(path)
    batches = []
    for files in (conversations_file, f"{out}/tokens-*.arrayrecord"):
        config = chat_config(path, files, seq_len=32, overlong="truncate", global_batch_size=4)
        build = pipeline.batch_builder(config.data, tok)
        batches.append([build(b) for b in range(6)])
    for a, b in zip(*batches):
        for key, array in a.arrays().items():
            np.testing.assert_array_equal(array, b.arrays()[key], err_msg=key)
    config = chat_config(path, f"{out}/tokens-*.arrayrecord", loss_on="all")
    with pytest.raises(ValueError, match="masks for data.loss_on='assistant'.*Fix"):
        pipeline.batch_builder(config.data, tok)
    config.data.source = "arrayrecord"
    with pytest.raises(ValueError, match="holds conversations.*Fix: set data.source='chat'"):
        pipeline.batch_builder(config.data, tok)


def test_held_out_batches_hold_every_conversation_once_and_count_the_masked_targets(qwen):
    """The held-out loss averages over the replies' tokens: num_tokens is their count, split over two processes
    that yield the same number of batches. Caught: num_tokens counting every position."""
    path, conversations_file = qwen
    config = chat_config(path, conversations_file, conversations_file, seq_len=64, global_batch_size=4)
    tok = tokenizer_lib.Tokenizer.load(path)
    whole = pipeline.make_eval_batches(config.data, tok)
    docs = conversation_docs.held_out(config.data, tok)
    want = sum(int(docs.gather(np.array([i]))[1][1:].sum()) for i in range(len(docs)))
    assert whole.num_tokens == want == sum(int(b.loss_mask.sum()) for b in whole)
    assert sum(int(b.segment_ids.max(1).sum()) for b in whole) == 60
    config.data.global_batch_size = 8
    halves = [pipeline.make_eval_batches(config.data, tok, process_index=p, process_count=2) for p in range(2)]
    assert len(halves[0]) == len(halves[1]) and halves[0].num_tokens == want
    assert sum(h.local_num_tokens for h in halves) == want == sum(int(b.loss_mask.sum()) for h in halves for b in h)


def test_fgrams_are_counted_on_the_rendered_conversations(qwen, tmp_path):
    """The chat template's own tokens (<|im_end|> \\n <|im_start|> assistant ...) are the corpus' most frequent
    f-grams; plain documents have none of them. Caught: the source opened without the tokenizer (text read)."""
    from scone_jax.config import base_config
    from scone_jax.training import assets

    path, conversations_file = qwen
    config = chat_config(path, conversations_file)
    scone = base_config().scone
    scone.update(dict(enabled=True, max_len=3, num_fgrams=50, min_count=2, extract_max_tokens=1_000_000))
    tok = tokenizer_lib.Tokenizer.load(path)
    vocab = assets.ensure_vocab(scone, config.data, tok, str(tmp_path / "w"))
    end, start = tok.encode_rendered("<|im_end|>")[0], tok.encode_rendered("<|im_start|>")[0]
    docs = conversation_docs.load(config.data, "train", tok, np.arange)
    assert vocab.tokens_counted == int(docs.lengths.sum())
    grams = {tuple(vocab.tokens[i][:vocab.lengths[i]].tolist()) for i in range(vocab.num_fgrams)}
    assert (end, tok.encode_rendered("\n")[0], start) in grams
