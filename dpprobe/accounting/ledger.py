"""A privacy ledger: every mechanism a job ran, composed into one guarantee.

Three compositions are reported side by side:
  * PLD (tight, the default): dp_accounting's PLD accountant on the `ComposedDpEvent` of every
    entry (in closed form when every entry is a full-batch Gaussian, see `compute_epsilon`);
  * basic composition: each entry's epsilon at delta / k, summed (k entries), so that the total
    delta is the ledger's delta; what Panda et al. (2023) report (eps_f + eps_0 + eps_1);
  * Gaussian DP (full-batch Gaussian entries only): mu = sqrt(sum_i T_i / sigma_i^2), exact
    (Panda et al. 2023, Prop. 2.1 / Cor. 2.2).

Disjoint parts (parallel composition). An entry may name the part of the data it touched
(`data=`), e.g. a validation part carved from train by a data-independent random partition.
Under zero-out neighbours a record lies in exactly one part, so it is affected only by the
entries on its part and those on all the data ("all"); the job's epsilon is the largest over
parts of the composition of those entries.

Reference: Panda et al. 2023, A New Linear Scaling Rule for Private Adaptive Hyperparameter
Optimization: https://arxiv.org/abs/2212.04486
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from dpprobe.accounting import _dp_event
from dpprobe.accounting.gaussian import gdp_epsilon
from dpprobe.accounting.plan import (
    NEIGHBORING_RELATION,
    NEIGHBORING_RELATION_TEXT,
    Accountant,
    DpPlan,
    compute_epsilon,
    event_epsilon,
    event_to_dict,
    gaussian_mu,
)
from dpprobe.accounting.validation import check_delta

__all__ = ["LedgerEntry", "PrivacyLedger"]


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One mechanism that ran on the private data."""

    name: str
    role: str  # e.g. "tuning" or "final"
    plan: DpPlan
    metadata: dict = dataclasses.field(default_factory=dict)
    data: str = "all"  # the part of the private data it touched (parallel composition)

    def dp_event(self):
        return self.plan.dp_event()


