"""What the commands' tables, reports and --help texts share: fixed-width tables, mean +- std,
warnings, the privacy epilog. Each command's own table, report and texts are in its module."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["PRIVACY_EPILOG", "TRAINING_TEXTS", "format_table", "pm", "same_epsilon",
           "warning_lines"]


# The privacy epilog of the commands' --help ({}: what the accountant is).
PRIVACY_EPILOG = """\
Privacy: every epsilon is for zero-out neighbours (one record replaced by a null record; the
dataset size N is public), computed from the DpEvent of what ran, with the PLD accountant{}.
Noise and batch sampling always draw from OS entropy."""
# The parser settings the commands that train with an accountant share: `--seed` must not
# silently mean `--seeds` (no abbreviations), and the privacy epilog.
TRAINING_TEXTS = dict(allow_abbrev=False, epilog=PRIVACY_EPILOG.format(" unless --accountant rdp"))


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


def warning_lines(results: dict) -> list[str]:
    """The job's warnings (`records.warnings`), one line each, for the end of its report."""
    return [f"warning: {warning}" for warning in results.get("warnings") or ()]


def same_epsilon(asked: float, spent: float | None) -> bool:
    """Whether a run spent its target epsilon, as printed (4 significant digits).

    Args:
      asked: the target epsilon.
      spent: the epsilon it spent (None: not known).

    Returns:
      True when the two print alike (or `spent` is unknown, or `asked` infinite).
    """
    return spent is None or not math.isfinite(asked) or f"{asked:.4g}" == f"{spent:.4g}"
