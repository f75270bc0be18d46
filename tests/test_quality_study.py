"""tools/bench_quality.py as a study runs it: one study per WORKDIR, and what a finished run leaves in the records
(scone_jax/study/records.py). Its refusals and a --quick run: tests/test_quality_tools.py."""
import os
import socket
import subprocess
import sys

import pytest

from scone_jax.study import records as quality_records
from tests.common import REPO, run_tool
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
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(checkout), "XLA_FLAGS": ""}
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
