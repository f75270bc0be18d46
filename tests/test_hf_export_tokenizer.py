"""The tokenizer files of `--format=hf` (serving/hf_export.tokenizer_files, hf/sp_tokenizer.py): whatever the run's
tokenizer, `transformers.AutoTokenizer.from_pretrained(H)` opens it with no custom code and encodes and decodes as the
run's tokenizer does; a chat run's template travels; an imported checkpoint's files travel only with its tokenizer.

Deliberate bugs these tests were run against (each made the named test fail):
  - no tokenizer.json for a SentencePiece run (the export as it was: AutoTokenizer fell back to reading
    tokenizer.model as a tiktoken file) (test_a_sentencepiece_run_encodes_and_decodes_in_transformers_as_ours);
  - sp_tokenizer without the dummy prefix (Prepend) normalizer, without the decoder's Strip, or without the cut
    inside byte pieces' spellings ("<0x41>" became the byte A; [unigram]) (the same test; the first two [unigram] and [bpe]);
  - no bos post-processor for a data.add_bos run (the same test: tokenizer(text) lacked the run's bos);
  - sp_tokenizer.check not comparing with sentencepiece (test_a_model_that_encodes_otherwise_is_refused_in_one_line);
  - the chat template of a chat run left out, as the export left it (test_a_chat_run_keeps_its_template);
  - the imported checkpoint's tokenizer_config.json copied whether or not the run's tokenizer is that checkpoint's
    (issue 64: wrong special tokens, its model_max_length) (test_the_checkpoint_s_files_travel_only_with_its_tokenizer).
"""
import json
import os

import pytest

from scone_jax.config import base_config
from scone_jax.data import chat_template, corpus, tokenizer_training
from scone_jax.data.tokenizer import Tokenizer
from scone_jax.hf import sp_tokenizer
from scone_jax.serving import hf_export
from tests import hf_models

pytest.importorskip("transformers")

# Text of every kind a SentencePiece run meets, and some it never saw.
TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  two leading spaces, three   inside and trailing ones   ",
    "line one\nline two\n\n\nafter blank lines\r\nand a CRLF\t\ttabs",
    " ", "\n", "", "a",
    "Numbers: 0 1 42 3.14159 1,000,000 2026-12-07 #7 (x+y)=z",
    "naïve café — “quoted” ‘text’ … Ångström, Æsir, straße",
    "日本語のテキスト, 中文, 한국어, العربية, עברית, Ελληνικά, Кириллица",
    "emoji 🙂🚀 and symbols ☃ ♞ ∑ ∫ √ ≠ ≤ ① ﬁ",
    "zero\u200bwidth and no\u00a0break space and \u0301combining",
    "<0x41><0xE2> literal byte-piece spellings, <0x0A> too",
    "x" * 300,
]


def run_config(tokenizer_path: str, **data):
    c = base_config()
    c.model.update(dict(vocab_size=512, d_model=48, num_layers=2, num_heads=4, d_ff=80, max_seq_len=512))
    c.data.update(dict(tokenizer_path=tokenizer_path, **data))
    return c


def exported(tmp_path, tokenizer: Tokenizer, config) -> str:
    """A directory holding the tokenizer files `--format=hf` writes for this run."""
    out = tmp_path / "hf"
    out.mkdir()
    for name, data in hf_export.tokenizer_files(tokenizer, config).items():
        (out / name).write_bytes(data)
    return str(out)


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def sp_model(request, tmp_path_factory):
    """A trained SentencePiece model as the run trains its own (configs/tiny.py's default is unigram; bpe is
    tools/train_tokenizer.py's --model_type=bpe): identity normalization, whitespace kept, byte fallback."""
    path = str(tmp_path_factory.mktemp("sp") / f"{request.param}.model")
    tokenizer_training.train_tokenizer(corpus.kjv_documents("train", 0.02)[:300], path, vocab_size=500,
                                       model_type=request.param)
    return path


