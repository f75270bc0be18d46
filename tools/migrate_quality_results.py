"""One-off: docs/quality_results_*.json -> experiments/quality/runs.jsonl (issue 45, item 5). Run once from the
repository root; deleted in the next commit. The settings of each file are read from its name and
docs/quality.md's text, as of commit 341741f:

- the study's settings today (configs/quality.py: both inputs times sqrt(d)) carry no override;
- "the earlier configuration" (decoder input x sqrt(d), f-gram model reading the plain T): the SCONE runs of
  quality_results.json, _seed1, _3m_seed1, _3m_seed2, _s5k_10m(_seed1): scone.input_multiplier=1;
- "plain": the method's plain inputs, model.embedding_multiplier=1, scone.input_multiplier=1; "gain" adds
  scone.output_gain_init=0.02 (the learned gain), "untied" model.tie_embeddings=False;
- "nonorm": scone.output_norm=False; "delay": train.fgram_model_delay_steps=40, "delay20"/"delay80" 20/80;
- "seedN": train.seed=N; learning rates and budgets are the records' own fields.
"""
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality_records  # noqa: E402

EARLIER = {"scone.input_multiplier": 1.0}
PLAIN = {"model.embedding_multiplier": 1.0, "scone.input_multiplier": 1.0}
NONORM = {"scone.output_norm": False}


def delay(steps):
    return {"train.fgram_model_delay_steps": steps}


SETTINGS = {  # file suffix -> (overrides, seed)
    "": (EARLIER, 0), "_seed1": (EARLIER, 1), "_3m_seed1": (EARLIER, 1), "_3m_seed2": (EARLIER, 2),
    "_s5k_10m": (EARLIER, 0), "_s5k_10m_seed1": (EARLIER, 1),
    "_2x_lr1e-3": ({}, 0), "_10m_ablations": ({}, 0),
    "_10m_fgram_input": ({}, 0), "_10m_fgram_input_seed1": ({}, 1),
    "_3m_fgram_input": ({}, 0), "_3m_fgram_input_seed1": ({}, 1), "_3m_fgram_input_fgram2x_rates": ({}, 0),
    "_3m_lr2e-3": ({}, 0), "_3m_lr2e-3_delay": (delay(40), 0),
    "_3m_delay": (delay(40), 0), "_3m_delay_seed1": (delay(40), 1), "_3m_delay20": (delay(20), 0),
    "_3m_delay80": (delay(80), 0), "_10m_delay": (delay(40), 0), "_10m_delay_seed1": (delay(40), 1),
    "_3m_nonorm": (NONORM, 0), "_3m_nonorm_seed1": (NONORM, 1), "_3m_nonorm_lr1e-3": (NONORM, 0),
    "_3m_nonorm_lr1e-3_seed1": (NONORM, 1), "_10m_nonorm": (NONORM, 0), "_10m_nonorm_seed1": (NONORM, 1),
    "_plain": (PLAIN, 0), "_plain_seed1": (PLAIN, 1), "_plain_10m_ablations": (PLAIN, 0),
    "_plain_gain": ({**PLAIN, "scone.output_gain_init": 0.02}, 0),
    "_plain_untied_3m": ({**PLAIN, "model.tie_embeddings": False}, 0),
}


def record(path, run, overrides, seed):
    scone = run["arm"].startswith("scone")
    given = {k: v for k, v in overrides.items() if scone or not k.startswith(quality_records.SCONE_ONLY)}
    if seed:
        given["train.seed"] = seed
    out = {k: run.get(k) for k in quality_records.FIELDS}
    out.update(overrides=dict(sorted(given.items())), seed=seed, corpus="linux_doc", splits_sha256=None,
               source=path)
    return out


def main():
    order = subprocess.run(["git", "rev-list", "--reverse", "HEAD"], capture_output=True, text=True,
                           check=True).stdout.split()
    position = {c[:7]: i for i, c in enumerate(order)}
    paths = sorted(glob.glob("docs/quality_results*.json"))
    suffixes = {p[len("docs/quality_results"):-len(".json")] for p in paths}
    assert suffixes == set(SETTINGS), suffixes ^ set(SETTINGS)
    out, seen = [], {}
    for path in paths:
        results = json.load(open(path))
        overrides, seed = SETTINGS[path[len("docs/quality_results"):-len(".json")]]
        runs = list(results["runs"].values())
        assert all(a in runs for a in results["arms"].values()), path  # "arms" are copies of runs
        for run in runs:
            r = record(path, run, overrides, seed)
            same = {k: v for k, v in r.items() if k != "source"}
            key = json.dumps(same, sort_keys=True)
            if key in seen:  # the same run in several files: kept once, from the first file
                print(f"duplicate: {path} {run['arm']} = {seen[key]}")
                continue
            seen[key] = path
            out.append(r)
    out.sort(key=lambda r: (position[r["commit"]], r["source"], r["arm"], r["learning_rate"]))
    for r in out:
        quality_records.append(r, "experiments/quality/runs.jsonl")
    print(f"{len(out)} records from {len(paths)} files")


if __name__ == "__main__":
    main()
