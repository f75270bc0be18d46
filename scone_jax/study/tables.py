"""docs/quality.md's tables and the sets of its figure, from the study's records (study/records.py): which
rows each table has (TABLES), and the `<!-- records:NAME -->` blocks of the page rebuilt from the records.

A row names a setting as its difference from the method's defaults (defaults version 1), and matches the
records whose effective settings (records.effective) are exactly that, whatever defaults they were run under,
trained for exactly the steps its budget gives (bench_quality's --tokens: steps rounded up to whole steps), so
runs of other budgets are other rows. Each seed is one entry (records.by_seed), never chosen by file order.
"""
from __future__ import annotations

import os

from scone_jax.study import answer, finetune_table
from scone_jax.config import delay_steps_for_fraction
from scone_jax.study.records import DEFAULTS, DEFAULTS_VERSION, by_seed, distinct, effective

DELAY40 = {"train.fgram_model_delay_steps": 40}
DELAY80 = {"train.fgram_model_delay_steps": 80}  # configs/quality.py's default from defaults_version 2
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
    learning rate `rate` and effective settings exactly `overrides` (the seed aside) on `platform` and `corpus`, one column per seed; `figure`:
    the set of the plot it joins ("" the main one, None none)."""
    return {"label": label, "arm": arm, "budget": budget, "rate": rate, "overrides": overrides or {},
            "figure": figure, "platform": platform, "corpus": corpus}


def budget_tokens(budget: str) -> int:
    """The tokens a row's budget names ("10m" -> 10,000,000; "8.5m", "500k" too): bench_quality's --tokens."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9}[budget[-1]]
    return round(float(budget[:-1]) * scale)


def budget_steps(budget: str, tokens_per_step: int = 8192) -> int:
    """The steps a budget trains: its tokens rounded up to whole steps (study.Study.config's train.num_steps;
    configs/quality.py's steps are 32 rows of 256 tokens)."""
    return -(-budget_tokens(budget) // tokens_per_step)


# The alternatives to the hold-back recorded so far (corpus, budget) -> keys of _holdback_rows' `tried`.
_ALTERNATIVES_RUN = {("gcide", "3m"): ("ramp", "rms", "add"), ("linux_doc", "3m"): ("rms",),
                     ("linux_doc", "10m"): ("ramp",)}


def _holdback_rows() -> list[dict]:
    """The hold-back at each budget on each corpus: the 1x SCONE arm without one, at the delays tried, and at
    today's default (records.DEFAULTS' share of the run: 24 steps at 3M, 80 at 10M); the alternatives to it
    without a hold-back (issue 65: X-gram's output ramp over as many steps, rows at the token rows' RMS, and the
    additive control); beside the 2-block baseline."""
    share, out = DEFAULTS[DEFAULTS_VERSION]["train.fgram_model_delay_fraction"], []
    for name, corpus, delays_3m, delays_10m in (("kernel docs", "linux_doc", (0, 12, 20, 24, 40, 80), (0, 40, 80)),
                                                ("GCIDE", "gcide", (0, 12, 24, 80), (0, 80))):
        for budget, rate, arm, delays in (("3m", 1e-3, "scone_short", delays_3m), ("10m", 2e-3, "scone", delays_10m)):
            steps = budget_steps(budget)
            for d in delays:
                words = (f"held back {d} steps, {100 * d / steps:.1f}% of the run" if d else
                         "no hold-back (the method)")
                if d == delay_steps_for_fraction(share, steps):
                    words += " (today's default)"
                out.append(row(f"{name} {budget.upper()}: `{arm}`, {words}", arm, budget, rate,
                               {"train.fgram_model_delay_steps": d} if d else {}, corpus=corpus))
            ramp = delay_steps_for_fraction(share, steps)  # the ramp as long as the default hold-back
            tried = {"ramp": (f"no hold-back, output ramp over {ramp} steps", {"scone.output_ramp_steps": ramp}),
                     "rms": ("no hold-back, rows at the token rows' RMS", {"scone.row_scale": "token_rms"}),
                     "add": ("no hold-back, f-gram row added to the token row", {"scone.combine": "add"})}
            for key in _ALTERNATIVES_RUN.get((corpus, budget), ()):
                words, overrides = tried[key]
                out.append(row(f"{name} {budget.upper()}: `{arm}`, {words}", arm, budget, rate, overrides,
                               corpus=corpus))
            base = arm.replace("scone", "baseline")
            out.append(row(f"{name} {budget.upper()}: `{base}` (reference)", base, budget, 2e-3, corpus=corpus))
    return out


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
        row("`oe` (Over-Encoding: n = 3, k = 4, m = 20,011)", "oe", "10m", 2e-3),
        row("`oe` at 4e-3", "oe", "10m", 4e-3),
        row("`oe` at 8e-3", "oe", "10m", 8e-3),
        row("`oe_5x` (m = 100,003) at 4e-3", "oe_5x", "10m", 4e-3),
    ],
    "10m_delay80": [row(label, arm, "10m", 2e-3, DELAY80) for label, arm in (
        ("`scone` (S = 20k, K = 5)", "scone"), ("`scone_s100k`", "scone_s100k"),
        ("`scone_s5k`", "scone_s5k"), ("`scone_k3` (K = 3)", "scone_k3"),
        ("`scone_fgram0.5x` (f-gram model 1 block)", "scone_fgram0.5x"),
        ("`scone_fgram2x` (f-gram model 4 blocks)", "scone_fgram2x"))],
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
        ("`scone` (1x), delayed 80 steps", "scone", "10m", DELAY80, "linux_doc"),
        ("`scone_fgram2x`, delayed 80 steps (20 per block)", "scone_fgram2x", "10m", DELAY80, "linux_doc"),
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
    "gcide": [row(label, arm, "10m", 2e-3, overrides, corpus="gcide") for label, arm, overrides in (
        ("`baseline` (2 blocks)", "baseline", {}), ("`baseline_2x` (4 blocks)", "baseline_2x", {}),
        ("`scone` (1x), delayed 80 steps", "scone", DELAY80),
        ("`oe` (Over-Encoding: n = 3, k = 4, m = 20,011)", "oe", {}),
        ("`oe_5x` (m = 100,003)", "oe_5x", {}))],
    "holdback": _holdback_rows(),
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


