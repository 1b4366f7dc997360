"""The DP mechanism of a training run as data, and epsilon computed from its `DpEvent`.

Neighbouring relation: zero-out (dp_accounting's `NeighboringRelation.REPLACE_SPECIAL`): two
datasets are neighbours when one record of one is replaced by a null record, whose gradient is
zero, in the other. The dataset size N is public: the trainers divide by N (or by the expected
batch size qN), as Mehta et al. (2023) and Panda et al. (2023) do. Each example's clipped
gradient changes the noisy sum by at most `clip_norm`, the noise std is
`noise_multiplier * clip_norm`. dp_accounting gives these events the same curves under
add/remove-one, but dpprobe claims zero-out only: the jobs publish N.

dp_accounting is imported inside the functions that use it, so that `import accounting` (and
every `dpprobe` command, which imports it) does not load its accountants and SciPy.

References:
  Mehta et al. 2023, Towards Large Scale Transfer Learning for Differentially Private Image
    Classification: https://arxiv.org/abs/2205.02973
  Panda et al. 2023, A New Linear Scaling Rule for Private Adaptive Hyperparameter
    Optimization: https://arxiv.org/abs/2212.04486
  Kairouz et al. 2021, Practical and Private (Deep) Learning without Sampling or Shuffling
    (zero-out neighbours, Def. 1.1): https://arxiv.org/abs/2103.00039
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Literal, get_args

from dpprobe.accounting import _dp_event
from dpprobe.accounting.gaussian import gdp_epsilon
from dpprobe.accounting.validation import check_delta, check_steps

if TYPE_CHECKING:
    import dp_accounting

__all__ = ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "NEIGHBORING_RELATION",
           "NEIGHBORING_RELATION_TEXT", "Accountant", "DpPlan", "compute_epsilon",
           "event_epsilon", "event_to_dict", "gaussian_mu", "make_accountant"]

Accountant = Literal["pld", "rdp"]
ACCOUNTANTS: tuple[str, ...] = get_args(Accountant)
DEFAULT_ACCOUNTANT: Accountant = "pld"  # tight; RDP for comparison
NEIGHBORING_RELATION = "zero_out"
NEIGHBORING_RELATION_TEXT = "zero-out neighbours (one record replaced by a null record; N public)"


@dataclasses.dataclass(frozen=True)
class DpPlan:
    """Everything that determines the privacy of one noisy-gradient training run.

    Attributes:
      noise_multiplier: Gaussian noise std divided by `clip_norm`; 0 means non-private.
      steps: number of noisy gradient releases (optimizer steps).
      sampling_probability: Poisson sampling rate q of each step; 1 is full batch.
      clip_norm: per-example L2 clipping bound C (does not change epsilon, it sets the scale);
        `inf` (no clipping) only for non-private plans.

    Formal guarantee: `dp_event()` and its `epsilon` hold for zero-out neighbours when every
    example's contribution to each released sum is clipped to `clip_norm`, and with q < 1 each
    example enters each step independently with probability q.
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
        check_steps(self.steps)
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
        dpa = _dp_event.events()

        if not self.is_private:
            return dpa.NonPrivateDpEvent()
        event: dp_accounting.DpEvent = dpa.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_probability < 1.0:
            event = dpa.PoissonSampledDpEvent(self.sampling_probability, event)
        if self.steps > 1:
            event = dpa.SelfComposedDpEvent(event, int(self.steps))
        return event

    def epsilon(self, delta: float, accountant: Accountant = "pld") -> float:
        """Epsilon of `dp_event()` at `delta` (zero-out neighbours); cached per event."""
        return event_epsilon(self.dp_event(), delta, accountant)

    def to_dict(self) -> dict:
        return {
            "noise_multiplier": self.noise_multiplier,
            "steps": int(self.steps),
            "sampling_probability": self.sampling_probability,
            "clip_norm": self.clip_norm,
            "neighboring_relation": NEIGHBORING_RELATION,
        }


@functools.lru_cache(maxsize=1024)
def event_epsilon(event: dp_accounting.DpEvent, delta: float, accountant: Accountant) -> float:
    """`compute_epsilon`, cached (for hashable events: those of a `DpPlan`)."""
    return compute_epsilon(event, delta, accountant)


