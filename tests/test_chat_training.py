"""Fine-tuning on conversations end to end: a resumed run equals an uninterrupted one, and a bad conversation or
template stops `python -m scone_jax.main` in one line with exit 2 before anything trains."""
import json
import os

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
    if case == "template":
        template = tmp_path / "t.jinja"
        template.write_text("{% if messages[0].role != 'system' %}{{ raise_exception('no system message here') }}"
                            "{% endif %}")
        extra = [f"--config.data.chat_template={template}"]
    workdir = tmp_path / "w"
    result = run_main(str(workdir), "--config.data.source=chat", f"--config.data.train_files={data}",
                      "--config.data.add_bos=False", *extra, config=f"tests/small_config.py:{path}", devices=1)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    if case not in ("overlong", "template"):
        assert f"{data}:3" in result.stderr
    assert checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() is None
