"""Conversations (data.source='chat'): the loss mask from the template against references written from the
template alone and against transformers' own assistant mask, templates whose spans cannot be found refused,
bad conversations refused in one line naming file and line."""
import json
import re

import pytest
from tokenizers import Tokenizer as HFTokenizer
from transformers import PreTrainedTokenizerFast

from scone_jax.data import chat_sources, chat_template, conversations, tokenizer as tokenizer_lib
from tests.chat_data import CONVERSATION, FAMILIES, chat_config, tokenizer_dir, write_conversations

# What each template renders CONVERSATION as, written out by hand from the template's text, cut into
# (piece, the assistant's?) pieces: the reference the encoder's ids and mask are checked against.
QWEN_RENDERED = [
    ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho led Israel?<|im_end|>\n<|im_start|>assistant\n", 0),
    ("Moses.<|im_end|>", 1),
    ("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n", 0),
    ("Joshua, son of Nun.<|im_end|>", 1),
    ("\n", 0)]
LLAMA_RENDERED = [
    ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
     "<|end_header_id|>\n\nWho led Israel?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", 0),
    ("Moses.<|eot_id|>", 1),
    ("<|start_header_id|>user<|end_header_id|>\n\nAnd then?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", 0),
    ("Joshua, son of Nun.<|eot_id|>", 1)]
RENDERED = {"qwen": QWEN_RENDERED, "llama": LLAMA_RENDERED}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """{(family, merges): tokenizer.json path} for both families, with BPE merges and without (one token a byte)."""
    root = tmp_path_factory.mktemp("chat_tok")
    return {(f, m): tokenizer_dir(str(root / f"{f}_{m}"), f, merges=m) for f in FAMILIES for m in (True, False)}


def _encoder(path, loss_on="assistant", template=""):
    tok = tokenizer_lib.Tokenizer.load(path)
    return conversations.Encoder(chat_template.load(template, path), tok, loss_on), tok


def _reference(pieces, specials, hf):
    """Ids and token mask of hand-written pieces for a tokenizer without merges: a special token's spelling is its
    id, every other character its own byte's token."""
    ids, mask = [], []
    for text, assistant in pieces:
        i = 0
        while i < len(text):
            special = next((s for s in specials if text.startswith(s, i)), None)
            ids.append(hf.token_to_id(special) if special else hf.encode(text[i]).ids[0])
            i += len(special) if special else 1
            mask.append(assistant)
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_mask_is_the_replies_and_their_end_of_turn_token_as_written_by_hand(family, family_dirs):
    """Caught: the span started at the rendering of the previous messages without the generation prompt (the role
    header trained on); the template glue after <|im_end|> kept in the span; the final eos target counted with
    loss_on='assistant'."""
    path = family_dirs[(family, False)]
    encoder, _ = _encoder(path)
    ids, mask = encoder.encode(CONVERSATION, "test")
    want_ids, want_mask = _reference(RENDERED[family], FAMILIES[family][0], HFTokenizer.from_file(path))
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask + [0]  # the eos after the conversation is no assistant token
    everything, _ = _encoder(path, "all")
    ids_all, mask_all = everything.encode(CONVERSATION, "test")
    assert ids_all.tolist() == want_ids and mask_all.tolist() == [1] * (len(want_ids) + 1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_and_mask_equal_transformers_apply_chat_template_with_generation_tags(family, family_dirs):
    """transformers renders with the same template and marks the {% generation %} text (the reply and its
    end-of-turn token): its input_ids and assistant_masks are the reference, with a real BPE tokenizer. Caught: the
    special tokens' spellings encoded as text (encode instead of encode_rendered)."""
    path = family_dirs[(family, True)]
    specials = FAMILIES[family][0]
    hf = PreTrainedTokenizerFast(tokenizer_file=path, chat_template=FAMILIES[family][1],
                                 bos_token=specials[0] if family == "llama" else None, eos_token=specials[-1 if family == "qwen" else 1])
    want = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    encoder, _ = _encoder(path)
    ids, mask = encoder.encode(CONVERSATION, "test")
    assert ids.tolist() == list(want["input_ids"])
    assert mask[:-1].tolist() == list(want["assistant_masks"]) and sum(mask) > 10


def test_a_sentencepiece_model_closes_turns_with_its_eos_spelled_in_the_template(tok, tmp_path):
    """The study's models have a SentencePiece tokenizer without chat tokens: a template ends each reply with {{
    eos_token }}, whose spelling </s> (a control piece) must become the eos id, and the newline after it is glue.
    Caught: </s> encoded as the characters '<', '/', 's', '>' (the turn then ends in text and is refused)."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}"
                        "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    encoder = conversations.Encoder(chat_template.load(str(template), tok.path), tok, "assistant")
    ids, mask = encoder.encode([{"role": "user", "content": "In the beginning"},
                                {"role": "assistant", "content": " God created"}], "test")
    assert ids[mask[:-1] == 1][-1] == tok.eos_id
    assert tok.decode(ids[mask[:-1] == 1][:-1].tolist()) == " God created"
    assert tok.decode(ids[mask[:-1] == 0].tolist()).startswith("user: In the beginning\nassistant:")


def test_a_template_that_renders_earlier_turns_otherwise_is_refused_for_assistant_but_not_for_all(family_dirs, tmp_path):
    """Qwen3's template drops the reasoning of turns before the last question: a prefix of the conversation then
    renders other tokens than the whole one's beginning, so the spans cannot be found. Caught: the prefix check
    dropped (the mask then silently marked the wrong tokens)."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.last and m.role == 'assistant' %}"
                        "<think></think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = family_dirs[("qwen", True)]
    encoder, _ = _encoder(path, template=str(template))
    with pytest.raises(conversations.ConversationError, match="cannot be found.*data.loss_on='all'"):
        encoder.encode(CONVERSATION, "f.jsonl:3")
    everything, _ = _encoder(path, "all", template=str(template))
    assert everything.encode(CONVERSATION, "f.jsonl:3")[1].all()


def test_a_turn_that_ends_in_plain_text_is_refused(family_dirs, tmp_path):
    """Caught: the end-of-turn check dropped (a model trained so never learns to stop)."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    encoder, _ = _encoder(family_dirs[("qwen", False)], template=str(template))
    with pytest.raises(conversations.ConversationError, match="not a special token"):
        encoder.encode(CONVERSATION, "test")


@pytest.mark.parametrize("record,message", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "role 'bot'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]}, "empty assistant turn"),
    ({"text": "hello"}, "no field 'messages'"),
    ({"messages": [{"role": "user", "content": "a"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]}, "not a string"),
])
def test_a_bad_conversation_is_refused_naming_its_file_and_line(record, message, family_dirs, tmp_path):
    """Caught: the role check dropped (a 'bot' turn rendered as if it were a user's)."""
    path = tmp_path / "c.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")
    config = chat_config(family_dirs[("qwen", True)], str(path))
    source = chat_sources.open_chat(config.data, [str(path)], tokenizer_lib.Tokenizer.load(config.data.tokenizer_path))
    with pytest.raises(conversations.ConversationError, match=f"{path}:3: .*{message}.*Fix:"):
        source.example(1)


def test_templates_that_do_not_compile_or_refuse_a_conversation_say_so(family_dirs, tmp_path):
    """raise_exception is a template's own refusal: its words reach the message. Caught: the template's error
    replaced by a generic one."""
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(chat_template.TemplateError, match="does not compile"):
        chat_template.load(str(bad), "")
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}"
                      "{% endif %}{{ messages[0].content }}<|im_end|>")
    encoder, _ = _encoder(family_dirs[("qwen", True)], template=str(strict))
    with pytest.raises(conversations.ConversationError, match="f.jsonl:7: a system message must come first"):
        encoder.encode(CONVERSATION[1:], "f.jsonl:7")
    with pytest.raises(chat_template.TemplateError, match="no chat_template"):
        (tmp_path / "tokenizer_config.json").write_text("{}")
        chat_template.load(str(tmp_path / "tokenizer_config.json"), "")


