"""The batch generation job: top-p against a plain reference, exact match and pass@k against hand-computed values,
the job's greedy samples against the Generator's own output for each prompt alone, draws independent of the
batching, stop tokens, bad prompt files refused before anything is generated."""
import itertools
import json
import math
import os
import re
import types

import jax
import numpy as np
import pytest

from scone_jax.serving import exact_match, generate, generate_batch, inference
from tests import serving_run


def _nucleus_reference(logits, temperature, top_k, top_p):
    """Plain numpy, one row: scale, keep the k largest, then the most likely tokens until their probability
    (renormalised over the k) reaches top_p; every token tied with the last one kept stays."""
    x = np.asarray(logits, np.float64) / temperature
    keep = np.ones(len(x), bool)
    if top_k:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    probs = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass, last = 0.0, None
    for i in order:
        if mass >= top_p:
            break
        mass += probs[i]
        last = x[i]
    return keep & (x >= last)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (0, 0.9), (5, 0.7), (3, 1.0), (0, 1e-6)])
def test_top_k_then_top_p_keep_the_tokens_a_plain_reference_keeps(top_k, top_p):
    """Caught: the nucleus cut one token late (the cumulative mass compared, not the mass before each token)."""
    rng = np.random.default_rng(top_k + int(100 * top_p))
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 3
    logits[0, :4] = logits[0, 4]  # ties
    got = np.isfinite(np.asarray(generate.filtered_logits(logits, 0.7, top_k, top_p)))
    want = np.stack([_nucleus_reference(row, 0.7, top_k, top_p) for row in logits])
    np.testing.assert_array_equal(got, want)


def test_top_p_samples_follow_the_renormalised_nucleus():
    """20,000 draws from one row: only kept tokens, each as often as its renormalised probability (within 4
    standard errors). Caught: the kept tokens' logits replaced (they were then drawn uniformly)."""
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    keys = jax.random.split(jax.random.key(0), 20_000)
    draws = np.asarray(jax.vmap(lambda k: generate.sample(logits, k, 1.0, 0, 0.75))(keys))
    keep = np.array([0.4, 0.25, 0.15])  # 0.4 + 0.25 < 0.75 <= 0.8: three tokens
    want = keep / keep.sum()
    freq = np.bincount(draws, minlength=6) / len(draws)
    assert freq[3:].sum() == 0
    np.testing.assert_allclose(freq[:3], want, atol=4 * np.sqrt(want * (1 - want) / len(draws)).max())


def test_the_normaliser_and_exact_match_on_hand_written_cases():
    """Caught: punctuation stripped inside the text ("lord's" == "lords")."""
    assert exact_match.normalize("  The LORD.\n") == "the lord"
    assert exact_match.normalize("«Moses»!") == "moses" and exact_match.normalize("ﬁrst") == "first"  # NFKC
    assert exact_match.normalize("in  the\tbeginning") == "in the beginning"
    assert exact_match.is_correct("the Lord's", "the lords") is False
    assert exact_match.is_correct("Joshua.", ["Moses", "joshua"]) and not exact_match.is_correct("", "a")


def test_symbols_at_either_end_are_stripped_as_punctuation_is():
    """Unicode symbols (categories S*: degrees, currency, maths) count as punctuation at the ends: '5°' and '$5'
    match '5', '(5 + 5)=' is '5 + 5', inner symbols stay ('5°c' is not '5c'). Caught: trailing symbols no longer
    stripped (only P* at the end: '5°' did not match '5'; issue 64's surviving mutant), and leading ones."""
    assert exact_match.normalize("5°") == "5" and exact_match.is_correct("5°", "5")
    assert exact_match.is_correct("$5", "5") and exact_match.is_correct("100 €.", "100")
    assert exact_match.normalize("(5 + 5)=") == "5 + 5"
    assert exact_match.normalize("5°C") == "5°c" and not exact_match.is_correct("5°C", "5C")


