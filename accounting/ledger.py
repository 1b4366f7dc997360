"""A privacy ledger: every mechanism a job ran, composed into one guarantee.

Three compositions are reported side by side:
  * PLD (tight, the default): dp_accounting's PLD accountant on the `ComposedDpEvent` of every
    entry (in closed form when every entry is a full-batch Gaussian, see `compute_epsilon`);
  * basic composition: each entry's epsilon at delta / k, summed (k entries), so that the total
    delta is the ledger's delta; what Panda et al. (2023) report (eps_f + eps_0 + eps_1);
  * Gaussian DP (full-batch Gaussian entries only): mu = sqrt(sum_i T_i / sigma_i^2), exact
    (Panda et al. 2023, Prop. 2.1 / Cor. 2.2).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from accounting.gaussian import gdp_epsilon
from accounting.plan import (
    NEIGHBORING_RELATION,
    Accountant,
    DpPlan,
    _events,
    compute_epsilon,
    event_to_dict,
    gaussian_mu,
)

__all__ = ["LedgerEntry", "PrivacyLedger"]


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One mechanism that ran on the private data."""

    name: str
    role: str  # e.g. "tuning" or "final"
    plan: DpPlan
    metadata: dict = dataclasses.field(default_factory=dict)

    def dp_event(self):
        return self.plan.dp_event()


@dataclasses.dataclass
class PrivacyLedger:
    """Records the `DpPlan` of every run of a job and composes them.

    Contract: every entry ran on the same private dataset (add/remove-one neighbours); entries
    that ran on disjoint data would compose more favourably, which this ledger does not claim.
    """

    entries: list[LedgerEntry] = dataclasses.field(default_factory=list)

    def record(self, name: str, plan: DpPlan, *, role: str = "run", **metadata: Any) -> None:
        """Add a mechanism that ran."""
        self.entries.append(LedgerEntry(name, role, plan, dict(metadata)))

    def __len__(self) -> int:
        return len(self.entries)

    def composed_event(self, role: str | None = None):
        """The `ComposedDpEvent` of every entry (or of the entries with `role`).

        k entries with the same plan enter as one `SelfComposedDpEvent` of count k: the same
        mechanism, which dp_accounting composes in one go instead of k.
        """
        dpa = _events()
        counts = collections.Counter(
            e.plan for e in self.entries if role is None or e.role == role
        )
        return dpa.ComposedDpEvent([
            plan.dp_event() if count == 1 else dpa.SelfComposedDpEvent(plan.dp_event(), count)
            for plan, count in counts.items()
        ])

    def epsilon(self, delta: float, accountant: Accountant = "pld", role: str | None = None):
        """Epsilon of the composition of every entry (tight with PLD)."""
        if not self.entries:
            return 0.0
        return compute_epsilon(self.composed_event(role), delta, accountant)

    def basic_composition(self, delta: float) -> tuple[float, float]:
        """(sum_i epsilon_i(delta / k), delta): the naive sum over the k entries."""
        if not self.entries:
            return 0.0, 0.0
        share = delta / len(self.entries)
        return sum(e.plan.epsilon(share) for e in self.entries), delta

    def gdp_mu(self) -> float | None:
        """mu of the exact Gaussian-DP composition, if every entry is full-batch Gaussian."""
        if not self.entries:
            return 0.0
        return gaussian_mu(self.composed_event())

    def gdp_epsilon(self, delta: float) -> float | None:
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
            "delta": delta,
            "accountant": accountant,
            "num_mechanisms": len(self.entries),
            "epsilon": total,
            "epsilon_by_role": by_role,
            "basic_composition_epsilon": basic,
            "gdp_mu": mu,
            "gdp_epsilon": None if mu is None else gdp_epsilon(mu, delta),
            "entries": [
                {
                    "name": e.name,
                    "role": e.role,
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
            f"privacy ledger: {record['num_mechanisms']} mechanisms on the same data, "
            f"add/remove-one neighbours, delta={delta:g}",
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
