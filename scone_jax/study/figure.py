"""The figure of a quality study (tools/bench_quality.py, tools/plot_quality.py): test perplexity against
inference and training FLOPs per token, one curve per family of arms."""
from __future__ import annotations


FAMILY_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray",
                 "tab:olive")
SET_STYLES = ("-", "--", ":", "-.")


def plot(results: dict, path: str, variants: dict[str, dict] | None = None) -> bool:
    """Test perplexity against inference and training FLOPs, one curve per family of `results`' arms;
    each of `variants` (a label -> an arms dict, e.g. a study rerun with a --config.KEY=VALUE) in the same
    family colours with its own line style, its label in the legend. False where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sets = [("", results["arms"])] + list((variants or {}).items())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2 + 0.9 * len(sets)))
    for ax, x_key, label in ((axes[0], "inference_flops_per_token", "inference FLOPs per token"),
                             (axes[1], "train_flops", "training FLOPs (whole run)")):
        for (name, arms), style in zip(sets, SET_STYLES):
            _plot_families(ax, arms, x_key, f" ({name})" if name else "", style, annotate=ax is axes[1])
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("test perplexity")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7.5, frameon=False)
    fig.suptitle("Test perplexity after equal token budgets (tools/bench_quality.py)")
    fig.tight_layout(rect=(0, 0.05 + 0.05 * len(sets), 1, 1))
    fig.savefig(path, dpi=120)
    return True


def _plot_families(ax, arms: dict, x_key: str, suffix: str, style: str, annotate: bool) -> None:
    def budget(members):
        tokens = {arms[a]["tokens"] for a in members if a in arms}
        return f", {max(tokens) / 1e6:.0f}M tokens" if len(tokens) == 1 else ""

    # Curves join arms trained on the same budget only; with no _short arms the 1x arms stand in.
    ref = {f: f"{f}_short" if f"{f}_short" in arms else f for f in ("baseline", "scone")}
    families = {"baseline, depth 1x/2x": ["baseline", "baseline_2x"],
                "baseline, depth 1x/4x": [ref["baseline"], "baseline_4x"],
                "SCONE 1x": ["scone"],
                "SCONE, f-gram model 0.5x/1x/2x": ["scone_fgram0.5x", ref["scone"], "scone_fgram2x"],
                "SCONE, S 5k/20k/100k": ["scone_s5k", ref["scone"], "scone_s100k"],
                "SCONE, K 3/5": ["scone_k3", ref["scone"]],
                "Over-Encoding, m 20k/100k": ["oe", "oe_5x"],
                "Engram, 20k rows a head": ["engram"]}
    for (name, members), marker, color in zip(families.items(), "os*Dv^PX", FAMILY_COLORS):
        pts = sorted((arms[a][x_key], arms[a]["test_ppl"], a) for a in members if a in arms)
        if not pts or (len(members) > 1 and {p[2] for p in pts} <= set(ref.values())):
            continue  # nothing of this family, or only the 1x point another curve already draws
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=style, color=color,
                label=name + budget(members) + suffix)
        if annotate:
            for x, y, a in pts:
                ax.annotate(a, (x, y), fontsize=6.5, xytext=(3, 3), textcoords="offset points")
