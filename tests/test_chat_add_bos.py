"""Conversations with data.add_bos=True (every other chat test trains without a bos), and the held-out count
with data.loss_on='all': rows, masks and counts against ids and masks written out by hand from the template.

The tokenizer has no merges, so each character of the rendering is one token and each special token one: a
conversation (user q, assistant a) rendered by the Qwen-style template of tests/chat_data.py is
    <|im_start|> u s e r \\n q... <|im_end|> \\n <|im_start|> a s s i s t a n t \\n a... <|im_end|> \\n
that is len(q) + len(a) + 21 ids; with a bos its example is [bos] + ids (inputs) and ids + [eos] (targets), one
row position more than its ids (data/packing.py)."""
import json

import numpy as np
import pytest

from scone_jax.data import pipeline, tokenizer as tokenizer_lib
from scone_jax.serving import generate_batch
from tests.chat_data import chat_config, tokenizer_dir, write_conversations

EXACT = ("Who led Israel?", "Moses did it.")  # 15 + 13 + 21 = 49 ids: a row of 50 positions with its bos
LONG = ("Who came next?", "Joshua, son of Nun, " * 3)  # 14 + 60 + 21 = 95 ids: overlong
SEQ_LEN = 50


def rendered(q: str, a: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return tokenizer_dir(str(tmp_path_factory.mktemp("chat_bos") / "qwen"), "qwen", merges=False)


def by_hand(tok, q, a, loss_on):
    """(ids, mask over the ids' targets as data/conversations.py defines it, without the final eos entry): with
    'assistant', a's characters and the <|im_end|> closing it (not the newline after it)."""
    ids = tok.encode_rendered(rendered(q, a))
    assert len(ids) == len(q) + len(a) + 21  # one token a character, one a special token
    if loss_on == "all":
        return ids, np.ones(len(ids), np.float32)
    mask = np.zeros(len(ids), np.float32)
    start = len(q) + 19  # <|im_start|> user \n q <|im_end|> \n <|im_start|> assistant \n
    mask[start:start + len(a) + 1] = 1
    assert tok.decode(ids[start:start + len(a)].tolist()) == a and ids[start + len(a)] == ids[len(q) + 6]  # im_end
    return ids, mask


@pytest.mark.parametrize("loss_on", ["all", "assistant"])
@pytest.mark.parametrize("overlong", ["refuse", "truncate"])
def test_with_a_bos_a_conversation_of_exactly_a_row_keeps_every_target_and_a_longer_one_is_cut_to_fit(
        overlong, loss_on, tok_path, tmp_path):
    """add_bos=True, seq_len 50: the 49-id conversation fills its row whole ([bos] + its ids; targets its ids and
    the eos, whose loss entry is 1 with 'all'; its reply's <|im_end|> target kept with 'assistant'), under
    'refuse' and under 'truncate' (where the overlong one beside it sends every conversation through the cut).
    The 95-id one, with 'truncate': [bos] + its first 49 ids, its final target (the cut's eos) out of the loss.
    Caught (issue 64's surviving mutants, each seen): overlong conversations cut to seq_len ids instead of
    seq_len - 1 with a bos (the rows fail to build); a conversation of exactly a row's length losing its final
    target (the eos entry zeroed as if it had been cut: keep compared with >=)."""
    tok = tokenizer_lib.Tokenizer.load(tok_path)
    pairs = [EXACT] + ([LONG] if overlong == "truncate" else [])
    config = chat_config(tok_path, write_conversations(str(tmp_path / "c.jsonl"), pairs), add_bos=True,
                         seq_len=SEQ_LEN, global_batch_size=2, loss_on=loss_on, overlong=overlong)
    batch = pipeline.batch_builder(config.data, tok)(0)
    bos, eos = tok.bos_id, tok.eos_id
    ids, mask = by_hand(tok, *EXACT, loss_on)
    # The rows' order is the epoch's shuffle (with 'refuse' both rows hold the one conversation); the two
    # conversations both start <|im_start|> u s e r \n W h o: tell them apart by their 11th id.
    r = [k for k in range(2) if batch.inputs[k, 11] == ids[10]][0]
    np.testing.assert_array_equal(batch.inputs[r], np.concatenate([[bos], ids]))
    np.testing.assert_array_equal(batch.targets[r], np.concatenate([ids, [eos]]))
    np.testing.assert_array_equal(batch.loss_mask[r], np.append(mask, 1.0 if loss_on == "all" else 0.0))
    assert (batch.segment_ids[r] == 1).all() and (batch.positions[r] == np.arange(SEQ_LEN)).all()
    if overlong == "refuse":
        return
    long_ids, long_mask = by_hand(tok, *LONG, loss_on)
    other = 1 - r
    np.testing.assert_array_equal(batch.inputs[other], np.concatenate([[bos], long_ids[:SEQ_LEN - 1]]))
    np.testing.assert_array_equal(batch.targets[other], np.concatenate([long_ids[:SEQ_LEN - 1], [eos]]))
    np.testing.assert_array_equal(batch.loss_mask[other], np.append(long_mask[:SEQ_LEN - 1], 0.0))


@pytest.mark.parametrize("add_bos", [False, True])
def test_the_held_out_count_with_loss_on_all_is_every_target_once(add_bos, tok_path, tmp_path):
    """Three held-out conversations of n = 49, 32 and 95 ids, loss_on='all', seq_len 128: without a bos an example
    has n targets (ids 1.. and the eos; token 0 is never one), with a bos n + 1; num_tokens is that sum, the
    loss mask's sum over the batches. Caught: token 0's mask entry counted without a bos (num_tokens 179 instead
    of 176: the held-out loss divided by too many tokens)."""
    tok = tokenizer_lib.Tokenizer.load(tok_path)
    pairs = [EXACT, ("Why?", "Because"), LONG]
    lengths = [len(q) + len(a) + 21 for q, a in pairs]
    assert lengths == [49, 32, 95]
    path = write_conversations(str(tmp_path / "eval.jsonl"), pairs)
    config = chat_config(tok_path, path, path, add_bos=add_bos, seq_len=128, global_batch_size=2, loss_on="all")
    batches = pipeline.make_eval_batches(config.data, tok)
    want = sum(lengths) + (3 if add_bos else 0)
    assert batches.num_tokens == want == sum(int(b.loss_mask.sum()) for b in batches)
    assert want == (179 if add_bos else 176)


def test_a_chat_prompt_keeps_its_bos_under_add_bos(tok_path, tmp_path):
    """generate_batch reads a {"messages": ...} prompt as the model read conversations in training: with
    data.add_bos, [bos] + the rendering with the generation prompt; without, the rendering alone. Caught: the
    chat prompt's bos dropped under add_bos (the model then reads a conversation it never saw a row start with)."""
    from scone_jax.data import chat_template, conversations

    tok = tokenizer_lib.Tokenizer.load(tok_path)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "q", "messages": [{"role": "user", "content": "Who?"}]}) + "\n"
                    + json.dumps({"id": "t", "prompt": "Who?"}) + "\n")
    template = chat_template.load("", tok_path)
    encoder = conversations.Encoder(template, tok, "all")
    want = tok.encode_rendered("<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n")
    assert len(want) == 4 + 19  # "Who?" and the 19 tokens of the user turn's frame and the generation prompt
    for add_bos in (True, False):
        chat, text = generate_batch.read_prompts(str(path), tok, add_bos, lambda: encoder)
        expect = np.concatenate([[tok.bos_id], want]) if add_bos else want
        np.testing.assert_array_equal(chat.ids, expect)
        assert chat.chat and not text.chat and (text.ids[0] == tok.bos_id) == add_bos