def trained_for(record: dict, budget: str) -> bool:
    """Whether the run trained the steps `budget` gives at its rows per step: the budget rounded up to whole
    steps (study.Study.config's train.num_steps), so 10M is 1,221 steps of 8,192 tokens, and a 9.6M or a 10.4M
    run is not a 10M run."""
    per_step, rest = divmod(record["tokens"], record["steps"])
    return rest == 0 and record["steps"] == budget_steps(budget, per_step)


def runs_of(spec: dict, records: list[dict]) -> dict[int, dict]:
    """seed -> the entry (records.seed_entry) of a table row's settings (none: {})."""
    key = (spec["arm"], spec["rate"], tuple(sorted(spec["overrides"].items())), spec["platform"], spec["corpus"])
    found = {}
    for (arm, tokens, rate, rest, platform, corpus), seeds in by_seed(
            [r for r in records if trained_for(r, spec["budget"])]).items():
        if (arm, rate, rest, platform, corpus) == key:
            found[tokens] = seeds
    if len(found) > 1:  # the same settings at two sizes of step: the configs' defaults changed under the records
        raise ValueError(f"The row {spec['label']!r} of budget {spec['budget']} matches runs of {sorted(found)} "
                         "tokens: one setting cannot have two step sizes. Fix: name the batch or sequence length "
                         "that tells them apart in the row's settings (scone_jax/study/tables.py).")
    return next(iter(found.values()), {})


def mean_run(seeds: dict[int, dict]) -> dict:
    """One record standing for a row's seeds: test and validation perplexity averaged over them."""
    runs = [seeds[s] for s in sorted(seeds)]
    mean = dict(runs[-1])
    mean["test_ppl"] = sum(r["test_ppl"] for r in runs) / len(runs)
    mean["validation_ppl"] = sum(r["validation_ppl"] for r in runs) / len(runs)
    return mean


def _flops(x: float) -> str:
    return f"{x:.3g}".replace("e+", "e")


def _cell(entry: dict) -> str:
    """A seed's test (validation) perplexity; the mean of its reruns says how many, e.g. '50.90 (44.11), 2 runs'."""
    runs = f", {entry['runs']} runs" if entry.get("runs", 1) > 1 else ""
    return f"{entry['test_ppl']:.2f} ({entry['validation_ppl']:.2f}){runs}"


