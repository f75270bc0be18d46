"""Generate n samples for every prompt of a set and score them by exact match:
`python -m scone_jax.serving.generate_batch --export=DIR --prompts=FILE.jsonl --output=OUT.jsonl`.

The prompt file holds one JSON object a line: {"prompt": text} (read as a document's start: [bos] + ids
unless the run had data.add_bos=False) or {"messages": [{role, content}, ...]} (a conversation up to the
user's turn, rendered with the chat template and its generation prompt, as the model saw conversations in
training: data/conversations.py), an optional "id" (default: the line number) and an optional "answer": a
string or a list of accepted strings. Each sample decodes with the KV-cache Generator (serving/generate.py:
f-gram rows from the export's table) until a stop token or --max_new_tokens: the tokenizer's eos, for
conversations also the template's end-of-turn token (the special token that closes an assistant turn), and
any --stop_tokens. Sampling: --temperature (0 = greedy), then --top_k, then --top_p. Sample j of the prompt on
line i draws with the key fold_in(fold_in(key(--seed), i), j), so what it draws does not depend on
--batch_size or on the other prompts.

Prompts of different lengths: the KV cache holds one position counter for the whole batch (no left padding),
so a batch holds samples of prompts of one token length; each length compiles its own prefill, and the
one-token step is shared by the lengths whose KV cache rounds to the same size (generate.cache_slots).

Writes --output, one line per sample in prompt order: {"id", "sample", "text" (the new tokens up to the stop,
decoded), "tokens" (their ids), "finish_reason" ("stop" or "length"), "correct" (with an answer: the exact
match of serving/exact_match.py)}, and --summary (default OUTPUT.summary.json): prompts scored, samples per
prompt, pass@k for each --pass_at k (the unbiased estimator), finish reasons, new tokens and seconds. Both are
written whole at the end (temporary file, then rename); neither may name an input (the prompt file, a file in the
export bundle, the chat template) or the other (runtime/outputs.py). Bad input (a line without a prompt, a bad
conversation, an id that is not a string or a number, a prompt that leaves no room for --max_new_tokens in a
model of learned positions, k > n) is one line and exit 2, before anything is generated.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from scone_jax.data import chat_template, conversations
from scone_jax.data.prompt import prompt_ids
from scone_jax.runtime import logs, outputs, tool_main
from scone_jax.serving import exact_match, generate, inference


@dataclasses.dataclass
class Prompt:
    id: object
    line: int  # 1-based line of the prompt file: the samples' keys follow it
    ids: np.ndarray  # int32 token ids the model reads
    answers: list | None
    chat: bool


def _answers(record: dict, where: str) -> list | None:
    answer = record.get("answer")
    if answer is None:
        return None
    if isinstance(answer, str):
        return [answer]
    if isinstance(answer, list) and answer and all(isinstance(a, str) for a in answer):
        return answer
    raise ValueError(f"{where}: 'answer' is {json.dumps(answer)[:40]}, not a string or a list of strings. Fix: e.g. "
                     "\"answer\": \"Moses\" or [\"Moses\", \"Moshe\"].")


def prompt_messages(record: dict, where: str) -> list[dict]:
    """A prompt conversation checked: roles and contents as in training (data/conversations.py), ending with a
    user's (or system) turn, so the reply is the model's."""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' is not a list of messages. Fix: [{{\"role\": \"user\", \"content\": ...}}].")
    checked = conversations.messages_of({"m": messages + [{"role": "assistant", "content": "x"}]}, "m", where)[:-1]
    if checked[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the conversation ends with an assistant turn; the model replies to the last user "
                         "turn. Fix: end it with the question.")
    return checked


def read_prompts(path: str, tokenizer, add_bos: bool, encoder_for) -> list[Prompt]:
    """Every prompt of the file, tokenized (module docstring); `encoder_for()` gives the conversation encoder."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"--prompts={path!r} does not exist. Fix: a JSONL file of prompts.") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts={path!r} is not UTF-8 text ({e.reason}). Fix: convert it to UTF-8.") from None
    prompts, ids_seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: bad JSON ({e.msg}). Fix: repair or remove that line.") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise ValueError(f"{where}: a prompt line needs exactly one of 'prompt' (text) and 'messages' (a "
                             "conversation). Fix: e.g. {\"id\": 1, \"prompt\": \"...\", \"answer\": \"...\"}.")
        prompt_id = record.get("id", number)
        if not isinstance(prompt_id, (str, int, float)):
            raise ValueError(f"{where}: 'id' is {json.dumps(prompt_id)[:40]}, not a string or a number. Fix: e.g. "
                             "\"id\": \"q17\" or \"id\": 17.")
        if prompt_id in ids_seen:
            raise ValueError(f"{where}: the id {prompt_id!r} is used twice. Fix: give each prompt its own id.")
        ids_seen.add(prompt_id)
        if "prompt" in record:
            if not isinstance(record["prompt"], str):
                raise ValueError(f"{where}: 'prompt' is not a string. Fix: the prompt's text.")
            ids, chat = prompt_ids(tokenizer, record["prompt"], add_bos), False
        else:
            messages = prompt_messages(record, where)
            ids = encoder_for().prompt_ids(messages, where)
            ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32) if add_bos else ids
            chat = True
        prompts.append(Prompt(prompt_id, number, np.asarray(ids, np.int32), _answers(record, where), chat))
    if not prompts:
        raise ValueError(f"--prompts={path!r} holds no prompt. Fix: one JSON object a line.")
    return prompts