@dataclasses.dataclass
class PrivacyLedger:
    """Records the `DpPlan` of every run of a job and composes them.

    Formal guarantee: the composition (`epsilon`) bounds the job's privacy loss for zero-out
    neighbours when every entry ran on the private dataset, on all of it or on the disjoint
    part it names (`data`), with parts fixed independently of the data.
    """

    entries: list[LedgerEntry] = dataclasses.field(default_factory=list)

    def record(self, name: str, plan: DpPlan, *, role: str = "run", data: str = "all",
               **metadata: Any) -> None:
        """Add a mechanism that ran on `data` ("all", or the name of a disjoint part)."""
        self.entries.append(LedgerEntry(name, role, plan, dict(metadata), data))

    def __len__(self) -> int:
        return len(self.entries)

    def parts(self) -> list[str]:
        """The disjoint parts some entry ran on alone (empty: every entry saw all the data)."""
        return sorted({e.data for e in self.entries} - {"all"})

    def _touching(self, part: str | None, role: str | None = None) -> list[LedgerEntry]:
        return [e for e in self.entries if (role is None or e.role == role)
                and (part is None or e.data in ("all", part))]

    def composed_event(self, role: str | None = None, part: str | None = None):
        """The `ComposedDpEvent` of every entry (or of those with `role`, or touching `part`).

        k entries with the same plan enter as one `SelfComposedDpEvent` of count k: the same
        mechanism, which dp_accounting composes in one go instead of k.
        """
        dpa = _dp_event.events()
        counts = collections.Counter(e.plan for e in self._touching(part, role))
        return dpa.ComposedDpEvent([
            plan.dp_event() if count == 1 else dpa.SelfComposedDpEvent(plan.dp_event(), count)
            for plan, count in counts.items()
        ])

    def epsilon(self, delta: float, accountant: Accountant = "pld", role: str | None = None):
        """Epsilon of the job: the composition of the entries every record is affected by,
        maximized over the disjoint parts (tight with PLD)."""
        delta = check_delta(delta)
        if not self.entries:
            return 0.0
        epsilons = []
        for part in self.parts() or [None]:
            event = self.composed_event(role, part)
            # A composition of one event has that event's epsilon (dp_accounting composes it
            # with nothing; bit-equal): the value its calibration already computed
            # (`plan.event_epsilon`, cached), not a second PLD of the same mechanism (1-3 s).
            epsilons.append(event_epsilon(event.events[0], delta, accountant)
                            if len(event.events) == 1 else
                            compute_epsilon(event, delta, accountant))  # unhashable: a list
        return max(epsilons)

    def basic_composition(self, delta: float) -> tuple[float, float]:
        """(max over parts of sum_i epsilon_i(delta / k), delta): the naive sum over the k
        entries a record is affected by."""
        delta = check_delta(delta)
        if not self.entries:
            return 0.0, 0.0
        totals = []
        for part in self.parts() or [None]:
            touching = self._touching(part)
            share = delta / len(touching)
            totals.append(sum(e.plan.epsilon(share) for e in touching))
        return max(totals), delta

    def gdp_mu(self) -> float | None:
        """mu of the exact Gaussian-DP composition (the largest over parts), if every entry is
        full-batch Gaussian."""
        if not self.entries:
            return 0.0
        mus = [gaussian_mu(self.composed_event(part=part)) for part in self.parts() or [None]]
        return None if any(mu is None for mu in mus) else max(mus)

    def gdp_epsilon(self, delta: float) -> float | None:
        delta = check_delta(delta)
        mu = self.gdp_mu()
        return None if mu is None else gdp_epsilon(mu, delta)

    def to_dict(self, delta: float, accountant: Accountant = "pld") -> dict:
        """A JSON-ready record: entries with their events, and the three compositions."""
        basic, _ = self.basic_composition(delta)
        mu = self.gdp_mu()
        roles = sorted({e.role for e in self.entries})
        total = self.epsilon(delta, accountant)
        by_role = {role: total if len(roles) == 1 else self.epsilon(delta, accountant, role)
                   for role in roles}
        return {
            "neighboring_relation": NEIGHBORING_RELATION,
            "neighboring_relation_text": NEIGHBORING_RELATION_TEXT,
            "delta": delta,
            "accountant": accountant,
            "num_mechanisms": len(self.entries),
            "epsilon": total,
            "epsilon_by_role": by_role,
            "basic_composition_epsilon": basic,
            "gdp_mu": mu,
            "gdp_epsilon": None if mu is None else gdp_epsilon(mu, delta),
            "parts": self.parts() or ["all"],
            "entries": [
                {
                    "name": e.name,
                    "role": e.role,
                    "data": e.data,
                    **e.plan.to_dict(),
                    "epsilon_alone": e.plan.epsilon(delta, accountant),
                    "dp_event": event_to_dict(e.dp_event()),
                    **e.metadata,
                }
                for e in self.entries
            ],
        }

    def describe(self, delta: float, accountant: Accountant = "pld") -> str:
        """A few lines for the terminal."""
        record = self.to_dict(delta, accountant)
        lines = [
            f"privacy ledger: {record['num_mechanisms']} mechanisms, "
            f"{NEIGHBORING_RELATION_TEXT}, delta={delta:g}",
            f"  {accountant.upper()} composition (tight): epsilon = {_fmt(record['epsilon'])}",
        ]
        if record["gdp_mu"] is not None:
            lines.append(f"  Gaussian DP (exact): mu = {record['gdp_mu']:.6g}, "
                         f"epsilon = {_fmt(record['gdp_epsilon'])}")
        lines.append(f"  basic composition (sum of epsilon_i at delta/k): epsilon = "
                     f"{_fmt(record['basic_composition_epsilon'])}")
        for role, eps in record["epsilon_by_role"].items():
            lines.append(f"  {role} runs alone: epsilon = {_fmt(eps)}")
        return "\n".join(lines)


def _fmt(value) -> str:
    return "inf" if value is None or math.isinf(value) else f"{value:.4f}"
