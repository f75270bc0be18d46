"""docs/quality.md's opening table, the study's answer, from its records (study/records.py): each main arm at
the settings configs/quality.py defines today, per corpus, token budget and platform, against the baseline. One
line per arm, one column per corpus, budget and platform (table), so the page's opening stays short as arms and
corpora are added.

A row is one arm's runs whose effective settings (records.effective) are exactly what a run given no override
gets under today's defaults (records.DEFAULTS_VERSION), whatever version they were recorded under, at the
learning rate with the lowest validation perplexity (the mean over its seeds: the study's rule for every
family), trained for exactly the row's tokens. Its test perplexity is the mean over those seeds (each seed one
entry, records.by_seed), against the 2-block baseline's mean of the same corpus, tokens and platform. A corpus,
budget and platform without that baseline has no row: there is nothing to be against. Arms outside ARMS (the
ablations and the 1x arms of the ablation budget, which docs/quality.md's other tables hold) are left out.

The fine-tuning study (study/finetune.py) adds one column, its latest study at the rates its first seed's validation
chose (finetune_table.chosen): the plain fine-tune in the baseline's row, SCONE with the f-gram model grown from the
larger pretrained model in SCONE's, against the plain fine-tune. Its other arm (the f-gram model from scratch) is
in the fine-tuning section's own table.
"""
from __future__ import annotations

from scone_jax.study import finetune_table
from scone_jax.study.protocol import family
from scone_jax.study.records import DEFAULTS_VERSION, by_seed, effective

# The study's main arms (study.MAIN_ARMS: trained for --tokens), in the order of the table's rows. The 1x arms of
# its ablation budget (protocol.SHORT_ARMS) answer another question, what the hold-back does at 3M: tables.py's
# "holdback" table has them beside their baseline.
ARMS = ("baseline", "baseline_2x", "scone", "oe", "oe_5x", "engram")
BASELINES = ("baseline",)  # the 2-block baseline a row is against
# Where each family's extra input rows live when the model is served (the record field that sizes them).
PLACES = {"baseline": ("none", None), "oe": ("accelerator", "accelerator_bytes"),
          "engram": ("accelerator", "accelerator_bytes"),
          "scone": ("host RAM or disk", "host_table_bytes")}


def at_defaults(record: dict) -> bool:
    """Whether the run's effective settings are those of a run of its arm given no override today."""
    today = dict(record, overrides={}, defaults_version=DEFAULTS_VERSION)
    return effective(record) == effective(today)


def _mean(seeds: dict[int, dict], key: str) -> float:
    return sum(seeds[s][key] for s in sorted(seeds)) / len(seeds)


def rows(records: list[dict]) -> list[dict]:
    """The table's rows in order (corpus and platform as first recorded, larger budgets first, arms as in ARMS):
    arm, corpus, platform, tokens, learning_rate, seeds (how many), test_ppl (their mean), reference (the
    baseline the others are against), versus (percent against its mean), inference_flops_per_token, place,
    place_bytes (None where not recorded)."""
    groups: dict[tuple, dict[str, dict[float, dict]]] = {}
    for (arm, tokens, rate, _, platform, corpus), seeds in by_seed(records).items():
        if arm in ARMS and at_defaults(next(iter(seeds.values()))):
            groups.setdefault((corpus, platform, tokens), {}).setdefault(arm, {})[rate] = seeds
    first = {}
    for r in records:
        first.setdefault(r["corpus"], len(first))
        first.setdefault(("platform", r["platform"]), len(first))
    out = []
    for corpus, platform, tokens in sorted(groups, key=lambda g: (first[g[0]], first[("platform", g[1])], -g[2])):
        arms = groups[(corpus, platform, tokens)]
        chosen = {arm: min(rates.items(), key=lambda kv: (_mean(kv[1], "validation_ppl"), kv[0]))
                  for arm, rates in arms.items()}
        reference = next((a for a in BASELINES if a in chosen), None)
        if reference is None:
            continue
        base_ppl = _mean(chosen[reference][1], "test_ppl")
        out += [_row(arm, *chosen[arm], base_ppl, arm == reference) for arm in ARMS if arm in chosen]
    return out


