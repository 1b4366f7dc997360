"""The PNG plots of the jobs: accuracy vs epsilon (probe, demo) and the audit's score histograms
and trade-off curves. Each plot is written atomically and tagged as dpprobe's, so that a later
run recognizes (and replaces) its own plot, and only that (`dpprobe.preflight`)."""

from __future__ import annotations

import dataclasses
import io
import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from dpprobe.files import atomic_write_bytes
from dpprobe.messages import format_epsilon

__all__ = ["Reference", "accuracy_error_bars", "accuracy_figure", "plot_accuracy", "plot_audit",
           "plot_title"]


@dataclasses.dataclass(frozen=True)
class Reference:
    """One labelled point on the accuracy plot (a published number, a tuned run)."""

    epsilon: float
    accuracy: float  # percent
    label: str
    marker: str = "*"
    color: str = "k"
    filled: bool = True  # hollow markers show what lies under them


def plot_accuracy(summary: Sequence[dict], path, *, title: str = "",
                  references: Sequence[Reference] = (), warnings: Sequence[str] = ()) -> None:
    """PNG of test accuracy (mean ± std over seeds) vs epsilon (log axis), with the
    non-private line, `references` as single labelled points, and `warnings` (e.g. features
    of a randomly initialized backbone) printed in red across the plot."""
    fig = accuracy_figure(summary, title=title, references=references, warnings=warnings)
    _save_png(fig, path, warnings)


