"""The quality study's records: experiments/quality/runs.jsonl, one JSON object per finished run, appended by
tools/bench_quality.py and read by tools/plot_quality.py (docs/quality.md's tables and figure).

A record names everything that tells a run apart, so no file name has to: its arm, every config setting it
made on top of configs/quality.py's arm (`overrides`, dotted key -> value, `train.seed` among them when
given), the seed, learning rate, token budget and steps, the commit, the corpus and a hash of its splits' bytes, and what
it measured (validation and test perplexity, test tokens, FLOPs, hit rate). The file is append-only: a rerun
of the same settings adds a line, and readers take the last one (`latest`), so nothing already recorded is
ever rewritten. `source` names the results file a record was migrated from (null for appended runs);
`platform` the device kind the run trained on ("cpu", "NVIDIA H200"): runs of one protocol on another platform
are other runs (their numerics differ), never seeds of the same table row.
"""
from __future__ import annotations

import hashlib
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(REPO, "experiments", "quality", "runs.jsonl")

# The fields of a record, in the order they are written (json.dumps keeps insertion order).
FIELDS = ("arm", "overrides", "seed", "learning_rate", "tokens", "steps", "validation_ppl", "test_ppl",
          "test_bits_per_byte", "test_tokens", "hit_rate", "inference_flops_per_token", "train_flops",
          "fgram_capacity", "train_seconds", "commit", "corpus", "splits_sha256", "source", "platform")
# Settings a run without SCONE never reads: left out of a baseline's overrides, so that a baseline of a study
# run with e.g. --override=scone.output_norm=false is the same baseline as any other.
SCONE_ONLY = ("scone.", "train.fgram_model_delay_steps")


def read(path: str = RECORDS) -> list[dict]:
    """Every record of `path`, in the order appended. A line that is not a record is refused naming it."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                missing = [k for k in FIELDS if k not in record]
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(f"{path}:{number} is not a JSON record ({e}). Fix: restore that line from "
                                 "git (the file is append-only).") from None
            if missing:
                raise ValueError(f"{path}:{number} lacks the fields {missing}. Fix: restore that line from git "
                                 "(the file is append-only).")
            out.append(record)
    return out


def append(record: dict, path: str = RECORDS) -> None:
    """Add `record` as the last line of `path` (created with its folder if missing); earlier lines are
    never rewritten. A last line cut short by a crash is ended first, so the new record stays a line."""
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise ValueError(f"A quality record lacks the fields {missing}; it has {sorted(record)}.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "ab") as f:
        if f.tell() and _last_byte(path) != b"\n":
            f.write(b"\n")
        f.write((json.dumps({k: record[k] for k in FIELDS}) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _last_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def overrides_of(config, settings: list[str]) -> dict:
    """The `KEY=VALUE` settings a run was given, as dotted key -> the value the run's config holds (typed:
    1 becomes 1.0 for a float key; train.seed=N stays one of them), SCONE's keys dropped for a run without it."""
    out = {}
    for item in settings:
        key = item.partition("=")[0].strip()
        if config.scone.enabled or not key.startswith(SCONE_ONLY):
            out[key] = _get(config, key)
    return dict(sorted(out.items()))


def _get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def splits_sha256(train_files: str, validation_files: str, test_files: str) -> str:
    """SHA-256 over the bytes of the three splits' files (each split's files sorted by path; names and
    places not hashed: a corpus moved unchanged keeps its hash)."""
    from scone_jax.data import mixture, sources

    digest = hashlib.sha256()
    for name, patterns in (("train", mixture.all_files(train_files)), ("validation", validation_files),
                           ("test", test_files)):
        digest.update(f"\0split {name}\0".encode())
        for path in sources.expand_files(patterns):
            digest.update(b"\0file\0")
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
    return digest.hexdigest()


def corpus_name(train_files: str) -> str:
    """The corpus's name: the folder of its first training file (/data/linux_doc/train.jsonl -> linux_doc)."""
    from scone_jax.data import mixture

    first = mixture.all_files(train_files).split(",")[0]
    return os.path.basename(os.path.dirname(os.path.abspath(first))) or first


def from_run(result: dict, config, settings: list[str], test_files: str) -> dict:
    """The record of a run tools/bench_quality.py finished: its results-file entry `result`, the run's
    `config` and the study's --override `settings`."""
    record = {k: result.get(k) for k in FIELDS}
    record.update(overrides=overrides_of(config, settings), seed=int(config.train.seed),
                  corpus=corpus_name(config.data.train_files),
                  splits_sha256=splits_sha256(config.data.train_files, config.data.eval_files, test_files),
                  source=None, platform=_device_kind())
    return record


