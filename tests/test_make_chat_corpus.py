"""tools/make_chat_corpus.py: WordNet's glosses as conversations, a split fixed by each synset, prompts scored by
exact match, and a template for models without a chat format that the chat pipeline accepts."""
import json
import os

import numpy as np
import pytest

from scone_jax.data import chat_template, conversations
from tests.common import run_tool
from tools import make_chat_corpus

# Lines in WordNet 3.0's data file format: offset, lexicographer file, part of speech, word count (hex), words
# with their lex ids, pointers, then " | " and the gloss (definition; "examples").
NOUNS = ["  1 This software and database is being provided to you, the LICENSEE, by Princeton University",
         "02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 000 | a member of the genus Canis; \"the dog "
         "barked all night\"",
         "07802417 13 n 01 feed 0 000 | food for domestic livestock"]
ADJS = ["00021110 00 s 02 complaisant 0 obliging 0 000 | showing a cheerful willingness to do favors for others; "
        "\"to close one's eyes like a complaisant husband\"",
        "01384212 00 s 01 galore(ip) 0 000 | in great numbers"]


def _wordnet(tmp_path, extra_nouns=()):
    directory = tmp_path / "wn"
    directory.mkdir()
    for part, lines in (("noun", NOUNS + list(extra_nouns)), ("verb", []), ("adj", ADJS), ("adv", [])):
        (directory / f"data.{part}").write_text("".join(line + "  \n" for line in lines))
    return directory


def test_synsets_give_both_questions_with_the_definition_before_the_examples(tmp_path):
    """Caught: the gloss kept whole (its quoted examples then became part of every answer)."""
    directory = _wordnet(tmp_path)
    nouns = {tuple(w): d for _, _, w, d in make_chat_corpus.synsets(str(directory / "data.noun"), "noun")}
    assert nouns == {("dog", "domestic dog", "Canis familiaris"): "a member of the genus Canis",
                     ("feed",): "food for domestic livestock"}
    adjs = {tuple(w): d for _, _, w, d in make_chat_corpus.synsets(str(directory / "data.adj"), "adj")}
    assert adjs[("galore",)] == "in great numbers"  # the (ip) marker is not part of the word
    assert make_chat_corpus.conversations("adj", ["galore"], "in great numbers")[1]["messages"] == [
        {"role": "user", "content": "Which adjective means: in great numbers?"},
        {"role": "assistant", "content": "galore"}]


def test_the_split_is_a_fixed_function_of_each_synset():
    """About 90/5/5 over many CRCs, the same split for the same CRC. Caught: shares that do not sum to 100."""
    crcs = np.random.default_rng(0).integers(0, 2**32, 20_000)
    splits = [make_chat_corpus.split_of(int(c)) for c in crcs]
    shares = {name: splits.count(name) / len(splits) for name, _ in make_chat_corpus.SPLITS}
    assert abs(shares["train"] - 0.9) < 0.01 and abs(shares["test"] - 0.05) < 0.005
    assert [make_chat_corpus.split_of(int(c)) for c in crcs[:50]] == splits[:50]


def test_the_plain_template_closes_each_reply_with_eos_for_a_tokenizer_without_chat_tokens(tok):
    """The template the tool writes works with the chat pipeline and a SentencePiece tokenizer: the reply and
    its eos are the assistant's tokens."""
    encoder = conversations.Encoder(chat_template.ChatTemplate(make_chat_corpus.TEMPLATE, "test"), tok, "assistant")
    messages = make_chat_corpus.conversations("noun", ["feed"], "food for domestic livestock")[0]["messages"]
    ids, mask = encoder.encode(messages, "test")
    reply = ids[mask[:-1] == 1]
    assert reply[-1] == tok.eos_id and tok.decode(reply[:-1].tolist()) == "food for domestic livestock"
    assert tok.decode(encoder.prompt_ids(messages[:1], "test").tolist()) == \
        'User: What does the noun "feed" mean?\nAssistant:'


@pytest.mark.slow
def test_the_tool_writes_the_splits_and_test_prompts_and_refuses_a_missing_database(tmp_path):
    """Both questions of a synset in one split; test prompts list every word of the synset as an answer; no
    WordNet: one line, exit 2. Caught: prompts made from the 'define' question (no checkable answer)."""
    extra = [f"{10000000 + i:08d} 05 n 01 word{i} 0 000 | sense number {i}" for i in range(60)]
    wordnet = _wordnet(tmp_path, extra)
    out = tmp_path / "out"
    result = run_tool("tools/make_chat_corpus.py", [f"--wordnet_dir={wordnet}", f"--output={out}"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("RESULT chat_corpus_conversations 128")
    rows = {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "validation", "test", "test_prompts")}
    assert sum(len(rows[n]) for n in ("train", "validation", "test")) == 128 and rows["test"]
    for name in ("train", "validation", "test"):
        for define, name_it in zip(rows[name][::2], rows[name][1::2]):
            assert define["messages"][1]["content"] in name_it["messages"][0]["content"]
    for prompt, conversation in zip(rows["test_prompts"], rows["test"][1::2]):
        assert prompt["messages"] == conversation["messages"][:1]
        assert conversation["messages"][1]["content"] == prompt["answer"][0]
    assert os.path.isfile(out / "chat_template.jinja")
    missing = run_tool("tools/make_chat_corpus.py", [f"--wordnet_dir={tmp_path / 'none'}", f"--output={out}"])
    assert missing.returncode == 2 and "apt-get install wordnet-base" in missing.stderr
    assert "Traceback" not in missing.stderr
