"""The DP mechanism of a training run as data, and epsilon computed from its `DpEvent`.

Neighbouring relation: add or remove one example (`NeighboringRelation.ADD_OR_REMOVE_ONE`).
For full-batch runs the gradient is divided by the dataset size, which is treated as public
(as in Mehta et al. 2023 and Panda et al. 2023); each example's clipped gradient changes the
noisy sum by at most `clip_norm`, the noise std is `noise_multiplier * clip_norm`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import attr
import dp_accounting
from dp_accounting import pld, rdp

__all__ = [
    "ACCOUNTANTS",
    "NEIGHBORING_RELATION",
    "DpPlan",
    "compute_epsilon",
    "event_to_dict",
    "make_accountant",
]

Accountant = Literal["pld", "rdp"]
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
NEIGHBORING_RELATION = "add_or_remove_one"
_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


@dataclasses.dataclass(frozen=True)
class DpPlan:
    """Everything that determines the privacy of one noisy-gradient training run.

    Attributes:
      noise_multiplier: Gaussian noise std divided by `clip_norm`; 0 means non-private.
      steps: number of noisy gradient releases (optimizer steps).
      sampling_probability: Poisson sampling rate q of each step; 1 is full batch.
      clip_norm: per-example L2 clipping bound C (does not change epsilon, it sets the scale);
        `inf` (no clipping) only for non-private plans.

    Contract: every example's contribution to each released sum is clipped to `clip_norm`,
    and with q < 1 each example enters each step independently with probability q.
    """

    noise_multiplier: float
    steps: int
    sampling_probability: float = 1.0
    clip_norm: float = 1.0

    def __post_init__(self):
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(
                f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier}"
            )
        if int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps}")
        if not 0.0 < self.sampling_probability <= 1.0:
            raise ValueError(
                f"sampling_probability must be in (0, 1], got {self.sampling_probability}"
            )
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}")
        if self.noise_multiplier > 0 and math.isinf(self.clip_norm):
            raise ValueError("a private plan (noise_multiplier > 0) needs a finite clip_norm")

    @property
    def is_private(self) -> bool:
        return self.noise_multiplier > 0

    def dp_event(self) -> dp_accounting.DpEvent:
        """The `DpEvent` of this run: a Gaussian, Poisson-sampled if q < 1, composed T times."""
        if not self.is_private:
            return dp_accounting.NonPrivateDpEvent()
        event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_probability < 1.0:
            event = dp_accounting.PoissonSampledDpEvent(self.sampling_probability, event)
        if self.steps > 1:
            event = dp_accounting.SelfComposedDpEvent(event, int(self.steps))
        return event

    def epsilon(self, delta: float, accountant: Accountant = "pld") -> float:
        """Epsilon of `dp_event()` at `delta` (add/remove-one neighbours)."""
        return compute_epsilon(self.dp_event(), delta, accountant)

    def to_dict(self) -> dict:
        return {
            "noise_multiplier": self.noise_multiplier,
            "steps": int(self.steps),
            "sampling_probability": self.sampling_probability,
            "clip_norm": self.clip_norm,
            "neighboring_relation": NEIGHBORING_RELATION,
        }


def make_accountant(accountant: Accountant = "pld") -> dp_accounting.PrivacyAccountant:
    """A fresh `dp_accounting` accountant for add/remove-one neighbours."""
    if accountant == "pld":
        return pld.PLDAccountant(neighboring_relation=_RELATION)
    if accountant == "rdp":
        return rdp.RdpAccountant(neighboring_relation=_RELATION)
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def compute_epsilon(
    event: dp_accounting.DpEvent, delta: float, accountant: Accountant = "pld"
) -> float:
    """Epsilon of `event` at `delta` with the PLD (tight, default) or RDP accountant."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    acc = make_accountant(accountant)
    if not acc.supports(event):
        raise ValueError(f"the {accountant} accountant does not support {event}")
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def event_to_dict(event: dp_accounting.DpEvent) -> dict:
    """A JSON-ready description of a `DpEvent`, with the event class names."""
    out: dict = {"type": type(event).__name__}
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        if isinstance(value, dp_accounting.DpEvent):
            value = event_to_dict(value)
        elif isinstance(value, list | tuple):
            value = [event_to_dict(v) if isinstance(v, dp_accounting.DpEvent) else v for v in value]
        out[field.name] = value
    return out
