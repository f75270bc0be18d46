"""Named training mixtures: data.mixture, component name -> {files, weight, order}, set in a config file or by
the command line's shorthand `--config.data.train_files='web=/d/web/*.jsonl@0.7;books=/d/books/*.jsonl.gz@0.3'`
(`parse`, called by config.resolve alone; the shorthand's order is the components' order).

Each component is a corpus of its own (the same data.source kind), with its own documents, process
shares and epochs (packing.Stream). Rows of data.seq_len tokens are dealt to the components by weight
with a fixed schedule (`Schedule`): in every period of PERIOD rows each component gets its share of
rows, rounded by largest remainder, in an order drawn from (data.shuffle_seed, period). A row is cut
from its component's stream where that component's previous row ended, so the k-th row of component c
is stream positions [k * T, (k + 1) * T) of c. The schedule is closed-form: the component and the
rank of any row follow from its number alone, so batch b stays a pure function of b (any worker
count, resume at any step), and each component contributes its weight's share of tokens to within
one row per PERIOD rows. Without a mixture, data.train_files is one plain glob list: no schedule at all.

F-gram extraction counts the mixture with the same weights (assets.ensure_vocab), and the tokenizer,
when trained, samples the components the same way.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

PERIOD = 4096
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    files: str  # comma-separated globs
    weight: float  # normalised: the components' weights sum to 1


def parse(train_files: str) -> dict | None:
    """The data.mixture group the shorthand `train_files` spells ({name: {files, weight, order}}, the weights as
    written), None for a plain glob list. ValueError naming the component and the fix for a component without
    files, a weight that is not a positive number or a name used twice. Only config.resolve calls it: the one
    place the shorthand is read."""
    parts = [p.strip() for p in train_files.split(";") if p.strip()]
    if not any("=" in p and "@" in p for p in parts):
        return None
    group: dict[str, dict] = {}
    for part in parts:
        name, eq, rest = part.partition("=")
        name = name.strip()
        files, at, weight_text = rest.rpartition("@")
        if not eq or not at or not _NAME.match(name):
            raise ValueError(f"data.train_files: {part!r} is not NAME=GLOBS@WEIGHT. Fix: write every component "
                             "that way, e.g. 'web=/d/web/*.jsonl@0.7;books=/d/books/*.jsonl.gz@0.3' (names: letters, "
                             "digits, _ . -), or give one plain glob list.")
        if name in group:
            raise ValueError(f"data.train_files: the component name {name!r} is used twice. Fix: give each its own name.")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = float("nan")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data.train_files: component {name!r} has weight {weight_text.strip()!r}, not a positive "
                             "number. Fix: e.g. @0.3 (weights are relative: they need not sum to 1).")
        if not files.strip(" ,"):
            raise ValueError(f"data.train_files: component {name!r} names no files. Fix: {name}=<globs>@{weight_text}.")
        group[name] = {"files": files.strip(), "weight": weight, "order": len(group)}
    return group


def check(group, where: str) -> dict:
    """`group` (data.mixture's value, a mapping) checked and in its plain form, {name: {files: str, weight: float,
    order: int}}; ValueError naming the component and the fix for an entry that is not files, weight and order,
    a bad name, files or weight, orders that are not 0, 1, ..., weights whose sum overflows, or a weight too small
    to get a row of every PERIOD. `where` names the key the group came from (data.train_files for the shorthand),
    so each is refused, before a run takes its workdir, in the words the user wrote."""
    plain = {}
    for name, entry in group.items():
        fields = dict(entry) if hasattr(entry, "keys") else None
        if fields is None or set(fields) != {"files", "weight", "order"}:
            raise ValueError(f"data.mixture: component {name!r} is {entry!r}, not files, weight and order. Fix: e.g. "
                             f"config.data.mixture = {{{name!r}: {{'files': '/d/{name}/*.jsonl', 'weight': 0.7, "
                             "'order': 0}, ...}, or the shorthand --config.data.train_files='NAME=GLOBS@WEIGHT;...'.")
        files, weight, order = fields["files"], fields["weight"], fields["order"]
        number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not isinstance(name, str) or not _NAME.match(name) or not isinstance(files, str) \
                or not files.strip(" ,") or not number or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data.mixture: component {name!r} has files {files!r} and weight {weight!r}. Fix: a name "
                             "(a string) of letters, digits, _ . -, comma-separated globs, and a positive weight "
                             "(weights are relative: they need not sum to 1).")
        plain[name] = {"files": files.strip(), "weight": float(weight), "order": order}
    orders = [entry["order"] for entry in plain.values()]
    if any(type(o) is not int for o in orders) or sorted(orders) != list(range(len(plain))):
        raise ValueError(f"data.mixture: the components' orders are {orders}, not 0, 1, ... once each. Fix: number "
                         "them 0, 1, ... in the order they are dealt (it is part of the data stream).")
    plain = dict(sorted(plain.items(), key=lambda item: item[1]["order"]))
    total = sum(entry["weight"] for entry in plain.values())
    if not math.isfinite(total):  # finite weights whose sum overflows: every share would be 0
        raise ValueError(f"{where}: the components' weights sum to {total}, not a finite number. Fix: scale "
                         "them down, e.g. @0.7 and @0.3 (weights are relative: only their ratios count).")
    for (name, entry), rows in zip(plain.items(), quotas([e["weight"] / total for e in plain.values()], PERIOD)):
        if rows == 0:
            raise ValueError(f"{where}: component {name!r} has {entry['weight'] / total:.3g} of the total weight, below "
                             f"1/{PERIOD}, so the schedule would deal it no rows. Fix: raise its weight to at least "
                             f"1/{PERIOD} of the total, or leave it out.")
    return plain


def components(data_cfg) -> list[Component] | None:
    """The components of `data_cfg`'s mixture (data.mixture, checked by config.resolve) in their order, weights
    normalised to sum to 1; None without a mixture (a data config without the key included)."""
    group = data_cfg.get("mixture") or {}
    if not group:
        return None
    entries = sorted(group.items(), key=lambda item: item[1]["order"])
    total = sum(entry["weight"] for _, entry in entries)
    return [Component(name, entry["files"], entry["weight"] / total) for name, entry in entries]


def all_files(data_cfg) -> str:
    """Every component's globs as one comma-separated list (data.train_files itself without a mixture)."""
    parts = components(data_cfg)
    return data_cfg.train_files if parts is None else ",".join(c.files for c in parts)


