"""The audit job: how much privacy the probe's mechanism at least lacks, measured with canaries.

`dpprobe audit STORE --epsilon E`: calibrate the noise for (E, delta) as `dpprobe probe` does,
train M probes with a canary and M with a null record in its place on R rows of the store's
train split (`probe.canaries`: the production trainer, clipper, noise and optimizer), score
each, and bound epsilon from below at the claim's delta (`dp.auditing`). The result is a
lower bound for this canary and this threat model (an adversary who crafts one training row and
sees the released weights), not a proof of privacy.
"""

from __future__ import annotations

import dataclasses

from dpprobe import checks, extract, files, plots, preflight, probe, timings
from dpprobe.accounting import records
from dpprobe.extract.read import sample_rows
from dpprobe.options import LOSSES, OPTIMIZERS, delta_option, integer, number, option
from dpprobe.pipelines.probe_config import store_option
from dpprobe.pipelines.reporting import warning_lines
from dpprobe.probe.audit import audit_probe

__all__ = ["AuditConfig", "audit_report", "run_audit"]

# Runs per side of one audit (each run's weights live in memory while its call trains).
MAX_RUNS = 1_000_000

NOTE = ("A lower bound for this canary and this threat model (an adversary who crafts one "
        "training row and sees the released weights): it can refute the claim, never prove it.")


# `dpprobe audit`'s parser texts (help, description, epilog).
TEXTS = dict(
    help="measure the privacy a probe's mechanism at least lacks, with canaries",
    description="Train probes with a crafted canary row and with a null record in its "
    "place (the production trainer and mechanism, noise calibrated for --epsilon), score "
    "each, and bound epsilon from below at --delta: the Gaussian-DP fit and the "
    "Clopper-Pearson bound, with the ratio to the claim. Exit status 1 when a lower bound "
    "exceeds the claim.",
    epilog="A lower bound for this canary and this threat model, not a proof of privacy. "
    "The claim is for zero-out neighbours (one record replaced by a null record; N public), "
    "computed with the PLD accountant; noise keys and the row sample draw from OS entropy.",
)


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """What `run_audit` does; `dpprobe audit --help` explains each option.

    Attributes:
      epsilon, delta: the claim audited: the noise is calibrated for them (PLD, zero-out
        neighbours), and every bound is at this delta.
      optimizer, steps, loss, clip_norm: the full-batch recipe audited.
      runs: models trained with the canary, and as many without it.
      rows: rows of the train split the models train on (drawn at random; all if fewer).
      confidence: of every lower bound.
      runs_per_call: runs per compiled call (speed and memory only; default: ~2.5e7 weights).
      out, plot: write the results JSON, and a PNG of the score histograms and trade-off curve.
    """

    store: str = store_option()
    epsilon: float = option(type=number, help="the claim audited: the noise is calibrated for "
                            "it, as `dpprobe probe` does")
    delta: float = delta_option("delta of the claim and the bounds")
    optimizer: str = option("sgd", choices=OPTIMIZERS, metavar="NAME",
                            help="%(choices)s: update rule audited (default %(default)s, which "
                            "releases the noisy gradient itself: the tightest audit)")
    steps: int = option(1, type=integer, help="full-batch steps T (default %(default)s)")
    runs: int = option(10_000, type=integer, help="probes trained with the canary, and as many "
                       "without (default %(default)s)")
    rows: int = option(1000, type=integer, help="rows of the train split drawn at random to "
                       "train on (default %(default)s)")
    loss: str = option("softmax", choices=LOSSES, metavar="LOSS",
                       help="%(choices)s (default %(default)s)")
    clip_norm: float = option(1.0, type=number,
                              help="per-example clip norm C (default %(default)s)")
    confidence: float = option(0.95, type=number,
                               help="confidence of every lower bound (default %(default)s)")
    runs_per_call: int | None = option(
        None, type=integer, help="runs per compiled call (speed and memory only)")
    out: str | None = option(None, help="write results JSON here")
    plot: str | None = option(
        None, help="write a PNG of the score histograms and trade-off curves here")
    quiet: bool = option(False, action="store_true", help="print only the report")

    def __post_init__(self):
        checks.freeze(
            self, store=str(self.store),
            epsilon=checks.check_epsilon("epsilon", self.epsilon, allow_inf=False),
            delta=checks.check_delta("delta", self.delta),
            clip_norm=checks.check_number("clip_norm", self.clip_norm, 0),
            confidence=checks.check_number("confidence", self.confidence, 0.5, 1, high_open=True),
        )
        checks.check_int("steps", self.steps, 1, checks.MAX_STEPS)
        checks.check_int("runs", self.runs, 2, MAX_RUNS)
        checks.check_int("rows", self.rows)
        checks.check_optional_ints(self, ("runs_per_call",))