def make_accountant(accountant: Accountant = "pld", *,
                    pld_discretization: float | None = None) -> dp_accounting.PrivacyAccountant:
    """A fresh `dp_accounting` accountant for zero-out neighbours (`REPLACE_SPECIAL`); a PLD
    one at dp_accounting's default value discretization unless `pld_discretization` is given
    (only the calibration's coarse search does: reported epsilons use the default). The PLD
    one is dp_accounting's `PLDAccountant`, its Poisson-subsampled Gaussians built as it
    builds them, in one vectorized pass, bit for bit where that module's checks hold (else
    by dp_accounting's own path: `accounting.sampled_pld`)."""
    import dp_accounting as dpa

    from dpprobe.accounting.sampled_pld import SampledGaussianPLDAccountant

    relation = dpa.NeighboringRelation.REPLACE_SPECIAL
    if accountant == "pld":
        if pld_discretization is None:
            return SampledGaussianPLDAccountant(neighboring_relation=relation)
        return SampledGaussianPLDAccountant(neighboring_relation=relation,
                                            value_discretization_interval=pld_discretization)
    if accountant == "rdp":
        return dpa.rdp.RdpAccountant(neighboring_relation=relation)
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def gaussian_mu(event: dp_accounting.DpEvent) -> float | None:
    """mu of the Gaussian DP of an event made only of unsampled Gaussians, else None.

    Composing Gaussians with noise multipliers sigma_i, each count_i times, is exactly
    mu-GDP with mu = sqrt(sum_i count_i / sigma_i^2) (Dong, Roth & Su 2019; Panda et al. 2023,
    Prop. 2.1). A non-private Gaussian (sigma = 0) gives mu = inf.
    """
    dpa = _dp_event.events()

    if isinstance(event, dpa.NonPrivateDpEvent):
        return math.inf
    if isinstance(event, dpa.GaussianDpEvent):
        return math.inf if event.noise_multiplier == 0 else 1.0 / event.noise_multiplier
    if isinstance(event, dpa.NoOpDpEvent):
        return 0.0
    if isinstance(event, dpa.SelfComposedDpEvent):
        inner = gaussian_mu(event.event)
        return None if inner is None else math.sqrt(event.count) * inner
    if isinstance(event, dpa.ComposedDpEvent):
        parts = [gaussian_mu(e) for e in event.events]
        if any(p is None for p in parts):
            return None
        return math.sqrt(sum(p * p for p in parts))
    return None


def _contains_non_private(event) -> bool:
    dpa = _dp_event.events()

    if isinstance(event, dpa.NonPrivateDpEvent):
        return True
    if isinstance(event, dpa.ComposedDpEvent):
        return any(_contains_non_private(e) for e in event.events)
    if isinstance(event, dpa.SelfComposedDpEvent | dpa.PoissonSampledDpEvent):
        return _contains_non_private(event.event)
    return False


def compute_epsilon(
    event: dp_accounting.DpEvent, delta: float, accountant: Accountant = "pld"
) -> float:
    """Epsilon of `event` at `delta` with the PLD (tight, default) or RDP accountant.

    For events made only of unsampled (full-batch) Gaussians, the privacy loss distribution is
    exactly that of one Gaussian with mu = sqrt(sum T_i / sigma_i^2), and "pld" returns its
    epsilon in closed form (`gdp_epsilon`): the value dp_accounting's PLD accountant computes
    (it also merges self-composed Gaussians into one), without its discretization and
    without building a discretized PLD at all.
    """
    delta = check_delta(delta)
    if _contains_non_private(event):
        return math.inf  # without building the PLDs of the other parts
    if accountant == "pld":
        mu = gaussian_mu(event)
        if mu is not None:
            return gdp_epsilon(mu, delta)
    acc = make_accountant(accountant)
    if not acc.supports(event):
        raise ValueError(f"the {accountant} accountant does not support {event}")
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def event_to_dict(event: dp_accounting.DpEvent) -> dict:
    """A JSON-ready description of a `DpEvent`, with the event class names."""
    import attr

    base = _dp_event.events().DpEvent
    out: dict = {"type": type(event).__name__}
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        if isinstance(value, base):
            value = event_to_dict(value)
        elif isinstance(value, list | tuple):
            value = [event_to_dict(v) if isinstance(v, base) else v for v in value]
        out[field.name] = value
    return out