def accuracy_figure(summary: Sequence[dict], *, title: str = "",
                    references: Sequence[Reference] = (), warnings: Sequence[str] = ()):
    """The matplotlib figure of `plot_accuracy` (same arguments, but the path)."""
    import matplotlib  # heavy: imported when a plot is drawn, not at the CLI's start

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy, as above

    fig, ax = plt.subplots(figsize=(7.2, 4.8), dpi=120)
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in summary:  # a series: one recipe over epsilon (its own "series" label, or T, lr)
        groups[row.get("series") or f"T={row.get('steps')}, lr={row.get('learning_rate'):g}"
               ].append(row)
    ticks, non_private = set(), []
    for index, (label, rows) in enumerate(groups.items()):
        color = f"C{index % 10}"
        private = sorted((r for r in rows if math.isfinite(r["epsilon"])),
                         key=lambda r: r["epsilon"])
        if private:
            ticks.update(r["epsilon"] for r in private)
            means = [100 * r["test_accuracy_mean"] for r in private]
            stds = [100 * r["test_accuracy_std"] for r in private]
            ax.errorbar(
                [r["epsilon"] for r in private], means, yerr=accuracy_error_bars(means, stds),
                marker="o", capsize=3, label=label, color=color,
            )
            for r, mean in zip(private, means, strict=True):
                if r.get("epsilon_row") is not None and r.get("num_seeds", 2) > 1:
                    # what this point (a mean over seeds) costs
                    ax.annotate(f"{r['epsilon_row']:.3g}", (r["epsilon"], mean), fontsize=7,
                                xytext=(3, -10), textcoords="offset points", color=color)
        for r in rows:
            if not math.isfinite(r["epsilon"]):
                level = 100 * r["test_accuracy_mean"]
                non_private.append(level)
                ax.axhline(level, linestyle="--", linewidth=1.6, color=color, zorder=2.5,
                           label=f"non-private ({label})")
                ax.annotate(f"non-private {level:.2f}%", (0.01, level), color=color,
                            xycoords=("axes fraction", "data"), xytext=(0, 3), fontsize=7,
                            textcoords="offset points", va="bottom")
    for reference in references:
        ticks.add(reference.epsilon)
        ax.plot([reference.epsilon], [reference.accuracy], linestyle="none",
                marker=reference.marker, markersize=11, color=reference.color,
                markerfacecolor=None if reference.filled else "none", markeredgewidth=1.5,
                label=reference.label, zorder=3 if reference.filled else 4)
    ax.set_xscale("log")
    ax.margins(x=0.1)  # room for the epsilon labels beside the last points
    if non_private:  # the line and its label inside the frame, not on its edge
        low, high = ax.get_ylim()
        pad = 0.08 * (max(high, *non_private) - min(low, *non_private) or 1.0)
        ax.set_ylim(min(low, min(non_private) - pad), max(high, max(non_private) + pad))
    if ticks:
        ax.set_xticks(sorted(ticks), [f"{t:g}" for t in sorted(ticks)])
        ax.minorticks_off()
    ax.set_xlabel("epsilon (log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    for offset, warning in enumerate(warnings):
        ax.text(0.01, 0.98 - 0.07 * offset, "WARNING: " + warning, transform=ax.transAxes,
                fontsize=7, color="red", va="top", wrap=True)
    return fig


def _save_png(fig, path, warnings: Sequence[str] = ()) -> None:
    """Write a matplotlib figure as PNG, atomically, and close it; `warnings` go into its
    metadata too (a "Warning" text chunk), for tools that read the file."""
    import matplotlib.pyplot as plt  # heavy, as above

    fig.tight_layout()
    buffer = io.BytesIO()
    # The Software tag lets a later run recognize (and replace) its own plot, and only that.
    metadata = {"Software": "dpprobe"} | ({"Warning": "; ".join(warnings)} if warnings else {})
    fig.savefig(buffer, format="png", metadata=metadata)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def accuracy_error_bars(means: Sequence[float], stds: Sequence[float]) -> np.ndarray:
    """Asymmetric (2, n) error bars of mean +- std, clipped to accuracies in [0, 100]."""
    means, stds = np.asarray(means, float), np.asarray(stds, float)
    return np.stack([np.minimum(stds, means), np.minimum(stds, 100.0 - means)])


def plot_title(results: dict) -> str:
    """The accuracy plot's title: data, backbone, optimizer, privacy, the composed epsilon."""
    backbone = results["provenance"]["train"].get("backbone", {}).get("name", "?")
    dataset = results["provenance"]["train"].get("dataset", {}).get("name", "?")
    seeds = max((row.get("num_seeds", 1) for row in results.get("summary", ())), default=1)
    return (f"{dataset} / {backbone}: {results['probe']['optimizer']}, "
            f"delta={results['privacy']['delta']:g} ({results['privacy']['accountant'].upper()}, "
            f"zero-out)\nx: epsilon per run" + ("; beside each point: its epsilon (seeds "
                                               "composed)" if seeds > 1 else "")
            + "\nall private points together: epsilon "
            f"{format_epsilon(results['ledger']['epsilon_by_role'].get('private', 0.0))}")


def plot_audit(results: dict, path) -> None:
    """PNG of an audit: the two score histograms with the tests' thresholds, and the empirical
    trade-off curve (FNR against FPR) beside the claimed Gaussian-DP curve and the one of the
    lower bound."""
    import matplotlib  # heavy, as above

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy import stats

    claim, bounds, histogram = results["claim"], results["bounds"], results["histogram"]
    fig, (scores_ax, tradeoff_ax) = plt.subplots(1, 2, figsize=(10.5, 4.2), dpi=120)
    edges = np.asarray(histogram["edges"])
    for side, color in (("out", "C0"), ("in", "C3")):
        scores_ax.stairs(histogram[side], edges, fill=True, alpha=0.45, color=color,
                         label=f"{side} (canary {'in' if side == 'in' else 'replaced by null'})")
    scores_ax.axvline(bounds["gdp_threshold"], color="k", linestyle="--", linewidth=1,
                      label="Gaussian-DP test threshold")
    scores_ax.axvline(bounds["cp_threshold"], color="k", linestyle=":", linewidth=1,
                      label="Clopper-Pearson test threshold")
    scores_ax.set_xlabel("score: -<w[d, :], u> / lr")
    scores_ax.set_ylabel("models")
    scores_ax.legend(fontsize=7)
    fpr = np.linspace(0.0, 1.0, 401)
    for mu, style, label in (
            (claim["gdp_mu"], "-",
             f"claimed: mu = {claim['gdp_mu']:.3f} (eps {claim['epsilon']:.3g})"),
            (bounds["gdp_mu_lower"], "--",
             f"lower bound: mu = {bounds['gdp_mu_lower']:.3f} (eps "
             f"{bounds['gdp_epsilon_lower']:.3g})")):
        tradeoff_ax.plot(fpr, stats.norm.cdf(stats.norm.isf(fpr) - mu), style, color="k",
                         linewidth=1, label=label)
    tradeoff = results["tradeoff"]
    tradeoff_ax.plot(tradeoff["fpr"], tradeoff["fnr"], color="C3", label="empirical")
    tradeoff_ax.set_xlabel("false positive rate (type I)")
    tradeoff_ax.set_ylabel("false negative rate (type II)")
    tradeoff_ax.set_xlim(0, 1)
    tradeoff_ax.set_ylim(0, 1)
    tradeoff_ax.set_aspect("equal")
    tradeoff_ax.legend(fontsize=7)
    audit = results["audit"]
    warnings = results.get("warnings") or []
    fig.suptitle("".join(f"WARNING: {w}\n" for w in warnings)
                 + f"audit: {audit['optimizer']}, T={claim['steps']}, {audit['runs_per_side']} "
                 f"runs per side, delta={claim['delta']:g} (PLD, zero-out); "
                 f"{100 * bounds['confidence']:g}% lower bounds", fontsize=9)
    _save_png(fig, path, warnings)