def test_a_sentencepiece_run_encodes_and_decodes_in_transformers_as_ours(sp_model, tmp_path):
    """AutoTokenizer (a plain PreTrainedTokenizerFast from tokenizer.json, as vLLM loads it) gives our ids for KJV
    text, whitespace runs, newlines, digits, unicode, characters the model never saw (byte fallback) and byte-piece
    spellings; tokenizer(text) starts with the run's bos (data.add_bos); decode gives our text back."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = Tokenizer.load(sp_model)
    out = exported(tmp_path, ours, run_config(sp_model))
    assert os.path.isfile(os.path.join(out, "tokenizer.model"))
    auto = AutoTokenizer.from_pretrained(out)
    assert isinstance(auto, PreTrainedTokenizerFast)
    assert (auto.bos_token, auto.eos_token, auto.pad_token, auto.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    texts = TEXTS + list(corpus.kjv_documents("eval", 0.02)[:40])
    for text in texts:
        ids = list(ours.encode(text))
        assert auto(text, add_special_tokens=False).input_ids == ids, text[:60]
        assert auto(text).input_ids == [ours.bos_id] + ids, text[:60]
        assert auto.decode(ids) == ours.decode(ids) == text, text[:60]
        assert auto.decode(auto(text).input_ids, skip_special_tokens=True) == text
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode(TEXTS[9]))  # byte fallback was used
    rendered = "<s>a chat</s> turn"  # special spellings are tokens, as a chat template's rendering is read
    assert auto(rendered, add_special_tokens=False).input_ids == list(ours.encode_rendered(rendered))


def test_a_sentencepiece_model_with_sentencepiece_s_own_defaults(tmp_path):
    """A user's .model as sentencepiece trains it by default (Llama 2's kind: unk 0, bos 1, eos 2, no pad, an NFKC
    map, extra whitespace removed, no byte fallback): AutoTokenizer encodes every text as ours, decodes what has no
    unknown piece as ours, and names its unk. Caught: the unk piece dropped when its id is 0."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus.kjv_documents("train", 0.02)[:300]),
                                   model_writer=writer, vocab_size=500, minloglevel=2)
    path = tmp_path / "default.model"
    path.write_bytes(writer.getvalue())
    ours = Tokenizer.load(str(path))
    auto = AutoTokenizer.from_pretrained(exported(tmp_path, ours, run_config(str(path))))
    assert (auto.unk_token, auto.unk_token_id, auto.bos_token_id, auto.eos_token_id) == ("<unk>", 0, 1, 2)
    for text in TEXTS + list(corpus.kjv_documents("eval", 0.02)[:10]):
        ids = list(ours.encode(text))
        assert auto(text, add_special_tokens=False).input_ids == ids, text[:60]
        if 0 not in ids:
            assert auto.decode(ids) == ours.decode(ids), text[:60]


def test_a_run_without_bos_gets_no_bos_from_the_tokenizer(sp_model, tmp_path):
    """data.add_bos=False: tokenizer(text) is the text's ids alone, as the run's prompts are."""
    from transformers import AutoTokenizer

    ours = Tokenizer.load(sp_model)
    auto = AutoTokenizer.from_pretrained(exported(tmp_path, ours, run_config(sp_model, add_bos=False)))
    assert auto(TEXTS[0]).input_ids == list(ours.encode(TEXTS[0]))


