"""docs/quality.md's "Fine-tuning" block (`<!-- records:finetune -->`), from the fine-tuning study's records alone
(tools/bench_finetune.py; study/finetune.py's arms): the arms at the learning rate their first seed's validation
chose, the sweep, the pretrained models, and one sentence that says whether the paper's direction holds and at
what cost. Rebuilt by tools/plot_quality.py with the page's other tables, and written by the driver for its own
WORKDIR.

The block shows the latest study: the records of the fine-tuning corpus, pretrained start (`pretrain`), token
budget and platform of the last fine-tuning record appended. A setting's seeds are records.by_seed's entries.
"""
from __future__ import annotations

import re
import statistics

from scone_jax.study.records import by_seed, distinct

ARMS = ("ft_plain", "ft_scone_pretrained", "ft_scone_scratch")
LABELS = {"ft_plain": "plain fine-tune (`ft_plain`)",
          "ft_scone_pretrained": "SCONE, f-gram model from the larger pretrained model (`ft_scone_pretrained`)",
          "ft_scone_scratch": "SCONE, the same f-gram model from scratch (`ft_scone_scratch`)"}
PRETRAIN_ARMS = ("pretrain_main", "pretrain_large")


def _study_key(record: dict) -> tuple:
    return record["corpus"], record.get("pretrain"), record["tokens"], record["platform"]


def latest(records: list[dict]) -> list[dict]:
    """The distinct fine-tuning records of the latest study (module docstring); ValueError when there are none."""
    ft = [r for r in distinct(records) if r["arm"] in ARMS]
    if not ft:
        raise ValueError("No fine-tuning record (arms ft_*) in the records. Fix: run tools/bench_finetune.py, or "
                         "drop the records:finetune block.")
    key = _study_key(ft[-1])
    return [r for r in ft if _study_key(r) == key]


def chosen(records: list[dict]) -> dict[str, tuple[float, dict[int, dict]]]:
    """arm -> (the rate its first seed's validation chose, seed -> entry at that rate)."""
    rates: dict[str, dict[float, dict[int, dict]]] = {}
    for setting, seeds in by_seed(records).items():
        if setting[2] in rates.get(setting[0], {}):
            raise ValueError(f"The fine-tuning records hold {setting[0]} at {setting[2]:g} under two settings: the "
                             "block compares one setting per arm. Fix: record a study of other settings with another "
                             "fine-tuning corpus name or token budget (--chat_dir, --tokens).")
        rates.setdefault(setting[0], {})[setting[2]] = seeds
    out = {}
    for arm in ARMS:
        if arm not in rates:
            continue
        first = min(s for seeds in rates[arm].values() for s in seeds)
        swept = {rate: seeds for rate, seeds in rates[arm].items() if first in seeds}
        rate = min(swept, key=lambda r: swept[r][first]["validation_ppl"])
        out[arm] = (rate, rates[arm][rate])
    return out


def _mean(seeds: dict[int, dict], key: str) -> float | None:
    values = [e[key] for e in seeds.values() if e.get(key) is not None]
    return statistics.fmean(values) if values else None


def _percent(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.1f}%"


def verdict(best: dict) -> str:
    """Whether SCONE with the pretrained f-gram model beats both other arms (means over seeds, and seed by seed),
    and its costs against the plain fine-tune."""
    if not all(arm in best for arm in ARMS):
        return "Not every arm has a record yet, so the paper's direction is not tested here."
    plain, pre, scratch = (best[a][1] for a in ARMS)
    p, a, s = (_mean(x, "test_ppl") for x in (pre, plain, scratch))
    holds = p < a and p < s
    common = sorted(set(pre) & set(plain) & set(scratch))
    wins = [sum(pre[k]["test_ppl"] < other[k]["test_ppl"] for k in common) for other in (plain, scratch)]
    text = (f"**The paper's direction {'holds' if holds else 'does not hold'} here**: SCONE with its f-gram model "
            f"grown from the larger pretrained model reaches {p:.2f} test perplexity on the assistant tokens, against "
            f"{a:.2f} for the plain fine-tune ({_percent(p, a)}) and {s:.2f} for the same f-gram model trained from "
            f"scratch ({_percent(p, s)}); seed by seed it is ahead of the plain fine-tune on {wins[0]} of "
            f"{len(common)} and of the one from scratch on {wins[1]} of {len(common)}.")
    flops, speed = ([_mean(x, key) for x in (pre, plain)] for key in ("train_flops", "train_tokens_per_s"))
    cost = f" Cost: {flops[0] / flops[1]:.2f}x the plain fine-tune's training FLOPs"
    if speed[0] and speed[1]:
        cost += f" ({speed[0]:,.0f} training tokens/s against {speed[1]:,.0f} here)"
    ms, ms_plain = _mean(pre, "decode_ms_per_token"), _mean(pre, "decode_ms_per_token_plain")
    if ms is not None and ms_plain is not None:
        cost += (f"; decoding {ms:.2f} ms per token against {ms_plain:.2f} for the plain export timed alongside "
                 f"({_percent(ms, ms_plain)})")
    table = _mean(pre, "host_table_bytes")
    if table is not None:
        cost += f"; an f-gram table of {table / 1e6:.1f} MB in host RAM (nothing more on the accelerator)"
    return text + cost + "."