def component_config(data_cfg, component: Component):
    """A copy of `data_cfg` whose train_files are the component's globs alone (no mixture)."""
    cfg = data_cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.train_files = component.files
        if "mixture" in cfg:
            cfg.mixture = {}
    return cfg


def quotas(weights, total: int) -> np.ndarray:
    """`total` split by `weights` (summing to 1) into integers, by largest remainder (ties: first)."""
    exact = np.asarray(weights, np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts


class Schedule:
    """Which component each row belongs to, and its rank among that component's rows (module docstring)."""

    def __init__(self, weights, seed: int, period: int = PERIOD):
        self.period, self.seed = period, seed
        self.per_period = quotas(weights, period)
        if (self.per_period == 0).any():
            raise ValueError(f"data.train_files: a component's weight is below 1/{period} of the total, so it would get "
                             "no rows. Fix: raise its weight or leave it out.")
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _period(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(component of each row of period p, its rank within the period among its component's rows)."""
        if p not in self._cache:
            slots = np.repeat(np.arange(len(self.per_period)), self.per_period)
            owner = slots[np.random.default_rng([self.seed, 0x313C, p]).permutation(self.period)]
            rank = np.zeros(self.period, np.int64)
            for c in range(len(self.per_period)):
                mine = owner == c
                rank[mine] = np.arange(int(mine.sum()))
            if len(self._cache) > 4:
                self._cache.pop(min(self._cache))
            self._cache[p] = (owner, rank)
        return self._cache[p]

    def rows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(component, rank over all of that component's rows) of rows start .. start + count - 1."""
        index = np.arange(start, start + count, dtype=np.int64)
        components, ranks = np.empty(count, np.int64), np.empty(count, np.int64)
        for p in np.unique(index // self.period):
            here = index // self.period == p
            owner, rank = self._period(int(p))
            local = index[here] - p * self.period
            components[here] = owner[local]
            ranks[here] = rank[local] + p * self.per_period[owner[local]]
        return components, ranks
