"""Privacy accounting for dpprobe on Google's `dp-accounting`.

Every reported epsilon is computed from the `DpEvent` of what ran, for zero-out neighbours
(one record replaced by a null record; N public), with the PLD accountant by default (RDP for
comparison).
"""

from dpprobe.accounting.calibration import calibrate_noise_multiplier, calibrate_plan
from dpprobe.accounting.gaussian import gaussian_noise_multiplier, gdp_delta, gdp_epsilon, gdp_mu
from dpprobe.accounting.ledger import LedgerEntry, PrivacyLedger
from dpprobe.accounting.plan import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    NEIGHBORING_RELATION,
    NEIGHBORING_RELATION_TEXT,
    DpPlan,
    compute_epsilon,
    event_to_dict,
    gaussian_mu,
    make_accountant,
)
from dpprobe.accounting.validation import DEFAULT_DELTA

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_ACCOUNTANT",
    "DEFAULT_DELTA",
    "NEIGHBORING_RELATION",
    "NEIGHBORING_RELATION_TEXT",
    "DpPlan",
    "LedgerEntry",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "calibrate_plan",
    "compute_epsilon",
    "event_to_dict",
    "gaussian_mu",
    "gaussian_noise_multiplier",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "make_accountant",
]
