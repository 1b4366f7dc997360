"""Checks of the public privacy parameters, written once: every job, plan and calibration uses
these, so that the same bad value gives the same message wherever it enters."""

from __future__ import annotations

import math

__all__ = ["DEFAULT_DELTA", "check_delta", "check_epsilon", "check_steps"]

# The delta every job defaults to (with N records, delta should be well below 1/N; each job
# warns when it is not, `accounting.records.warnings`).
DEFAULT_DELTA = 1e-5


def check_epsilon(epsilon: float, *, allow_inf: bool = True, allow_zero: bool = False) -> float:
    """`epsilon` if it is > 0 (>= 0 if `allow_zero`; inf, the non-private reference, only if
    `allow_inf`)."""
    epsilon = float(epsilon)
    low_ok = epsilon >= 0 if allow_zero else epsilon > 0
    if math.isnan(epsilon) or not low_ok or (math.isinf(epsilon) and not allow_inf):
        bound = ">= 0" if allow_zero else "> 0"
        suffix = " (or inf for non-private)" if allow_inf else " and finite"
        raise ValueError(f"epsilon must be {bound}{suffix}, got {epsilon}")
    return epsilon


def check_delta(delta: float) -> float:
    """`delta` if it is in (0, 1)."""
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return delta


def check_steps(steps: int) -> int:
    """`steps` if it is an integer >= 1."""
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps}")
    return int(steps)
