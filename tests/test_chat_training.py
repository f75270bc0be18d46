"""Fine-tuning on conversations end to end: a resumed run equals an uninterrupted one, and a bad conversation or
template stops `python -m scone_jax.main` in one line with exit 2 before anything trains."""
import json
import os
import types

import numpy as np
import pytest

from scone_jax.training import checkpoint, train
from tests.chat_data import chat_config, qa_pairs, tokenizer_dir, write_conversations
from tests.common import run_main, step_records
from tests.test_train import final_params


@pytest.mark.slow
def test_a_resumed_chat_fine_tune_equals_an_uninterrupted_one(tmp_path):
    """6 steps straight against 3 + a resume (two grain workers build the rows of whole conversations): the
    same batches, losses, held-out losses on the replies' tokens and parameters. Caught: an epoch's order drawn
    from numpy's global generator instead of (seed, epoch) (each worker and the resumed run pack other rows)."""
    path = tokenizer_dir(str(tmp_path / "tok"), "qwen")
    train_file = write_conversations(str(tmp_path / "train.jsonl"), qa_pairs(40))
    eval_file = write_conversations(str(tmp_path / "eval.jsonl"), qa_pairs(12, offset=40))

    def config(steps_per_run):
        c = chat_config(path, train_file, eval_file, seq_len=64, global_batch_size=8, worker_count=2)
        c.train.update(dict(eval_every=3, max_steps_per_run=steps_per_run))
        return c

    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    train.run(config(0), straight)
    assert train.run(config(3), split)["step"] == 3
    assert train.run(config(3), split)["step"] == 6
    a, b = step_records(straight), step_records(split)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [a[s]["batch_crc"] for s in a] == [b[s]["batch_crc"] for s in a]
    assert len({a[s]["batch_crc"] for s in a}) == 6  # 40 conversations over 5 batches an epoch: the second is another order
    np.testing.assert_allclose([a[s]["loss"] for s in a], [b[s]["loss"] for s in a], rtol=1e-6)
    ea, eb = step_records(straight, "eval"), step_records(split, "eval")
    assert sorted(ea) == [3, 6] and [ea[s]["loss"] for s in ea] == pytest.approx([eb[s]["loss"] for s in ea], rel=1e-6)
    for x, y in zip(final_params(config(0), straight), final_params(config(0), split)):
        np.testing.assert_array_equal(x, y)


BAD = {
    "unknown_role": ([{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}], "role 'narrator'"),
    "empty_reply": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}], "empty assistant turn"),
    "no_messages": (None, "no field 'messages'"),
    "overlong": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "In the beginning " * 20}],
                 "1 of the 3 train conversations are longer than a row of data.seq_len=32"),
    "template": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "no system message here"),
    # A template that would loop for hours (caught: the run hung before its first step, with no message).
    "stuck": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
              "t.jinja took more than 1,000,000 steps (loop iterations and calls) to render one conversation"),
}
TEMPLATES = {
    "template": "{% if messages[0].role != 'system' %}{{ raise_exception('no system message here') }}{% endif %}",
    "stuck": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_conversations_stop_the_run_in_one_line_before_training(case, tmp_path):
    """Each bad input: exit 2, one line naming the file and line (or the count), no traceback, no checkpoint.
    Caught: ConversationError made an Exception, not a ValueError (exit 1 and a traceback)."""
    path = tokenizer_dir(str(tmp_path / "tok"), "qwen", merges=False)
    messages, message = BAD[case]
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    lines = [{"messages": good}, {"messages": good}, {"messages": messages} if messages else {"text": "x"}]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    extra = []
    if case in TEMPLATES:
        template = tmp_path / "t.jinja"
        template.write_text(TEMPLATES[case])
        extra = [f"--config.data.chat_template={template}"]
    workdir = tmp_path / "w"
    result = run_main(str(workdir), "--config.data.source=chat", f"--config.data.train_files={data}",
                      "--config.data.add_bos=False", *extra, config=f"tests/small_config.py:{path}", devices=1)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    if case not in ("overlong", *TEMPLATES):
        assert f"{data}:3" in result.stderr
    assert checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() is None


@pytest.mark.slow
def test_a_model_fine_tuned_on_questions_answers_them_through_the_generation_job(tmp_path):
    """A known-answer task from real text: 12 KJV verses, each question its first four words, each answer the words
    that follow. A tiny SCONE model fine-tuned on them (f-grams counted on the rendered conversations) is exported
    and asked through `python -m scone_jax.serving.generate_batch` (chat prompts, the template's end-of-turn
    token as stop, f-gram rows from the table): greedy, it answers the questions it learned and none of 6 it never
    saw; sampled twice, pass@2 >= pass@1. Caught: the stop token of conversations left out (every sample then
    ran on to --max_new_tokens past <|im_end|>, and none matched)."""
    from scone_jax.serving import export, generate_batch
    from tests.chat_data import write_conversations as write
    from tests.common import run_tool

    path = tokenizer_dir(str(tmp_path / "tok"), "qwen")
    learned, unseen = qa_pairs(12), qa_pairs(6, offset=100)
    config = chat_config(path, write(str(tmp_path / "train.jsonl"), learned), seq_len=64, global_batch_size=8)
    config.model.update(dict(d_model=64, d_ff=128, position="rope"))
    config.train.update(dict(num_steps=120, warmup_steps=10, learning_rate=1e-2, checkpoint_every=120, log_every=40))
    config.scone.update(dict(enabled=True, max_len=3, num_fgrams=300, min_count=2, fgram_capacity=128, num_layers=1,
                             extract_max_tokens=100_000))
    workdir, bundle_dir = str(tmp_path / "run"), str(tmp_path / "export")
    assert train.run(config, workdir)["loss"] < 0.2
    export.export(workdir, bundle_dir, dtype="float32", chunk_rows=64)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"{kind}{i}", "messages": [{"role": "user", "content": q}],
                                           "answer": a}) + "\n"
                               for kind, pairs in (("l", learned), ("u", unseen)) for i, (q, a) in enumerate(pairs)))

    result = run_tool("-m scone_jax.serving.generate_batch", [f"--export={bundle_dir}", f"--prompts={prompts}",
                                                               f"--output={tmp_path / 'greedy.jsonl'}",
                                                               "--max_new_tokens=24"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "greedy.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "greedy.jsonl.summary.json").read_text())
    correct = {r["id"]: r["correct"] for r in rows}
    assert sum(correct[f"l{i}"] for i in range(12)) >= 11 and not any(correct[f"u{i}"] for i in range(6))
    assert all(r["finish_reason"] == "stop" for r in rows if r["correct"])
    assert summary["pass@1"] == pytest.approx(sum(correct.values()) / 18)
    args = {"export": bundle_dir, "prompts": str(prompts), "output": str(tmp_path / "sampled.jsonl"), "summary": "",
            "num_samples": 2, "max_new_tokens": 24, "temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 0,
            "batch_size": 36, "pass_at": "1,2", "chat_template": "", "stop_tokens": "", "table": "ram",
            "max_table_bytes": 0}
    generate_batch.run(types.SimpleNamespace(**{k: types.SimpleNamespace(value=v) for k, v in args.items()}))
    sampled = json.loads((tmp_path / "sampled.jsonl.summary.json").read_text())
    assert sampled["samples_per_prompt"] == 2 and sampled["pass@2"] >= sampled["pass@1"] > 0.3