def table(name: str, records: list[dict]) -> str:
    """TABLES[name] as markdown: test perplexity per seed (validation in brackets; a seed rerun with other
    figures: their mean, and how many), the mean over seeds, training FLOPs and hit rate. A row without any
    record is refused: the table would silently lose it."""
    rows = [(spec, runs_of(spec, records)) for spec in TABLES[name]]
    empty = [spec["label"] for spec, seeds in rows if not seeds]
    if empty:
        raise ValueError(f"No record holds these rows of the table {name!r}: {empty}. Fix: append their runs to the "
                         "records (tools/bench_quality.py does) or drop the rows from scone_jax/study/tables.py's TABLES.")
    seeds = sorted({s for _, found in rows for s in found})
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | training FLOPs | hit rate |",
             "|---|" + "---|" * (len(seeds) + 3)]
    for spec, found in rows:
        cells = [_cell(found[s]) if s in found else "" for s in seeds]
        mean = mean_run(found)
        hit = f"{mean['hit_rate']:.2f}" if mean["arm"].startswith("scone") else ""
        lines.append(f"| {spec['label']} | " + " | ".join(cells) + f" | {mean['test_ppl']:.2f} | "
                     f"{_flops(mean['train_flops'])} | {hit} |")
    return "\n".join(lines)


def every_run(records: list[dict]) -> str:
    """Every run's effective settings (beyond the method's defaults) and figures, one line per run, in the order
    appended; a record appended twice (the same setting, seed and figures) is one run, said once."""
    lines = ["| arm | corpus | tokens | learning rate | settings | seed | test (validation) | platform | commit | migrated from |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in distinct(records):
        given = ", ".join(f"{k}={v}" for k, v in effective(r).items())
        source = os.path.basename(r["source"]) if r["source"] else ""
        lines.append(f"| `{r['arm']}` | {r['corpus']} | {r['tokens'] / 1e6:.1f}M | {r['learning_rate']:g} | {given} | {r['seed']} "
                     f"| {r['test_ppl']:.2f} ({r['validation_ppl']:.2f}) | {r['platform']} | {r['commit']} | {source} |")
    return "\n".join(lines)


_MARKER = "<!-- records:"
_END = "<!-- /records -->"


def fill(markdown: str, records: list[dict]) -> str:
    """`markdown` with every `<!-- records:NAME -->...<!-- /records -->` block rebuilt from `records`
    (NAME: a key of TABLES, `answer` for the page's opening table (study/answer.py), `finetune` for the fine-tuning
    study's (study/finetune_table.py), or `all` for every run);
    the text around the blocks is kept as written."""
    out, rest = [], markdown
    while _MARKER in rest:
        before, _, after = rest.partition(_MARKER)
        name, _, after = after.partition(" -->")
        if _END not in after:
            raise ValueError(f"The block '{_MARKER}{name} -->' has no '{_END}' after it. Fix: close it.")
        if name not in ("all", "answer", "finetune") and name not in TABLES:
            raise ValueError(f"Unknown records table {name!r}; the tables are {sorted(TABLES)}, 'answer', 'finetune' "
                             "and 'all'.")
        rest = after.partition(_END)[2]
        special = {"all": every_run, "answer": answer.table, "finetune": finetune_table.section}
        body = special[name](records) if name in special else table(name, records)
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


def rebuild(records: list[dict], markdown_path: str, png_path: str) -> None:
    """Rebuild the records blocks of the page `markdown_path` and draw the figure to `png_path` ('' = skip
    either), printing what changed and every plotted arm's mean (tools/plot_quality.py)."""
    from scone_jax.study.figure import plot

    if markdown_path:
        with open(markdown_path) as f:
            text = f.read()
        filled = fill(text, records)
        with open(markdown_path + ".tmp", "w") as f:
            f.write(filled)
        os.replace(markdown_path + ".tmp", markdown_path)
        print(f"tables: {markdown_path}" + ("" if filled != text else " (unchanged)"))
    if png_path:
        sets = figure_sets(records)
        for label, arms in sets.items():
            for arm, r in sorted(arms.items()):
                print(f"{label or 'study'}: {arm} {r['tokens'] / 1e6:.0f}M lr {r['learning_rate']:g}: "
                      f"mean test {r['test_ppl']:.2f}")
        main_arms = sets.pop("", {})
        if not plot({"arms": main_arms}, png_path, sets):
            raise ValueError("plotting needs matplotlib. Fix: pip install -e '.[plot]'")
        print(f"plot: {png_path}")
