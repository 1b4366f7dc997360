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
    "atomic_write_text",
    "format_table",
    "summarize_runs",
    "write_csv",
    "write_json",
]


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (temp file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
