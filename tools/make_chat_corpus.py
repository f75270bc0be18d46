"""Turn WordNet's glosses into a question-and-answer chat corpus with a fixed train / validation / test split.

  apt-get install wordnet-base        # Debian's WordNet 3.0 database, /usr/share/wordnet (nothing is fetched here)
  python tools/make_chat_corpus.py --output=/data/wordnet_chat [--max_synsets=20000]
  python -m scone_jax.main ... --config.data.source=chat --config.data.train_files=/data/wordnet_chat/train.jsonl \
      --config.data.eval_files=/data/wordnet_chat/validation.jsonl [--config.data.chat_template=/data/wordnet_chat/chat_template.jinja]

Each synset (a sense: its words, part of speech and gloss) gives two conversations, {"messages": [user,
assistant]}:
  define   "What does the noun "dog" mean?" -> its definition (the gloss before the first quoted example)
  name     "Which noun means: <definition>?" -> its first word
The split follows a CRC-32 of the synset's part of speech and offset (train 90%, validation 5%, test 5%), so
it never depends on file order and both questions of a sense stay in one split. Written into --output:
train.jsonl, validation.jsonl, test.jsonl (the conversations), test_prompts.jsonl (the test split's 'name'
questions as prompts for `python -m scone_jax.serving.generate_batch`: every word of the synset is an accepted
answer, scored by exact match), and chat_template.jinja, a plain template ("User: ...", "Assistant: ...", each
reply closed by the tokenizer's eos) for models pretrained without a chat format of their own. --max_synsets
keeps the synsets of the smallest CRCs: a fixed sample, the same split. The last line: `RESULT
chat_corpus_conversations <n>`. Bad input (no WordNet files, an unwritable --output) is one line and exit 2.
"""
import json
import os
import re
import sys
import zlib

from absl import flags

from scone_jax.runtime import tool_main


def _define_flags():
    """Defined only when this file runs as a program: tests import it beside other tools with an --output."""
    flags.DEFINE_string("wordnet_dir", "/usr/share/wordnet", "WordNet 3.0's dict directory (data.noun, data.verb, ...).")
    flags.DEFINE_string("output", "", "Directory for the corpus (created).")
    flags.DEFINE_integer("max_synsets", 0, "Keep this many synsets (those of the smallest CRCs; 0 = all).")


PARTS = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
SPLITS = (("train", 90), ("validation", 5), ("test", 5))  # percent of synsets
TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}{{ '\\n' }}{% elif m.role == 'assistant' %}"
            "Assistant: {{ m.content }}{{ eos_token }}{{ '\\n' }}{% else %}{{ m.content }}{{ '\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")
_MARKER = re.compile(r"\([a-z]+\)$")  # an adjective's syntactic marker, e.g. galore(ip)


def synsets(path: str, part: str):
    """(crc, part, words, definition) of every synset in WordNet data file `path` (license lines skipped)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  "):
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            count = int(fields[3], 16)
            words = [_MARKER.sub("", w).replace("_", " ") for w in fields[4:4 + 2 * count:2]]
            definition = gloss.split('; "')[0].strip().rstrip(";").strip()
            if words and definition:
                yield zlib.crc32(f"{part}:{fields[0]}".encode()), part, words, definition


def split_of(crc: int) -> str:
    percent = crc % 100
    for name, share in SPLITS:
        if percent < share:
            return name
        percent -= share
    raise AssertionError("the shares sum to 100")


def conversations(part: str, words: list[str], definition: str) -> list[dict]:
    noun = PARTS[part]
    return [{"messages": [{"role": "user", "content": f'What does the {noun} "{words[0]}" mean?'},
                          {"role": "assistant", "content": definition}]},
            {"messages": [{"role": "user", "content": f"Which {noun} means: {definition}?"},
                          {"role": "assistant", "content": words[0]}]}]


def write_text(path: str, text: str) -> None:
    """`text` at `path`, replaced at once (a temporary file beside it, then a rename)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def run() -> None:
    FLAGS = flags.FLAGS
    tool_main.require(output=FLAGS.output)
    files = {part: os.path.join(FLAGS.wordnet_dir, f"data.{part}") for part in PARTS}
    missing = [path for path in files.values() if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"No WordNet database at --wordnet_dir={FLAGS.wordnet_dir!r} ({missing[0]} is missing). "
                                "Fix: apt-get install wordnet-base, or point --wordnet_dir at WordNet 3.0's dict files.")
    if FLAGS.max_synsets < 0:
        raise ValueError(f"--max_synsets={FLAGS.max_synsets} is negative. Fix: 0 (all) or a count.")
    tool_main.probe_directory(FLAGS.output)
    found = sorted(s for part, path in files.items() for s in synsets(path, part))
    if FLAGS.max_synsets:
        found = found[:FLAGS.max_synsets]
    out = {name: [] for name, _ in SPLITS}
    prompts = []
    for crc, part, words, definition in found:
        split = split_of(crc)
        out[split].extend(conversations(part, words, definition))
        if split == "test":
            question = out[split][-1]["messages"][0]
            prompts.append({"id": f"{part}:{crc:08x}", "messages": [question], "answer": words})
    for name, rows in list(out.items()) + [("test_prompts", prompts)]:
        write_text(os.path.join(FLAGS.output, f"{name}.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    write_text(os.path.join(FLAGS.output, "chat_template.jinja"), TEMPLATE)
    total = sum(len(rows) for rows in out.values())
    print(f"{len(found):,} synsets -> {total:,} conversations (" +
          ", ".join(f"{name} {len(rows):,}" for name, rows in out.items()) +
          f"), {len(prompts):,} test prompts in {FLAGS.output}", file=sys.stderr)
    print(f"RESULT chat_corpus_conversations {total}")


if __name__ == "__main__":
    _define_flags()
    tool_main.run(run)
