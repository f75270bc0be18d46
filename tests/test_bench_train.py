"""tools/bench_train.py's Over-Encoding arms (--oe_m): timed beside the baseline and SCONE on the same tokens,
and a bad modulus refused in one line before anything is built. Throughput itself is the tool's figure, not a
test's: these check what it runs and prints."""
import re

import pytest

from tests.common import run_tool


@pytest.mark.parametrize("flags,message", [
    (["--oe_m=20k"], r"--oe_m=20k: '20k' is not a table modulus \(a positive integer\)\. Fix: e\.g\. "
                     r"--oe_m=20011,100003\.$"),
    (["--oe_m=1009", "--oe_n=1"], r"overencoding\.n=1 .*"),
])
def test_a_bad_over_encoding_arm_is_refused_in_one_line_before_a_run_is_built(flags, message):
    """Caught: int() on the text (a ValueError traceback's 'invalid literal for int()'), the arm's config not
    validated before the builds (n = 1 reached the model)."""
    result = run_tool("tools/bench_train.py", ["--quick", *flags], timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("bench_train: error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "RESULT" not in result.stdout


@pytest.mark.slow
def test_over_encoding_arms_are_timed_beside_the_baseline_on_their_own_hashed_batches():
    """--quick --oe_m=1009 on the tiny config cut to one block each and 4 rows a batch: the arm's line and RESULT
    figures, its FLOPs per step the baseline's plus its [d, d] projection's (more than the baseline's, less than
    SCONE's), and the dedup line naming the batch it measured. Caught: the arm built but left out of the
    alternating rounds (no line), an arm timed on the baseline's batches without n-gram ids (the step refused
    them), the dedup line's shard written as the tiny config's 16 x 128 whatever the batch."""
    # model.vocab_size 8192: the tiny config's padded 8064 has the factors 3 and 7, which some of the 8 tables'
    # moduli share whatever m (issue 64's coprimality check of every table refuses it).
    result = run_tool("tools/bench_train.py", ["--quick", "--oe_m=1009", "--config.model.vocab_size=8192",
                                               "--config.model.num_layers=1",
                                               "--config.scone.num_layers=1", "--config.data.global_batch_size=4",
                                               "--config.scone.fgram_capacity=256"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^dedup: .* = [\d.]+ at 4 x 128 tokens per shard, ", result.stdout, re.M), result.stdout
    gflops = {name: float(x) for name, x in re.findall(r"^(\S+)\s+step .* ([\d.]+) GFLOP/step", result.stdout, re.M)}
    assert set(gflops) == {"baseline", "scone", "oe_m1009"}, result.stdout
    assert gflops["baseline"] < gflops["oe_m1009"] < gflops["scone"]
    results = dict(re.findall(r"^RESULT (\S+) ([\d.]+)$", result.stdout, re.M))
    assert float(results["oe_m1009_train_tokens_per_s"]) > 0 and float(results["oe_m1009_step_time_ratio"]) > 0
