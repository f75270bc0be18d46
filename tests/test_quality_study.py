"""tools/bench_quality.py as a study runs it: one study per WORKDIR, what a finished run leaves in the records
(scone_jax/study/records.py), and the checks before anything trains (scone_jax/study/checks.py). Its refusals
and a --quick run: tests/test_quality_tools.py."""
import os
import socket
import subprocess
import sys

import pytest

from scone_jax.study import records as quality_records
from tests.common import REPO, run_tool, xla_flags
from tests.test_quality_tools import corpus, quality_args  # noqa: F401 - corpus is a fixture


@pytest.mark.slow
def test_a_second_bench_quality_on_a_workdir_in_use_refuses_in_one_line(corpus, tmp_path):
    """Two studies started together on one WORKDIR: the one that finds the WORKDIR's lease taken (here held by
    this test, as the first study holds it) stops in one line, exit 2, naming the holder, before it trains or
    records anything. Before: the second study trained beside the first, appended a duplicate record and failed
    with a traceback on the run's lease. Caught: main without ownership.hold(root) (the study trained, rc 0)."""
    from scone_jax.runtime import ownership

    root, records = tmp_path / "study", tmp_path / "runs.jsonl"
    root.mkdir()
    owner = ownership.acquire(str(root))
    try:
        result = run_tool("tools/bench_quality.py", quality_args(corpus, root, "--quick", f"--records={records}"))
    finally:
        owner.release()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    [line] = [x for x in result.stderr.splitlines() if "error:" in x]
    assert line.startswith(f"bench_quality: error: --workdir={root} is in use by another run: host "
                           f"{socket.gethostname()}, process {os.getpid()}, started ")
    assert "Traceback" not in result.stderr and not records.exists()
    assert sorted(os.listdir(root)) == []  # no tokenizer, no run, and its lease released


@pytest.mark.slow
def test_a_full_study_appends_its_records_by_default_with_every_override_and_its_splits_hash(corpus, tmp_path):
    """A study without --quick and without --records appends each finished run to the records of the checkout it
    runs from (experiments/quality/runs.jsonl; here a copy of the package, so the repository's file is untouched),
    and the record keeps every --config override as the run's config holds it (LOOP keys too: the tables leave them
    out, the record does not) and hashes the bytes of the training, validation and test splits in that order.
    Caught: --records defaulting to '' (nothing recorded); overrides_of leaving LOOP keys out of the record;
    from_run hashing the test split as the validation split and the validation split as the test split."""
    import shutil

    checkout = tmp_path / "checkout"
    for name in ("scone_jax", "tools", "configs"):
        shutil.copytree(os.path.join(REPO, name), checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
    args = quality_args(corpus, tmp_path / "study", "--arms=baseline", "--learning_rates=1e-3", "--tokens=20k",
                        "--allow_epochs", "--config.data.seq_len=64", "--config.model.max_seq_len=64",
                        "--config.data.global_batch_size=8", "--config.data.vocab_size=512",
                        "--config.data.worker_count=0", "--config.train.keep_checkpoints=2", "--config.train.seed=3")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(checkout), "XLA_FLAGS": xla_flags()}
    result = subprocess.run([sys.executable, "tools/bench_quality.py", *args], cwd=checkout, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [record] = quality_records.read(str(checkout / "experiments" / "quality" / "runs.jsonl"))
    assert record["overrides"] == {"data.global_batch_size": 8, "data.seq_len": 64, "data.vocab_size": 512,
                                   "data.worker_count": 0, "model.max_seq_len": 64, "train.keep_checkpoints": 2,
                                   "train.seed": 3}
    assert record["seed"] == 3 and record["arm"] == "baseline" and record["steps"] == 40 == -(-20_000 // 512)
    assert quality_records.effective(record) == {k: v for k, v in record["overrides"].items()
                                                 if k not in ("data.worker_count", "train.keep_checkpoints",
                                                              "train.seed")}
    splits = [f"{corpus}/{name}.jsonl" for name in ("train", "validation", "test")]
    assert record["splits_sha256"] == quality_records.splits_sha256(*splits)
    assert record["splits_sha256"] != quality_records.splits_sha256(splits[0], splits[2], splits[1])


def _jsonl(path, texts):
    import json

    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_the_split_check_compares_every_pair_of_splits(tmp_path):
    """Training, validation and test must share no document: each of the three pairs alone is refused, naming it.
    Caught: check_splits comparing the training split with the others only (validation and test sharing a
    document passed, so a learning rate chosen on the test split went unnoticed)."""
    from scone_jax.config import load_config_file
    from scone_jax.study import checks
    from scone_jax.study.study import CONFIG

    docs = {name: [f"{name} document {i}, its own text" for i in range(3)] for name in ("train", "validation", "test")}
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        shared = {name: list(texts) for name, texts in docs.items()}
        shared[b][1] = shared[a][0]
        files = {name: _jsonl(tmp_path / f"{a}_{b}_{name}.jsonl", texts) for name, texts in shared.items()}
        config = load_config_file(f"{CONFIG}:baseline")
        with config.unlocked():
            config.data.update(dict(source="jsonl", train_files=files["train"], eval_files=files["validation"]))
        with pytest.raises(ValueError, match=f"^The {a} and {b} splits share 1 documents"):
            checks.check_splits(config, files["test"])
    clean = {name: _jsonl(tmp_path / f"clean_{name}.jsonl", texts) for name, texts in docs.items()}
    config = load_config_file(f"{CONFIG}:baseline")
    with config.unlocked():
        config.data.update(dict(source="jsonl", train_files=clean["train"], eval_files=clean["validation"]))
    checks.check_splits(config, clean["test"])


def test_every_finished_run_of_every_arm_is_compared_with_this_invocations_settings(tmp_path):
    """A finished run of any arm of this invocation trained with other settings is refused naming that run, also
    after a run whose folder is gone (results copied elsewhere) and after runs that match; runs of arms not asked
    for are not looked at. Caught: check_finished_runs returning at the first run without a config.json (the
    changed scone run after it was reused)."""
    import json

    from scone_jax.runtime import workdir as workdir_layout
    from scone_jax.study import checks
    from scone_jax.study.study import Study

    data = {"source": "jsonl", "train_files": "/d/train.jsonl", "eval_files": "/d/validation.jsonl",
            "document_unit": "line", "text_field": "text", "tokenizer_path": "/d/tokenizer.model"}
    study = Study(str(tmp_path), ["baseline", "scone", "scone_k3"], 100_000, 100_000, ["0.001"], data,
                  "/d/test.jsonl", False, {})
    for arm in ("baseline", "scone", "scone_k3", "baseline_2x"):
        study.results["runs"][f"{arm}/lr0.001"] = {"arm": arm, "fgram_capacity": 0}

    def trained(arm, **changes):
        config = study.config(arm if arm in study.arms else "baseline", "0.001").to_dict()
        for dotted, value in changes.items():
            section, key = dotted.split(".")
            config[section][key] = value
        path = os.path.join(study.run_dir(arm, "0.001"), workdir_layout.CONFIG)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(config, f)

    trained("scone")  # the same settings; baseline's folder is gone
    trained("baseline_2x", **{"model.d_model": 64})  # not an arm of this invocation
    checks.check_finished_runs(study, None)
    trained("scone_k3", **{"model.d_model": 64})
    with pytest.raises(ValueError, match=r"^scone_k3/lr0.001 in .* is finished but was trained with other settings "
                                         r"than this invocation's \(trained -> now: model.d_model: 64 -> 128\)"):
        checks.check_finished_runs(study, None)