def _flops(seeds: dict[int, dict]) -> str:
    """Training FLOPs (the model formula: the same on any machine) and the median training tokens/s measured (on
    a shared machine, the load's as much as the model's; a resumed run's too, where its minutes are not)."""
    speed = _mean(seeds, "train_tokens_per_s")
    return f"{_mean(seeds, 'train_flops'):.3g}".replace("e+", "e") + (f" ({speed:,.0f})" if speed else "")


def _cell(entry: dict | None) -> str:
    return f"{entry['test_ppl']:.2f} ({entry['validation_ppl']:.2f})" if entry else ""


def section(records: list[dict]) -> str:
    """The block's markdown (module docstring)."""
    study = latest(records)
    best = chosen(study)
    seeds = sorted({s for _, found in best.values() for s in found})
    lines = ["| arm | learning rate | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | training FLOPs (tokens/s) "
             "| decode ms/token (plain alongside) | host table MB | hit rate |", "|---|---|" + "---|" * (len(seeds) + 5)]
    for arm in ARMS:
        if arm not in best:
            continue
        rate, found = best[arm]
        ms, ms_plain = _mean(found, "decode_ms_per_token"), _mean(found, "decode_ms_per_token_plain")
        decode = "" if ms is None else f"{ms:.2f}" + (f" ({ms_plain:.2f})" if ms_plain is not None else "")
        table = _mean(found, "host_table_bytes")
        hit = f"{_mean(found, 'hit_rate'):.2f}" if arm != "ft_plain" else ""
        lines.append(f"| {LABELS[arm]} | {rate:g} | " + " | ".join(_cell(found.get(s)) for s in seeds) +
                     f" | {_mean(found, 'test_ppl'):.2f} | {_flops(found)} | {decode} | "
                     f"{'' if table is None else f'{table / 1e6:.1f}'} | {hit} |")
    sweep = ["| arm | learning rate | seed | validation ppl | test ppl |", "|---|---|---|---|---|"]
    for (arm, _, rate, _, _, _), found in sorted(by_seed(study).items(), key=lambda x: (ARMS.index(x[0][0]), x[0][2])):
        for seed, entry in sorted(found.items()):
            sweep.append(f"| `{arm}` | {rate:g} | {seed} | {entry['validation_ppl']:.2f} | {entry['test_ppl']:.2f} |")
    first = study[-1]
    header = (f"Fine-tuning corpus `{first['corpus']}`, {first['tokens'] / 1e6:.2f}M tokens per run, "
              f"{first['platform']}; started from: {first.get('pretrain') or 'not recorded'}. Test (validation) "
              "perplexity on the assistant tokens, through the serving path.")
    pretrained = _pretrained(records, first.get("pretrain"))
    return "\n\n".join(filter(None, [header, "\n".join(lines), verdict(best), "Every fine-tuning run:", "\n".join(sweep),
                                     pretrained]))


def _pretrained(records: list[dict], started_from: str | None) -> str:
    """The latest pretraining record of each pretrained model the study started from (the corpus and token count its
    fine-tunes' `pretrain` field opens with, tools/bench_finetune.py's describe(): "gcide, 2,007,040 tokens; ..."):
    its test perplexity on the pretraining corpus. None for a study started from runs the tool did not pretrain."""
    found = re.match(r"(.+?), ([\d,]+) tokens;", started_from or "")
    if not found:
        return ""
    corpus, tokens = found.group(1), int(found.group(2).replace(",", ""))
    last = {r["arm"]: r for r in distinct(records)
            if r["arm"] in PRETRAIN_ARMS and (r["corpus"], r["tokens"]) == (corpus, tokens)}
    if not last:
        return ""
    rows = ["| pretrained model | corpus | tokens | test ppl (validation) | training FLOPs (tokens/s) |",
            "|---|---|---|---|---|"]
    for arm in PRETRAIN_ARMS:
        if arm in last:
            r = last[arm]
            rows.append(f"| `{arm}` | {r['corpus']} | {r['tokens'] / 1e6:.2f}M | {r['test_ppl']:.2f} "
                        f"({r['validation_ppl']:.2f}) | {_flops({0: r})} |")
    return "The pretrained models (test perplexity on the pretraining corpus's test split):\n\n" + "\n".join(rows)