def test_a_model_that_encodes_otherwise_is_refused_in_one_line(sp_model, monkeypatch):
    """A tokenizer.json that would encode otherwise than sentencepiece (here: built without the dummy prefix) is
    refused by the check, naming a text, before an export writes anything."""
    raw = open(sp_model, "rb").read()
    real = sp_tokenizer.settings
    monkeypatch.setattr(sp_tokenizer, "settings", lambda data: {**real(data), "add_dummy_prefix": False})
    with pytest.raises(ValueError) as e:
        hf_export.tokenizer_files(Tokenizer.load(sp_model), run_config(sp_model))
    message = str(e.value)
    assert "cannot be written as a tokenizer.json" in message and "encodes 'In the beginning" in message
    assert "\n" not in message and "Fix:" in message
    monkeypatch.setattr(sp_tokenizer, "settings", real)
    sp_tokenizer.tokenizer_json(raw)  # the model itself passes


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_chat_run_keeps_its_template(tok, tmp_path):
    """A fine-tuned chat run's chat_template.jinja is exported: transformers' apply_chat_template renders a
    conversation as training did (data/chat_template.py) and tokenizes it to the ids training used."""
    from transformers import AutoTokenizer

    template_path = tmp_path / "chat_template.jinja"
    template_path.write_text(TEMPLATE)
    out = exported(tmp_path, tok, run_config(tok.path, source="chat", chat_template=str(template_path)))
    assert open(os.path.join(out, "chat_template.jinja")).read() == TEMPLATE
    auto = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Who begat Enos?"}, {"role": "assistant", "content": "Seth  begat\nEnos."}]
    ours = chat_template.load(str(template_path), tok.path)
    for prompt in (False, True):
        text = ours.render(messages, prompt, chat_template.special_spellings(tok))
        assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == text
        ids = auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == list(tok.encode_rendered(text)) and ids[0] == tok.bos_id
    missing = run_config(tok.path, source="chat", chat_template=str(tmp_path / "gone.jinja"))
    with pytest.raises(ValueError, match="chat template cannot be read for the export: data.chat_template="):
        hf_export.tokenizer_files(tok, missing)


def test_the_checkpoint_s_files_travel_only_with_its_tokenizer(tmp_path):
    """Imported from a checkpoint: with the checkpoint's tokenizer, its tokenizer_config.json (model_max_length,
    chat template), special_tokens_map.json, chat_template.jinja and generation defaults are kept (a run of our own
    with that tokenizer: its files, but model.max_seq_len and no generation defaults); with another tokenizer
    (data.tokenizer_path), none of them: tokenizer_config.json names the run's tokens and model.max_seq_len."""
    from transformers import AutoTokenizer

    source = tmp_path / "checkpoint"
    source.mkdir()
    hf_models.tokenizer_json(str(source / "tokenizer.json"), "llama")
    (source / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "model_max_length": 131072}))
    (source / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6], "temperature": 0.6}))
    other = hf_models.tokenizer_json(str(tmp_path / "tokenizer.json"), "qwen3")

    config = run_config(str(source / "tokenizer.json"))
    config.model.init_from_hf = str(source)
    mine = Tokenizer.load(str(source / "tokenizer.json"))
    files = hf_export.tokenizer_files(mine, config)
    assert {"special_tokens_map.json", "chat_template.jinja", "generation_config.json"} <= set(files)
    assert json.loads(files["tokenizer_config.json"])["model_max_length"] == 131072
    generation = json.loads(files["generation_config.json"])
    assert generation["temperature"] == 0.6 and generation["bos_token_id"] == mine.bos_id
    assert generation["eos_token_id"] == mine.eos_id  # the run's eos (1), not among the checkpoint's [5, 6]

    config.model.init_from_hf = ""  # a run of our own with the checkpoint's tokenizer: its files, our length
    files = hf_export.tokenizer_files(mine, config)
    assert "chat_template.jinja" in files and "generation_config.json" not in files
    assert json.loads(files["tokenizer_config.json"])["model_max_length"] == 512

    config.model.init_from_hf = str(source)
    config.data.tokenizer_path = other
    theirs = Tokenizer.load(other)
    out = exported(tmp_path, theirs, config)
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
    auto = AutoTokenizer.from_pretrained(out)
    assert (auto.eos_token, auto.model_max_length) == ("<|endoftext|>", 512)
    text = "And God said, Let there be light: and there was light."
    assert auto(text, add_special_tokens=False).input_ids == list(theirs.encode(text))