def _device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


def settings(record: dict) -> tuple:
    """What makes runs seeds of one protocol: arm, token budget, learning rate, overrides but the seed, the
    platform and the corpus."""
    rest = tuple(sorted((k, v) for k, v in record["overrides"].items() if k != "train.seed"))
    return record["arm"], record["tokens"], float(record["learning_rate"]), rest, record["platform"], record["corpus"]


def latest(records: list[dict]) -> dict[tuple, dict[int, dict]]:
    """settings(...) -> seed -> the last record appended for them (a rerun supersedes, nothing is rewritten)."""
    out: dict[tuple, dict[int, dict]] = {}
    for record in records:
        out.setdefault(settings(record), {})[record["seed"]] = record
    return out


# --- docs/quality.md's tables and figure -------------------------------------------------------------------

DELAY40 = {"train.fgram_model_delay_steps": 40}
H200 = "NVIDIA H200"
# configs/quality.py's arms made GPT-2 128m (the paper's smallest main model) with an 8,000-piece tokenizer.
GPT2_128M = {"data.global_batch_size": 32, "data.seq_len": 1024, "data.vocab_size": 8000, "model.d_ff": 4096,
             "model.d_model": 1024, "model.dtype": "bfloat16", "model.embedding_multiplier": 32.0,
             "model.max_seq_len": 1024, "model.num_heads": 16, "model.num_layers": 6}
GPT2_128M_SCONE = {**GPT2_128M, "scone.input_multiplier": 32.0, "scone.num_fgrams": 100000,
                   "train.fgram_model_delay_steps": 10}
NONORM = {"scone.output_norm": False}
_MAIN, _D3M, _D10M = "", "f-gram updates delayed 40 steps, 3M", "f-gram updates delayed 40 steps, 10M"
FIGURE_SETS = (_MAIN, _D3M, _D10M)  # the figure's sets in the order of their line styles (solid, dashed, dotted)


def row(label: str, arm: str, budget: str, rate: float, overrides: dict | None = None, figure: str | None = None,
        platform: str = "cpu", corpus: str = "linux_doc"):
    """One line of a table: the runs of `arm` at `budget` ("10m": its tokens rounded to millions), peak
    learning rate `rate` and exactly `overrides` (the seed aside) on `platform` and `corpus`, one column per seed; `figure`:
    the set of the plot it joins ("" the main one, None none)."""
    return {"label": label, "arm": arm, "budget": budget, "rate": rate, "overrides": overrides or {},
            "figure": figure, "platform": platform, "corpus": corpus}