def test_pass_at_k_equals_hand_values_and_counting_every_draw_of_k():
    """pass@k against its definition: the share of k-subsets of the n samples holding a correct one. Caught:
    the product over the wrong range (n - c + 1 .. n), which pass@1 = c / n alone does not show."""
    assert exact_match.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert exact_match.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert exact_match.pass_at_k(5, 0, 3) == 0.0 and exact_match.pass_at_k(5, 3, 3) == 1.0
    for n, c, k in [(6, 1, 3), (7, 3, 2), (8, 2, 5)]:
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert exact_match.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    summary = exact_match.summary({0: [True, False, False, True], 1: [False] * 4}, [1, 2, 8])
    assert summary == {"prompts": 2, "samples_per_prompt": 4, "pass@1": 0.25,
                       "pass@2": pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2)) / 2)}


class _KeyedStub:
    """A Generator's generate() for generate_all alone (no model, no compile): each row's new tokens are its
    prompt's first id (whose prompt it is) and then draws from its own row key, stopping nowhere."""

    def generate(self, tokens, num_tokens, row_keys=None, stop_ids=None):
        data = np.asarray(jax.random.key_data(row_keys)).astype(np.uint64).reshape(len(tokens), -1)
        draws = np.stack([np.random.default_rng(list(d)).integers(3, 1000, num_tokens - 1) for d in data])
        return {"tokens": np.concatenate([tokens, tokens[:, :1], draws], axis=1)}


def test_each_sample_is_its_prompts_and_its_draws_do_not_depend_on_the_batching():
    """generate_all in the fast tier, with a stub generator (the two slow tests below run the real one): five
    prompts (two of one length, so they share a batch) x 3 samples, batched 1, 2, 4 and 16 rows at a time. Each
    sample starts with its own prompt's first id; the draws are the same whatever the batching, and differ
    between the samples of one prompt. Caught: a batch's samples written to the wrong prompts (the rows taken in
    reverse); one key for all rows of a batch (draws depending on the batch a sample lands in)."""
    prompts = [generate_batch.Prompt(i, line, np.asarray(ids, np.int32), None, False) for i, (line, ids) in enumerate(
        [(1, [7, 8, 9]), (2, [11, 12, 13, 14, 15]), (4, [21, 22, 23]), (5, [31]), (6, [41, 42, 43])])]
    runs = [generate_batch.generate_all(_KeyedStub(), prompts, num_samples=3, max_new_tokens=5, seed=4,
                                        batch_rows=rows, stops=set()) for rows in (1, 2, 4, 16)]
    for run_ in runs:
        assert [(r["prompt"], r["sample"]) for r in run_] == [(p, s) for p in range(5) for s in range(3)]
        assert [r["tokens"][0] for r in run_] == [int(prompts[r["prompt"]].ids[0]) for r in run_]
        assert all(r["finish_reason"] == "length" and len(r["tokens"]) == 5 for r in run_)
    assert all([r["tokens"] for r in run_] == [r["tokens"] for r in runs[0]] for run_ in runs[1:])
    for p in range(5):
        assert len({tuple(r["tokens"][1:]) for r in runs[0] if r["prompt"] == p}) == 3
    assert len({tuple(r["tokens"][1:]) for r in runs[0]}) == 15
    stopped = generate_batch.generate_all(_KeyedStub(), prompts, num_samples=1, max_new_tokens=5, seed=4,
                                          batch_rows=4, stops={31})  # prompt 3's first id: its sample stops at once
    assert stopped[3]["tokens"] == [] and stopped[3]["finish_reason"] == "stop"
    assert [r["tokens"] for r in stopped[:3]] == [r["tokens"] for r in runs[0] if r["sample"] == 0][:3]
    assert generate_batch.finish(np.array([5, 6, 7, 6]), {6}) == ([5], "stop")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return inference.load(serving_run.exported(tmp_path_factory, "float32"))


# Token lengths 8, 10, 4, 4, 6 with the session's tokenizer: "And the earth was" and "And it was so" share a batch.
TEXTS = ["In the beginning", "And God said, Let there be", "And the earth was", "And it was so", "Blessed"]