def test_pretokenized_shards_keep_a_row_length_conversation_whole_and_cut_a_longer_one(tok_path, tmp_path):
    """The same two conversations through tools/pretokenize.py --format=chat (data/conversation_docs.py's
    RecordConversations cuts as it reads): the batch equals the JSONL's, whose rows the test above checks by hand,
    with add_bos and loss_on='all'. Caught: a shard's conversation of exactly seq_len - 1 ids cut as overlong (its
    final eos target zeroed: `len(i) >= keep`)."""
    from tests.common import run_tool

    conversations_file = write_conversations(str(tmp_path / "c.jsonl"), [EXACT, LONG])
    out = tmp_path / "shards"
    result = run_tool("tools/pretokenize.py", ["--format=chat", f"--input={conversations_file}",
                                               f"--tokenizer={tok_path}", f"--output={out}", "--workers=1",
                                               "--num_shards=1", "--loss_on=all"])
    assert result.returncode == 0, result.stderr[-2000:]
    tok = tokenizer_lib.Tokenizer.load(tok_path)
    batches = [pipeline.batch_builder(chat_config(tok_path, files, add_bos=True, seq_len=SEQ_LEN, global_batch_size=2,
                                                  loss_on="all", overlong="truncate").data, tok)(0)
               for files in (conversations_file, f"{out}/tokens-*.arrayrecord")]
    for key, array in batches[0].arrays().items():
        np.testing.assert_array_equal(array, batches[1].arrays()[key], err_msg=key)
    assert batches[1].loss_mask.sum() == 2 * SEQ_LEN - 1  # every target but the cut conversation's eos