def _row(arm: str, rate: float, seeds: dict[int, dict], base_ppl: float, reference: bool) -> dict:
    """One cell of the table (rows()' fields), from the seeds of `arm` at `rate`; corpus, platform and tokens are
    those of its records (one setting: every seed's are the same)."""
    ppl, last = _mean(seeds, "test_ppl"), seeds[max(seeds)]
    place, field = PLACES[family(arm)]
    return {"arm": arm, "corpus": last["corpus"], "platform": last["platform"], "tokens": last["tokens"],
            "learning_rate": rate, "seeds": len(seeds), "test_ppl": ppl, "reference": reference,
            "versus": 100 * (ppl / base_ppl - 1), "inference_flops_per_token": last["inference_flops_per_token"],
            "place": place, "place_bytes": last.get(field) if field else None}


# The fine-tuning arms in the rows of the models they are (module docstring), the reference first.
FINETUNE_ROWS = {"ft_plain": "baseline", "ft_scone_pretrained": "scone"}


def finetune_rows(records: list[dict]) -> list[dict]:
    """The fine-tuning column's cells (module docstring), as rows() gives its own (`finetune` True); none without a
    plain fine-tune in the latest study."""
    if not any(r["arm"] in FINETUNE_ROWS for r in records):
        return []
    best = finetune_table.chosen(finetune_table.latest(records))
    if "ft_plain" not in best:
        return []
    base_ppl = _mean(best["ft_plain"][1], "test_ppl")
    return [dict(_row(arm, *best[ft_arm], base_ppl, ft_arm == "ft_plain"), finetune=True)
            for ft_arm, arm in FINETUNE_ROWS.items() if ft_arm in best]


_WITH = {"accelerator": " with the decoder", "host RAM or disk": ""}  # what a recorded size counts


def _millions(tokens: int) -> str:
    return f"{tokens / 1e6:.1f}".removesuffix(".0") + "M"


def _column(r: dict) -> tuple:
    return r["corpus"], r["platform"], r["tokens"], r.get("finetune", False)


def _title(column: tuple) -> str:
    corpus, platform, tokens, finetune = column
    return (("fine-tune on " if finetune else "") + f"{corpus}, {_millions(tokens)}"
            + ("" if platform == "cpu" else f" ({platform})"))


def table(records: list[dict]) -> str:
    """rows() as markdown, one line per arm and one column per corpus, budget and platform (in rows()' order; the
    fine-tuning column last), so
    that an arm costs the page one line whatever the corpora: each cell its mean test perplexity, its percent
    against that column's baseline, its seeds and rate. Refused when no row has a baseline (the page would lose
    its answer silently)."""
    found = rows(records)
    if not found:
        raise ValueError("No corpus has a 2-block baseline run at today's defaults, so the answer table is empty. "
                         "Fix: append the baseline's runs to the records (tools/bench_quality.py does).")
    found += finetune_rows(records)
    columns = list(dict.fromkeys(_column(r) for r in found))
    lines = ["| arm | " + " | ".join(_title(c) for c in columns) + " | inference FLOPs per token | table lives in |",
             "|---|" + "---|" * len(columns) + "---|---|"]
    for arm in (a for a in ARMS if any(r["arm"] == a for r in found)):
        mine = {_column(r): r for r in found if r["arm"] == arm}
        cells = []
        for column in columns:
            r = mine.get(column)
            if r is None:
                cells.append("")
                continue
            versus = "" if r["reference"] else f", {r['versus']:+.1f}%"
            plural = "s" if r["seeds"] > 1 else ""
            cells.append(f"{r['test_ppl']:.2f}{versus} ({r['seeds']} seed{plural}, {r['learning_rate']:g})")
        first = mine[next(c for c in columns if c in mine)]
        bytes_ = first["place_bytes"]
        size = "" if bytes_ is None else f" ({bytes_ / 1e6:.1f} MB{_WITH[first['place']]})"
        flops = f"{first['inference_flops_per_token']:.3g}".replace("e+0", "e")
        lines.append(f"| `{arm}` | " + " | ".join(cells) + f" | {flops} | {first['place']}{size} |")
    return "\n".join(lines)