def test_the_sandbox_keeps_a_template_from_python(family_dirs, tmp_path):
    """Caught: a plain jinja2.Environment (the template then reads Python internals)."""
    evil = tmp_path / "evil.jinja"
    evil.write_text("{{ messages.__class__.__mro__ }}")
    encoder, _ = _encoder(family_dirs[("qwen", True)], template=str(evil))
    with pytest.raises(conversations.ConversationError, match="does not render"):
        encoder.encode(CONVERSATION, "test")


def test_encode_rendered_reads_special_spellings_and_encode_keeps_them_text(tok):
    """SentencePiece: </s> in rendered text is the eos id; in a document it stays characters. Caught: the split on
    the specials' spellings dropping the text after the last one."""
    assert tok.encode_rendered("In the</s> end").tolist() == tok.encode("In the").tolist() + [tok.eos_id] + \
        tok.encode(" end").tolist()
    assert tok.eos_id not in tok.encode("In the</s> end").tolist()


def test_tokenizer_training_refuses_conversations(tmp_path):
    """A chat run without data.tokenizer_path would train a tokenizer that knows no chat template."""
    from scone_jax.training import assets

    config = chat_config("", write_conversations(str(tmp_path / "c.jsonl"), [("a", "b")]))
    with pytest.raises(ValueError, match="Fix: set data.tokenizer_path"):
        assets.ensure_tokenizer(config.data, str(tmp_path / "w"))


def test_a_tokenizer_config_list_of_templates_uses_the_default_one(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert chat_template.load(str(tmp_path), "").source == "D"
    assert chat_template.load("", str(tmp_path / "tokenizer.json")).source == "D"



@pytest.mark.parametrize("source,message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "more than 1,000,000 steps"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}", "1,000,000 steps"),
    ("{% macro f(n) %}{% for i in range(3) %}{{ f(n) }}{% endfor %}{% endmacro %}{{ f(0) }}", "recurses without end"),
    ("{{ 'x' * 1000000000 }}", "repeats a sequence into more than 10,000,000 items"),
    ("{{ 7 ** 100000000 }}", "computes a power of more than 100,000 bits"),
])
def test_a_runaway_template_stops_within_its_budget_naming_itself(source, message, tmp_path):
    """Each would run for hours or fill the memory; the budget stops it within seconds, in one line naming the
    template. Caught: the plain sandbox (a nested range(100000) loop ran with no limit and no message)."""
    import time

    path = tmp_path / "runaway.jinja"
    path.write_text(source)
    template = chat_template.load(str(path), "")
    start = time.monotonic()
    with pytest.raises(chat_template.TemplateError, match=f"the chat template of {path} .*{re.escape(message)}"):
        template.render(CONVERSATION, False, {"bos_token": "", "eos_token": "", "pad_token": ""})
    assert time.monotonic() - start < 10


def test_the_budget_is_each_renderings_own(tmp_path):
    """A template of about 550,000 steps renders again and again: the budget restarts with each rendering (bug
    it caught: a budget shared by a process's renderings, which a long corpus would exhaust)."""
    path = tmp_path / "long.jinja"
    path.write_text("{% for i in range(50000) %}{% for j in range(9) %}{% endfor %}{% endfor %}ok")
    template = chat_template.load(str(path), "")
    assert [template.render(CONVERSATION, False, {}) for _ in range(3)] == ["ok"] * 3