def end_of_turn(encoder: conversations.Encoder) -> int:
    """The special token the template closes an assistant turn with (the last of a reply's tokens)."""
    ids, mask = conversations.Encoder(encoder.template, encoder.tokenizer, "assistant").encode(
        [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Yes"}], "the end-of-turn probe")
    return int(ids[np.flatnonzero(mask[:-1])[-1]])


def batches(prompts: list[Prompt], num_samples: int, rows: int) -> list[list[tuple[int, int]]]:
    """(prompt number, sample) pairs in batches of at most `rows`, each of prompts of one token length."""
    by_length = collections.defaultdict(list)
    for p, prompt in enumerate(prompts):
        by_length[len(prompt.ids)].extend((p, s) for s in range(num_samples))
    return [pairs[i:i + rows] for _, pairs in sorted(by_length.items()) for i in range(0, len(pairs), rows)]


def finish(new: np.ndarray, stops: set[int]) -> tuple[list[int], str]:
    """(the new ids up to the first stop token, "stop" or "length")."""
    new = [int(i) for i in new]
    for at, token in enumerate(new):
        if token in stops:
            return new[:at], "stop"
    return new, "length"


def generate_all(generator: generate.Generator, prompts: list[Prompt], *, num_samples: int, max_new_tokens: int,
                 seed: int, batch_rows: int, stops: set[int]) -> list[dict]:
    """Every sample of every prompt, in prompt order: {prompt, sample, tokens, finish_reason}."""
    base = jax.random.key(seed)
    keys_of = jax.jit(jax.vmap(lambda line, s: jax.random.fold_in(jax.random.fold_in(base, line), s)))
    results = {}
    for pairs in batches(prompts, num_samples, batch_rows):
        padded = pairs + [pairs[-1]] * (max(len(pairs), 1 << (len(pairs) - 1).bit_length()) - len(pairs))  # few shapes
        tokens = np.stack([prompts[p].ids for p, _ in padded])
        keys = keys_of(jnp.asarray([prompts[p].line for p, _ in padded]), jnp.asarray([s for _, s in padded]))
        out = generator.generate(tokens, max_new_tokens, row_keys=keys, stop_ids=stops)
        for (p, s), row in zip(pairs, out["tokens"]):
            ids, reason = finish(row[tokens.shape[1]:], stops)
            results[p, s] = {"prompt": p, "sample": s, "tokens": ids, "finish_reason": reason}
    return [results[p, s] for p in range(len(prompts)) for s in range(num_samples)]


def _write_lines(path: str, rows: list[dict]) -> None:
    """`rows` as JSON lines at `path`, replaced at once (a temporary file beside it, then a rename)."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".samples-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _define_flags():
    export = inference.define_export_flag()
    f = types.SimpleNamespace(export=export)
    f.prompts = flags.DEFINE_string("prompts", "", "JSONL prompt set: {\"prompt\": text} or {\"messages\": [...]}, "
                                    "optional \"id\" and \"answer\" (a string or a list).")
    f.output = flags.DEFINE_string("output", "", "JSONL file of the samples (local).")
    f.summary = flags.DEFINE_string("summary", "", "JSON summary (default: OUTPUT.summary.json).")
    f.num_samples = flags.DEFINE_integer("num_samples", 1, "Samples per prompt (n of pass@k).")
    f.max_new_tokens = flags.DEFINE_integer("max_new_tokens", 64, "New tokens per sample at most.")
    f.temperature = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
    f.top_k = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = all).")
    f.top_p = flags.DEFINE_float("top_p", 1.0, "Then among the fewest most likely tokens of probability >= top_p.")
    f.seed = flags.DEFINE_integer("seed", 0, "Sampling seed.")
    f.batch_size = flags.DEFINE_integer("batch_size", 16, "Samples decoded together at most.")
    f.pass_at = flags.DEFINE_string("pass_at", "1", "Comma-separated k of pass@k (each <= --num_samples).")
    f.chat_template = flags.DEFINE_string("chat_template", "", "For 'messages' prompts: a .jinja file, a "
                                          "tokenizer_config.json or a checkpoint directory ('' = the export's run's "
                                          "data.chat_template, else the files beside its data.tokenizer_path).")
    f.stop_tokens = flags.DEFINE_string("stop_tokens", "", "Comma-separated spellings of more tokens that end a sample.")
    f.table, f.max_table_bytes = inference.define_table_flags()
    return f


def _checked_numbers(args) -> list[int]:
    for name in ("num_samples", "max_new_tokens", "batch_size"):
        if getattr(args, name).value < 1:
            raise ValueError(f"--{name}={getattr(args, name).value} must be at least 1.")
    generate.check_sampling(args.temperature.value, args.top_k.value, args.top_p.value)
    try:
        ks = sorted({int(k) for k in args.pass_at.value.split(",") if k.strip()})
    except ValueError:
        raise ValueError(f"--pass_at={args.pass_at.value!r} is not a comma-separated list of whole numbers.") from None
    if not ks or ks[0] < 1 or ks[-1] > args.num_samples.value:
        raise ValueError(f"--pass_at={args.pass_at.value!r} needs each k in [1, --num_samples={args.num_samples.value}]. "
                         "Fix: fewer k, or more samples.")
    return ks


def _stops(tokenizer, extra: str, chat_end: int | None) -> set[int]:
    stops = {tokenizer.eos_id} | ({chat_end} if chat_end is not None else set())
    for spelling in (s.strip() for s in extra.split(",") if s.strip()):
        found = tokenizer.token_to_id(spelling)
        if found is None:
            raise ValueError(f"--stop_tokens: {spelling!r} is not a token of the export's tokenizer. Fix: spell tokens "
                             "as its vocabulary does (e.g. <|im_end|>).")
        stops.add(found)
    return stops


def run(args):
    logs.quiet_libraries()
    tool_main.require(export=args.export.value, prompts=args.prompts.value, output=args.output.value)
    ks = _checked_numbers(args)
    output, summary_path = args.output.value, args.summary.value or args.output.value + ".summary.json"
    inputs = {"--prompts": args.prompts.value, "--export": args.export.value,
              "--chat_template": args.chat_template.value}
    outputs.refuse_inputs(output, "--output", inputs)
    outputs.refuse_inputs(summary_path, "--summary", {**inputs, "--output": output})
    tool_main.check_result_path(output, "--output")
    tool_main.check_result_path(summary_path, "--summary")
    served = inference.load(args.export.value, table=args.table.value, max_table_bytes=args.max_table_bytes.value)
    tok, data = served.tokenizer, served.config.data
    encoders = []

    def encoder_for():
        if not encoders:
            template = chat_template.load(args.chat_template.value or data.get("chat_template", ""),
                                          data.get("tokenizer_path", ""))
            encoders.append(conversations.Encoder(template, tok, "all"))
        return encoders[0]

    prompts = read_prompts(args.prompts.value, tok, data.add_bos, encoder_for)
    model = served.config.model
    longest = max(len(p.ids) for p in prompts)
    if model.position == "learned" and longest + args.max_new_tokens.value > model.max_seq_len:
        worst = next(p for p in prompts if len(p.ids) == longest)
        raise ValueError(f"{args.prompts.value}:{worst.line}: a prompt of {longest} tokens + --max_new_tokens="
                         f"{args.max_new_tokens.value} exceed model.max_seq_len={model.max_seq_len}. Fix: fewer new "
                         "tokens, or a shorter prompt.")
    stops = _stops(tok, args.stop_tokens.value, end_of_turn(encoder_for()) if encoders else None)
    generator = generate.Generator(served, temperature=args.temperature.value, top_k=args.top_k.value,
                                   top_p=args.top_p.value)
    start = time.time()
    samples = generate_all(generator, prompts, num_samples=args.num_samples.value, seed=args.seed.value,
                           max_new_tokens=args.max_new_tokens.value, batch_rows=args.batch_size.value, stops=stops)
    seconds = time.time() - start
    rows, correct = [], collections.defaultdict(list)
    for sample in samples:
        prompt = prompts[sample["prompt"]]
        row = {"id": prompt.id, "sample": sample["sample"], "text": tok.decode(sample["tokens"]),
               "tokens": sample["tokens"], "finish_reason": sample["finish_reason"]}
        if prompt.answers is not None:
            row["correct"] = exact_match.is_correct(row["text"], prompt.answers)
            correct[sample["prompt"]].append(row["correct"])
        rows.append(row)
    summary = {**exact_match.summary(correct, ks), "prompts_generated": len(prompts),
               "finish_reasons": dict(collections.Counter(r["finish_reason"] for r in rows)),
               "new_tokens": sum(len(r["tokens"]) for r in rows), "seconds": round(seconds, 3)}
    _write_lines(output, rows)
    tool_main.write_result(summary_path, summary)
    print(json.dumps(summary))
    print(f"wrote {len(rows)} samples of {len(prompts)} prompts to {output}", file=sys.stderr)


if __name__ == "__main__":
    _args = _define_flags()
    tool_main.run(lambda: run(_args), program="scone_jax.serving.generate_batch")
