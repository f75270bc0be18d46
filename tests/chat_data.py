"""Tokenizers, chat templates and conversation files the chat tests share: a Qwen-style and a Llama-3-style
template (written here in those families' layouts), byte-level tokenizers with each family's special tokens, a
config reading them, and a deterministic question-and-answer set from the embedded corpus."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from scone_jax.config import base_config
from scone_jax.data import corpus

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# {% generation %} marks the assistant's text for transformers' own mask (the reference); ours ignores it.
QWEN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
FAMILIES = {"qwen": (QWEN_SPECIALS, QWEN_TEMPLATE), "llama": (LLAMA_SPECIALS, LLAMA_TEMPLATE)}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who led Israel?"},
                {"role": "assistant", "content": "Moses."}, {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "Joshua, son of Nun."}]


def tokenizer_dir(directory: str, family: str, merges: bool = True) -> str:
    """A checkpoint-like directory with a byte-level BPE tokenizer.json with the family's special tokens (merges
    learned on KJV text, or none: then every character is one token) and a tokenizer_config.json holding the
    family's template. Returns the tokenizer.json's path."""
    specials, template = FAMILIES[family]
    os.makedirs(directory, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=(400 if merges else len(alphabet) + len(specials)), special_tokens=specials,
                                  show_progress=False, initial_alphabet=alphabet)
    tok.train_from_iterator(corpus.kjv_documents("train", 0.02)[:300] if merges else ["a"], trainer)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return path


def qa_pairs(count: int, offset: int = 0) -> list[tuple[str, str]]:
    """(question, answer) pairs from the embedded corpus: a verse's first five words and the words that follow
    (3 to 7 of them), verses from `offset` on whose question no earlier pair has (each answer is then the one
    to learn)."""
    pairs, seen = [], set()
    for doc in corpus.kjv_documents("train", 0.02)[offset:]:
        words = doc.split()
        question = " ".join(words[:5])
        if question in seen or len(words) < 8:
            continue
        seen.add(question)
        pairs.append((question, " ".join(words[5:5 + 3 + len(pairs) % 5])))
        if len(pairs) == count:
            return pairs
    raise ValueError(f"the corpus has fewer than {count} distinct questions after {offset}")


def write_conversations(path: str, pairs, field: str = "messages", system: bool = False) -> str:
    with open(path, "w") as f:
        for q, a in pairs:
            messages = ([{"role": "system", "content": "Answer."}] if system else []) + [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({field: messages}) + "\n")
    return path


def chat_config(tokenizer_path: str, train_files: str, eval_files: str = "", **data):
    """The base config training a tiny model on conversations read with the tokenizer's template."""
    c = base_config()
    c.model.update(dict(vocab_size=512, d_model=32, num_layers=2, num_heads=4, d_ff=64, max_seq_len=64))
    c.data.update({**dict(source="chat", train_files=train_files, eval_files=eval_files, tokenizer_path=tokenizer_path,
                          add_bos=False, seq_len=64, global_batch_size=8, worker_count=0), **data})
    c.train.update(dict(num_steps=6, warmup_steps=2, learning_rate=3e-3, log_every=1, eval_every=0,
                        checkpoint_every=3, eval_batches=0))
    c.mesh.data = -1
    return c