def _args(tmp_path, prompts, **values):
    defaults = dict(export="bundle", prompts=str(prompts), output=str(tmp_path / "out.jsonl"), summary="",
                    num_samples=1, max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=0, batch_size=4,
                    pass_at="1", chat_template="", stop_tokens="", table="ram", max_table_bytes=None)
    defaults.update(values)
    return types.SimpleNamespace(**{k: types.SimpleNamespace(value=v) for k, v in defaults.items()})


def _prompt_file(tmp_path, rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow  # compiles a prefill per prompt length
def test_greedy_samples_are_the_generators_output_for_each_prompt_alone(served, tmp_path, monkeypatch):
    """Prompts of four token lengths, batched by length (two prompts share one): each sample is the Generator's greedy
    continuation of that prompt decoded alone, and the scores follow the answers given. Caught: a batch's samples
    written to the wrong prompts (the rows taken in reverse)."""
    monkeypatch.setattr(inference, "load", lambda *a, **k: served)
    tok = served.tokenizer
    assert len(tok.encode(TEXTS[2])) == len(tok.encode(TEXTS[3]))
    alone = [generate.Generator(served).generate(np.asarray([[tok.bos_id, *tok.encode(t)]], np.int32), 8)["tokens"][0]
             for t in TEXTS]
    first = [tok.decode(row[len(tok.encode(t)) + 1:].tolist()) for row, t in zip(alone, TEXTS)]
    rows = [{"id": f"p{i}", "prompt": t, "answer": first[i] if i % 2 == 0 else "no such answer"}
            for i, t in enumerate(TEXTS)]
    generate_batch.run(_args(tmp_path, _prompt_file(tmp_path, rows), num_samples=2, pass_at="1,2"))
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in out] == [(f"p{i}", s) for i in range(5) for s in range(2)]
    for r in out:
        i = int(r["id"][1:])
        want = alone[i][len(tok.encode(TEXTS[i])) + 1:].tolist()
        cut = want[:want.index(tok.eos_id)] if tok.eos_id in want else want
        assert r["tokens"] == cut and r["finish_reason"] == ("stop" if tok.eos_id in want else "length")
        assert r["correct"] == (i % 2 == 0)
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["pass@1"] == summary["pass@2"] == pytest.approx(3 / 5) and summary["prompts"] == 5


@pytest.mark.slow  # three whole generation jobs
def test_samples_do_not_depend_on_the_batching_and_stop_at_a_stop_token(served, tmp_path, monkeypatch):
    """Temperature 1 with top-p: one sample at a time or eight together draw the same tokens (each row's own
    key). A stop token ends its sample there ("stop", the token left out) while the others run on. Caught: one
    key shared by the batch's rows (the draws then depend on the row a sample lands in)."""
    monkeypatch.setattr(inference, "load", lambda *a, **k: served)
    rows = [{"prompt": t} for t in TEXTS[:3]]
    runs = []
    for batch_size in (1, 8):
        args = _args(tmp_path, _prompt_file(tmp_path, rows), num_samples=3, temperature=1.0, top_p=0.9,
                     batch_size=batch_size, output=str(tmp_path / f"b{batch_size}.jsonl"))
        generate_batch.run(args)
        runs.append([json.loads(line) for line in (tmp_path / f"b{batch_size}.jsonl").read_text().splitlines()])
    assert [r["tokens"] for r in runs[0]] == [r["tokens"] for r in runs[1]]
    assert len({tuple(r["tokens"]) for r in runs[0]}) > 3  # the samples differ
    tok = served.tokenizer
    stop = runs[0][0]["tokens"][2]
    generate_batch.run(_args(tmp_path, _prompt_file(tmp_path, rows), num_samples=3, temperature=1.0, top_p=0.9,
                             stop_tokens=tok.id_to_token(stop), output=str(tmp_path / "s.jsonl")))
    stopped = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    first = runs[0][0]["tokens"]
    assert stopped[0]["tokens"] == first[:first.index(stop)] and stopped[0]["finish_reason"] == "stop"
    for a, b in zip(runs[0], stopped):
        assert stop not in b["tokens"] and a["tokens"][:len(b["tokens"])] == b["tokens"]