def run_audit(config: AuditConfig | str, /, **options) -> dict:
    """Audit the probe's DP mechanism on a store: `run_audit(AuditConfig(...))`, or
    `run_audit(store, epsilon=..., ...)` with the config's fields as keywords.

    Returns:
      The results dict (also written to `out` as JSON when given); its "scores" (the two
      samples, NumPy) are returned only, not written.
    """
    config = checks.make_config(AuditConfig, config, "store", **options)
    preflight.check_output_paths(out=config.out, plot=config.plot)
    preflight.check_timings_file(config.out)
    stopwatch = timings.Stopwatch()
    quiet = config.quiet
    train_attrs = dict(extract.open_split(config.store, "train").attrs)
    test_attrs = extract.local_split_attrs(config.store, "test") or {}
    features, labels = sample_rows(config.store, config.rows)
    num_classes = records.declared_num_classes(train_attrs)
    spec = probe.ProbeSpec(num_classes=num_classes, loss=config.loss, optimizer=config.optimizer)
    audit = audit_probe(features, labels, spec, epsilon=config.epsilon, delta=config.delta,
                        steps=config.steps, clip_norm=config.clip_norm, runs=config.runs,
                        confidence=config.confidence, runs_per_call=config.runs_per_call,
                        quiet=quiet)

    # Record: the claim, the bounds, what the plot needs; the audit's own privacy.
    results = records.header("audit", config.store, train_attrs, test_attrs) | audit.record(
        spec, delta=config.delta, num_rows=len(features)) | {
        "note": NOTE,
        "warnings": records.warnings(train_attrs),  # features of a random-init backbone
    }
    if config.out:
        files.write_json(config.out, results)
    if config.plot:
        plots.plot_audit(results, config.plot)
    if config.out:  # the owner's, never published: how long depends on the rows
        timings.write_timings(config.out, "audit", stopwatch, quiet=quiet,
                              train_seconds=audit.train_seconds)
    results["scores"] = audit.scores
    return results


def audit_report(results: dict) -> str:
    """What `dpprobe audit` prints: the claim, the lower bounds with their confidence and
    ratios to the claim, the attack's statistics, the verdict and what it means."""
    claim, audit, bounds = results["claim"], results["audit"], results["bounds"]
    confidence = f"{100 * bounds['confidence']:g}%"
    tpr = ", ".join(f"{100 * v:.2f}% at FPR {100 * float(f):g}%"
                    for f, v in bounds["tpr_at_fpr"].items())
    lines = [
        f"audit: {audit['runs_per_side']} probes with the canary and {audit['runs_per_side']} "
        f"without ({audit['optimizer']}, T={claim['steps']}, {audit['num_rows']} rows + the "
        f"canary, full batch); {claim['neighboring_relation_text']}",
        f"claimed: epsilon = {claim['epsilon']:.4f} at delta = {claim['delta']:g} (PLD ledger), "
        f"i.e. mu = {claim['gdp_mu']:.4f} Gaussian DP (noise multiplier "
        f"{claim['noise_multiplier']:.4g})",
        f"lower bounds at {confidence} confidence, delta = {claim['delta']:g}:",
        f"  Gaussian-DP fit: mu >= {bounds['gdp_mu_lower']:.4f} (estimate "
        f"{bounds['gdp_mu_estimate']:.4f}, {bounds['gdp_mu_estimate_over_claim']:.3f} x the "
        f"claimed mu), epsilon >= {bounds['gdp_epsilon_lower']:.4f} "
        f"({100 * bounds['gdp_epsilon_lower_over_claim']:.1f}% of the claim)",
        f"  Clopper-Pearson: epsilon >= {bounds['cp_epsilon_lower']:.4f} "
        f"({100 * bounds['cp_epsilon_lower_over_claim']:.1f}% of the claim)",
        f"attack: AUROC {bounds['auroc']:.4f}; TPR {tpr}",
        ("CLAIM REFUTED: a lower bound exceeds the claimed privacy"
         if results["claim_refuted"] else "consistent with the claim: no lower bound exceeds it"),
        results["note"],
    ]
    return "\n".join(lines + warning_lines(results))