TABLES = {
    "10m": [
        row("`baseline` (2 blocks)", "baseline", "10m", 2e-3, figure=_MAIN),
        row("`baseline_2x` (4 blocks)", "baseline_2x", "10m", 2e-3, figure=_MAIN),
        row("`scone` (f-gram model 2 blocks, S = 20k, K = 5)", "scone", "10m", 2e-3, figure=_MAIN),
        row("`scone_s100k`", "scone_s100k", "10m", 2e-3),
        row("`scone_fgram2x` (4 blocks)", "scone_fgram2x", "10m", 2e-3),
        row("`scone`, f-gram updates delayed 40 steps", "scone", "10m", 2e-3, DELAY40, _D10M),
        row("`scone_fgram2x`, delayed 40 steps", "scone_fgram2x", "10m", 2e-3, DELAY40, _D10M),
        row("`scone_s100k`, delayed 40 steps", "scone_s100k", "10m", 2e-3, DELAY40, _D10M),
    ],
    "3m": [row(label, arm, "3m", 1e-3, figure=_MAIN) for label, arm in (
        ("`baseline_short` (2 blocks)", "baseline_short"), ("`baseline_4x` (8 blocks)", "baseline_4x"),
        ("`scone_short` (f-gram model 2 blocks, S = 20k, K = 5)", "scone_short"),
        ("`scone_fgram0.5x` (1 block)", "scone_fgram0.5x"), ("`scone_fgram2x` (4 blocks)", "scone_fgram2x"),
        ("`scone_s5k`", "scone_s5k"), ("`scone_s100k`", "scone_s100k"), ("`scone_k3`", "scone_k3"))] + [
        row(f"`{arm}`, delayed 40 steps", arm, "3m", 1e-3, DELAY40, _D3M)
        for arm in ("scone_short", "scone_fgram0.5x", "scone_fgram2x", "scone_s5k", "scone_s100k")] + [
        row(f"`scone_short`, delayed {d} steps", "scone_short", "3m", 1e-3, {"train.fgram_model_delay_steps": d})
        for d in (20, 80)],
    "sweep": [row(f"`{arm}` at {rate:.0e}".replace("e-0", "e-"), arm, "10m", rate) for arm, rates in (
        ("baseline", (5e-4, 1e-3, 2e-3, 4e-3)), ("scone", (1e-3, 2e-3, 4e-3)), ("baseline_2x", (1e-3, 2e-3)))
        for rate in rates],
    "h200_size": [row(label, arm, budget_, 2e-3, overrides, platform=H200, corpus=corpus) for label, arm, budget_, overrides, corpus in (
        ("`scone` (1x), delayed 40 steps", "scone", "10m", DELAY40, "linux_doc"),
        ("`scone_fgram2x`, delayed 40 steps", "scone_fgram2x", "10m", DELAY40, "linux_doc"),
        ("`scone` (1x), delayed 80 steps", "scone", "10m", {"train.fgram_model_delay_steps": 80}, "linux_doc"),
        ("`scone_fgram2x`, delayed 80 steps (20 per block)", "scone_fgram2x", "10m", {"train.fgram_model_delay_steps": 80},
         "linux_doc"),
        ("`scone_fgram0.5x`, delayed 20 steps (20 per block)", "scone_fgram0.5x", "10m",
         {"train.fgram_model_delay_steps": 20}, "linux_doc"),
        ("`scone_fgram2x`, delayed 40, f-gram learning rate x0.5", "scone_fgram2x", "10m",
         {**DELAY40, "scone.learning_rate_multiplier": 0.5}, "linux_doc"),
        ("`scone` (1x), gate instead of the delay", "scone", "10m", {"scone.gate": True}, "linux_doc"),
        ("`scone_fgram2x`, gate instead of the delay", "scone_fgram2x", "10m", {"scone.gate": True}, "linux_doc"),
        ("English only: `scone` (1x), delayed 40 steps", "scone", "8m", DELAY40, "linux_doc_en"),
        ("English only: `scone_fgram2x`, delayed 40 steps", "scone_fgram2x", "8m", DELAY40, "linux_doc_en"))],
    "h200_128m": [row(label, arm, "8m", rate, overrides, platform=H200) for label, arm, rate, overrides in (
        ("baseline 128m at 5e-4", "baseline", 5e-4, GPT2_128M),
        ("baseline 128m at 1e-3", "baseline", 1e-3, GPT2_128M),
        ("SCONE 128m, f-gram model 1x (6 blocks), delayed 40 steps, at 5e-4", "scone", 5e-4,
         {**GPT2_128M_SCONE, "scone.num_layers": 6, "train.fgram_model_delay_steps": 40}),
        ("SCONE 128m, f-gram model 1x (6 blocks), delayed 10 steps, at 1e-3", "scone", 1e-3,
         {**GPT2_128M_SCONE, "scone.num_layers": 6}),
        ("SCONE 128m, f-gram model 2x (12 blocks), delayed 10 steps, at 1e-3", "scone", 1e-3,
         {**GPT2_128M_SCONE, "scone.num_layers": 12}))],
    "collapse": [
        row("3M at 2e-3: `baseline_short`", "baseline_short", "3m", 2e-3),
        row("3M at 2e-3: `scone_short`", "scone_short", "3m", 2e-3),
        row("3M at 2e-3: `scone_short`, delayed 40 steps", "scone_short", "3m", 2e-3, DELAY40),
        row("3M at 2e-3: `scone_short` without the output norm", "scone_short", "3m", 2e-3, NONORM),
        row("3M at 2e-3: `scone_fgram2x` without the output norm", "scone_fgram2x", "3m", 2e-3, NONORM),
        row("3M at 1e-3: `scone_short` without the output norm", "scone_short", "3m", 1e-3, NONORM),
        row("10M at 2e-3: `scone` without the output norm", "scone", "10m", 2e-3, NONORM),
        row("3M at 5e-4: `scone_fgram2x`", "scone_fgram2x", "3m", 5e-4),
    ],
}


def budget(tokens: int) -> str:
    return f"{round(tokens / 1e6)}m"


def runs_of(spec: dict, records: list[dict]) -> dict[int, dict]:
    """seed -> the latest record of a table row's settings (none: {})."""
    key = (spec["arm"], spec["rate"], tuple(sorted(spec["overrides"].items())), spec["platform"], spec["corpus"])
    out = {}
    for (arm, tokens, rate, rest, platform, corpus), seeds in latest(records).items():
        if (arm, rate, rest, platform, corpus) == key and budget(tokens) == spec["budget"]:
            out.update(seeds)
    return out


