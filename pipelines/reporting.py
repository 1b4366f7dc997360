"""Result files and tables: atomic JSON/CSV writes, mean +- std summaries, accuracy plots."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "accuracy_error_bars",
    "atomic_write_bytes",
    "atomic_write_text",
    "plot_accuracy",
    "format_epsilon",
    "format_table",
    "summarize_runs",
    "write_csv",
    "write_json",
]


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (temp file in the same directory, then rename)."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file in the same directory, then rename), with
    the permissions of a file the user creates (0666 minus the umask; mkstemp's are 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask, read without changing it (Linux), else by setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value)}")


def _finite(value):
    """JSON has no inf/nan: inf epsilon is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path, payload: dict) -> None:
    atomic_write_text(path, json.dumps(_finite(payload), indent=2, default=_json_default) + "\n")


def write_csv(path, rows: Sequence[dict], columns: Sequence[str]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k) for k in columns})
    atomic_write_text(path, buffer.getvalue())


def summarize_runs(runs: Sequence[dict], group_keys: Sequence[str], metrics: Sequence[str]):
    """Mean and std (over seeds) of `metrics` for runs grouped by `group_keys`, in order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[tuple(run[k] for k in group_keys)].append(run)
    summary = []
    for key, members in groups.items():
        row = dict(zip(group_keys, key, strict=True)) | {"num_seeds": len(members)}
        for metric in metrics:
            values = np.array([m[metric] for m in members if m.get(metric) is not None], float)
            row[f"{metric}_mean"] = float(values.mean()) if values.size else None
            row[f"{metric}_std"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
        for shared in ("noise_multiplier", "epsilon_spent"):
            if shared in members[0]:
                row[shared] = members[0][shared]
        summary.append(row)
    return summary


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        if value == 0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


def format_epsilon(value) -> str:
    """An epsilon for people: 'inf (no guarantee)' when infinite."""
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return "inf (no guarantee)"
    return f"{value:.4g}"


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A fixed-width text table; `columns` are (header, key) pairs; values pre-formatted ok."""
    cells = [[header for header, _ in columns]]
    for row in rows:
        cells.append([row[key] if isinstance(row.get(key), str) else _fmt(row.get(key))
                      for _, key in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def pm(mean: float | None, std: float | None, scale: float = 100.0, digits: int = 2) -> str:
    """'87.31 ± 0.12' (percent by default)."""
    if mean is None:
        return "-"
    return f"{mean * scale:.{digits}f} ± {(std or 0.0) * scale:.{digits}f}"


def plot_accuracy(summary: Sequence[dict], path, *, title: str = "") -> None:
    """PNG of test accuracy (mean ± std over seeds) vs epsilon, with the non-private line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in summary:
        groups[(row.get("steps"), row.get("learning_rate"))].append(row)
    ticks = set()
    for index, ((num_steps, lr), rows) in enumerate(groups.items()):
        color = f"C{index % 10}"
        label = f"T={num_steps}, lr={lr:g}"
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
                if r.get("epsilon_row") is not None:  # what this point (a mean) costs
                    ax.annotate(f"{r['epsilon_row']:.3g}", (r["epsilon"], mean), fontsize=7,
                                xytext=(3, -10), textcoords="offset points", color=color)
        for r in rows:
            if not math.isfinite(r["epsilon"]):
                ax.axhline(100 * r["test_accuracy_mean"], linestyle="--", color=color,
                           alpha=0.7, label=f"non-private ({label})")
    ax.set_xscale("log")
    ax.margins(x=0.1)  # room for the epsilon labels beside the last points
    if ticks:
        ax.set_xticks(sorted(ticks), [f"{t:g}" for t in sorted(ticks)])
        ax.minorticks_off()
    ax.set_xlabel("epsilon")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    # The Software tag lets a later run recognize (and replace) its own plot, and only that.
    fig.savefig(buffer, format="png", metadata={"Software": "dpprobe"})
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def accuracy_error_bars(means: Sequence[float], stds: Sequence[float]) -> np.ndarray:
    """Asymmetric (2, n) error bars of mean +- std, clipped to accuracies in [0, 100]."""
    means, stds = np.asarray(means, float), np.asarray(stds, float)
    return np.stack([np.minimum(stds, means), np.minimum(stds, 100.0 - means)])
