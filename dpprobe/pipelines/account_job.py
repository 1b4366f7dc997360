"""The account job: epsilon from a noise multiplier, or the noise multiplier for an epsilon."""

from __future__ import annotations

import dataclasses

from dpprobe import accounting, checks
from dpprobe.accounting import records
from dpprobe.options import accountant_option, delta_option, integer, number, option
from dpprobe.pipelines.reporting import PRIVACY_EPILOG, warning_lines

__all__ = ["AccountConfig", "account", "account_line"]


# `dpprobe account`'s parser texts (help, description, epilog).
TEXTS = dict(
    help="epsilon from a noise multiplier, or the noise multiplier for an epsilon",
    description="Privacy accounting of T Gaussian steps (Poisson-sampled if q < 1).",
    epilog=PRIVACY_EPILOG.format(" unless --accountant rdp"),
)


@dataclasses.dataclass(frozen=True)
class AccountConfig:
    """T Gaussian steps (Poisson-sampled if `sampling_probability` < 1): give exactly one of
    `epsilon` (a target: calibrate the noise multiplier) and `noise_multiplier`."""

    delta: float = delta_option("delta")
    epsilon: float | None = option(None, type=number, exclusive="target", required=True,
                                   help="target epsilon: print sigma")
    noise_multiplier: float | None = option(
        None, "--noise-multiplier", "--sigma", type=number, exclusive="target",
        help="noise multiplier: print epsilon")
    steps: int = option(1, type=integer, help="number of steps T (default %(default)s)")
    sampling_probability: float = option(
        1.0, "--sampling-probability", "-q", type=number,
        help="Poisson sampling rate q (default 1: full batch)")
    accountant: str = accountant_option()
    num_examples: int | None = option(None, type=integer, metavar="N",
                                      help="the dataset size N (public): warns when delta >= 1/N")

    def __post_init__(self):
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of `epsilon` and `noise_multiplier`")
        if self.epsilon is not None:
            checks.freeze(self, epsilon=checks.check_epsilon("epsilon", self.epsilon))
        else:
            checks.freeze(self, noise_multiplier=checks.check_number(
                "noise_multiplier", self.noise_multiplier, 0, low_open=False))
        checks.freeze(self, delta=checks.check_delta("delta", self.delta),
                   steps=checks.check_int("steps", self.steps, 1, checks.MAX_STEPS),
                   sampling_probability=checks.check_number(
                       "sampling_probability", self.sampling_probability, 0, 1))
        checks.check_optional_ints(self, ("num_examples",))


def account(config: AccountConfig | None = None, /, **options) -> dict:
    """Epsilon from a noise multiplier, or the noise multiplier for a target epsilon: the
    answer with its `DpEvent`. Takes an `AccountConfig`, or its fields as keywords."""
    config = checks.make_config(AccountConfig, config, None, **options)
    noise_multiplier = config.noise_multiplier
    if config.epsilon is not None:
        noise_multiplier = accounting.calibrate_noise_multiplier(
            config.epsilon, config.delta, steps=config.steps,
            sampling_probability=config.sampling_probability, accountant=config.accountant,
        )
    accounting.calibration.check_tractable(noise_multiplier, config.sampling_probability,
                                           config.accountant)
    plan = accounting.DpPlan(noise_multiplier, config.steps, config.sampling_probability)
    return {
        "target_epsilon": config.epsilon,
        "epsilon": plan.epsilon(config.delta, config.accountant),
        "delta": config.delta,
        "noise_multiplier": noise_multiplier,
        "steps": config.steps,
        "sampling_probability": config.sampling_probability,
        "accountant": config.accountant,
        "neighboring_relation": accounting.NEIGHBORING_RELATION,
        "dp_event": accounting.event_to_dict(plan.dp_event()),
        "warnings": records.warnings(delta=config.delta, num_examples=config.num_examples),
    }


def account_line(result: dict) -> str:
    """What `dpprobe account` prints: the noise multiplier, the steps and the epsilon."""
    q = result["sampling_probability"]
    sampling = "full batch" if q == 1 else f"Poisson q={q:g}"
    return "\n".join([
        f"noise multiplier {result['noise_multiplier']:.6g}, {result['steps']} step(s), "
        f"{sampling} -> epsilon {result['epsilon']:.6g} at delta {result['delta']:g} "
        f"({result['accountant'].upper()}, zero-out neighbours)", *warning_lines(result)])


def add_output_options(p) -> None:
    """`--json`: how `dpprobe account` prints."""
    p.add_argument("--json", action="store_true", help="print JSON")