def mean_run(seeds: dict[int, dict]) -> dict:
    """One record standing for a row's seeds: test and validation perplexity averaged over them."""
    runs = [seeds[s] for s in sorted(seeds)]
    mean = dict(runs[-1])
    mean["test_ppl"] = sum(r["test_ppl"] for r in runs) / len(runs)
    mean["validation_ppl"] = sum(r["validation_ppl"] for r in runs) / len(runs)
    return mean


def _flops(x: float) -> str:
    return f"{x:.3g}".replace("e+", "e")


def table(name: str, records: list[dict]) -> str:
    """TABLES[name] as markdown: test perplexity per seed (validation in brackets), the mean over seeds,
    training FLOPs and hit rate. A row without any record is refused: the table would silently lose it."""
    rows = [(spec, runs_of(spec, records)) for spec in TABLES[name]]
    empty = [spec["label"] for spec, seeds in rows if not seeds]
    if empty:
        raise ValueError(f"No record holds these rows of the table {name!r}: {empty}. Fix: append their runs to the "
                         "records (tools/bench_quality.py does) or drop the rows from quality_records.TABLES.")
    seeds = sorted({s for _, found in rows for s in found})
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | training FLOPs | hit rate |",
             "|---|" + "---|" * (len(seeds) + 3)]
    for spec, found in rows:
        cells = [f"{found[s]['test_ppl']:.2f} ({found[s]['validation_ppl']:.2f})" if s in found else ""
                 for s in seeds]
        mean = mean_run(found)
        hit = f"{mean['hit_rate']:.2f}" if mean["arm"].startswith("scone") else ""
        lines.append(f"| {spec['label']} | " + " | ".join(cells) + f" | {mean['test_ppl']:.2f} | "
                     f"{_flops(mean['train_flops'])} | {hit} |")
    return "\n".join(lines)


def every_run(records: list[dict]) -> str:
    """Every record's settings and figures, one line per seed, in the order appended."""
    lines = ["| arm | tokens | learning rate | overrides | seed | test (validation) | platform | commit | migrated from |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        given = ", ".join(f"{k}={v}" for k, v in r["overrides"].items() if k != "train.seed")
        source = os.path.basename(r["source"]) if r["source"] else ""
        lines.append(f"| `{r['arm']}` | {r['tokens'] / 1e6:.1f}M | {r['learning_rate']:g} | {given} | {r['seed']} "
                     f"| {r['test_ppl']:.2f} ({r['validation_ppl']:.2f}) | {r['platform']} | {r['commit']} | {source} |")
    return "\n".join(lines)


_MARKER = "<!-- records:"
_END = "<!-- /records -->"


def fill(markdown: str, records: list[dict]) -> str:
    """`markdown` with every `<!-- records:NAME -->...<!-- /records -->` block rebuilt from `records`
    (NAME: a key of TABLES, or `all` for every run); the text around the blocks is kept as written."""
    out, rest = [], markdown
    while _MARKER in rest:
        before, _, after = rest.partition(_MARKER)
        name, _, after = after.partition(" -->")
        if _END not in after:
            raise ValueError(f"The block '{_MARKER}{name} -->' has no '{_END}' after it. Fix: close it.")
        if name != "all" and name not in TABLES:
            raise ValueError(f"Unknown records table {name!r}; the tables are {sorted(TABLES)} and 'all'.")
        rest = after.partition(_END)[2]
        body = every_run(records) if name == "all" else table(name, records)
        out.append(f"{before}{_MARKER}{name} -->\n{body}\n{_END}")
    return "".join(out) + rest


def figure_sets(records: list[dict]) -> dict[str, dict[str, dict]]:
    """label -> arm -> the mean record of the table rows drawn in the figure ("" the main set)."""
    out: dict[str, dict[str, dict]] = {label: {} for label in FIGURE_SETS}
    for rows in TABLES.values():
        for spec in rows:
            found = runs_of(spec, records)
            if spec["figure"] is None or not found:
                continue
            arms = out[spec["figure"]]
            if spec["arm"] in arms:
                raise ValueError(f"Two rows of the figure's set {spec['figure']!r} are arm {spec['arm']!r}.")
            arms[spec["arm"]] = mean_run(found)
    return {label: arms for label, arms in out.items() if arms}