@pytest.mark.parametrize("rows,values,message", [
    ([{"id": 1, "text": "x"}], {}, ":1: a prompt line needs exactly one of 'prompt'"),
    ([{"prompt": "a", "answer": 3}], {}, "'answer' is 3"),
    ([{"prompt": "a"}, {"prompt": "b", "id": 1}], {}, "the id 1 is used twice"),
    ([{"prompt": "a", "id": [1, 2]}], {}, ":1: 'id' is [1, 2], not a string or a number"),  # was TypeError: unhashable
    ([{"prompt": "a", "id": {"n": 1}}], {}, ":1: 'id' is {\"n\": 1}, not a string or a number"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}], {},
     "ends with an assistant turn"),
    ([{"prompt": "In the beginning God created the heaven and the earth"}], {"max_new_tokens": 30},
     "exceed model.max_seq_len=32"),
    ([{"prompt": "a"}], {"pass_at": "1,4", "num_samples": 2}, "--pass_at='1,4' needs each k in [1, --num_samples=2]"),
    ([{"prompt": "a"}], {"top_p": 0.0}, "--top_p=0.0 is not in (0, 1]"),
])
def test_bad_prompt_files_and_flags_are_refused_before_generating(rows, values, message, served, tmp_path,
                                                                   monkeypatch):
    """Each a ValueError (one line, exit 2 from the program) and no output written. Caught: the id check
    dropped (two prompts' samples then share an id)."""
    monkeypatch.setattr(inference, "load", lambda *a, **k: served)
    monkeypatch.setattr(generate.Generator, "generate", lambda *a, **k: pytest.fail("generated"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        generate_batch.run(_args(tmp_path, _prompt_file(tmp_path, rows), **values))
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("output,summary,destroyed", [
    ("{tmp}/prompts.jsonl", "", "--output={tmp}/prompts.jsonl names the same path as --prompts="),
    ("{tmp}/./prompts.jsonl", "", "names the same path as --prompts="),
    ("{tmp}/link.jsonl", "", "names the same path as --prompts="),  # a symbolic link to the prompt file
    ("{tmp}/out.jsonl", "{tmp}//prompts.jsonl", "--summary={tmp}//prompts.jsonl names the same path as --prompts="),
    ("{tmp}/bundle/export.json", "", "lies inside --export={tmp}/bundle"),
    ("{tmp}/out.jsonl", "{tmp}/bundle/sub/s.json", "--summary={tmp}/bundle/sub/s.json lies inside --export="),
    ("{tmp}/out.jsonl", "{tmp}/out.jsonl", "--summary={tmp}/out.jsonl names the same path as --output="),
])
def test_an_output_that_names_an_input_is_refused_before_anything_is_written(output, summary, destroyed, served,
                                                                            tmp_path, monkeypatch):
    """--output/--summary naming the prompt file (however spelled) or a file of the export bundle being read is
    refused in one line, every input byte for byte as it was. Bug it caught: the samples were written over the
    prompt set, and --output=BUNDLE/export.json destroyed the export."""
    monkeypatch.setattr(inference, "load", lambda *a, **k: served)
    prompts = _prompt_file(tmp_path, [{"prompt": "In the beginning"}])
    (tmp_path / "link.jsonl").symlink_to(prompts)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "export.json").write_text("{}")
    before = {p: p.read_bytes() for p in (prompts, bundle / "export.json")}
    values = dict(output=output.format(tmp=tmp_path), summary=summary.format(tmp=tmp_path), export=str(bundle))
    with pytest.raises(ValueError, match=re.escape(destroyed.format(tmp=tmp_path))):
        generate_batch.run(_args(tmp_path, prompts, **values))
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(os.listdir(bundle)) == ["export.json"] and not (tmp_path / "out.jsonl").exists()
