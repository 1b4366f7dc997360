"""The probe's privacy audit with canaries (`dpprobe audit`): M probes trained with a crafted
canary row and M with a null record in its place (`probe.canaries`: the production trainer,
clipper, noise and optimizer), their scores, and lower bounds on epsilon at the claim's delta
(`dp.auditing`), each against the claim. A lower bound for this canary and this threat model,
not a proof of privacy."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from dpprobe import accounting, probe
from dpprobe.accounting import records
from dpprobe.messages import log
from dpprobe.timings import RateProgress

__all__ = ["ProbeAudit", "audit_probe"]

# Scores simulated under the claim to choose the tests' thresholds (at most this many noise
# values drawn, unless there are more runs).
_SIMULATED, _SIMULATED_VALUES = 200_000, 20_000_000


@dataclasses.dataclass(frozen=True)
class ProbeAudit:
    """An audit's outcome.

    Attributes:
      plan: the claim's plan (each audited model is one run of it).
      run: the audited run (its plan and learning rate).
      claimed_epsilon, claimed_mu: the claim, as epsilon at delta and as a GDP mu.
      scores: {"in": the canary runs' scores, "out": the null record's}.
      bounds: `dp.audit_bounds`'s lower bounds.
      ratios: each bound over the claim.
      refuted: whether a lower bound exceeds the claim.
      train_seconds: how long the training took (the owner's; not a DP output).
    """

    plan: accounting.DpPlan
    run: probe.RunSpec
    claimed_epsilon: float
    claimed_mu: float
    scores: dict
    bounds: object
    ratios: dict
    refuted: bool
    train_seconds: float

    def tradeoff(self) -> tuple[np.ndarray, np.ndarray]:
        """The trade-off curve of the two score samples (false positive, false negative)."""
        from dpprobe import dp  # JAX, loaded by the audit that made this

        return dp.tradeoff_curve(self.scores["in"], self.scores["out"])

    def record(self, spec: probe.ProbeSpec, *, delta: float, num_rows: int) -> dict:
        """The audit's results: the claim, how it was audited, the bounds, what its plot
        needs (score histograms, trade-off curve), and the audit's own privacy.

        Args:
          spec: the audited probe (its loss and optimizer).
          delta: the claim's delta.
          num_rows: the rows the probes trained on (beside the canary).

        Returns:
          {"claim", "audit", "bounds", "claim_refuted", "histogram", "tradeoff", "privacy"}.
        """
        plan, runs = self.plan, len(self.scores["in"])
        all_runs = accounting.PrivacyLedger()
        for _ in range(2 * runs):
            all_runs.record("audit run", plan)
        fpr, fnr = self.tradeoff()
        return {
            "claim": {
                "epsilon": self.claimed_epsilon,
                "delta": delta,
                "gdp_mu": self.claimed_mu,
                "noise_multiplier": plan.noise_multiplier,
                "steps": plan.steps,
                "clip_norm": plan.clip_norm,
                "sampling": "full batch (q = 1)",
                "accountant": "pld",
                "neighboring_relation": accounting.NEIGHBORING_RELATION,
                "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
                "dp_event": accounting.event_to_dict(plan.dp_event()),
            },
            "audit": {
                "optimizer": spec.optimizer,
                "loss": spec.loss,
                "runs_per_side": runs,
                "num_rows": num_rows,
                "num_train": num_rows + 1,  # the rows and the canary (or its null record)
                "learning_rate": self.run.learning_rate,
                "trainer": ("dpprobe.probe.train_probe (full batch, in memory), keys from "
                            "dpprobe.dp.make_keys"),
                "canary": (f"one appended feature, zero for every row; the canary row is "
                           f"{probe.CANARY_NORM:g} along it, label {probe.CANARY_LABEL}; its "
                           "neighbour is the canary replaced by a null record"),
                "score": "-<w[d, :], u> / lr: the released weights of the canary's feature "
                         "along the canary's descent direction u",
                "thresholds": "chosen on scores simulated under the claim, before training",
            },
            "bounds": self.bounds.to_dict() | self.ratios,
            "claim_refuted": self.refuted,
            "histogram": _histogram(self.scores["in"], self.scores["out"]),
            "tradeoff": {"fpr": fpr.tolist(), "fnr": fnr.tolist()},
            "privacy": {
                "audit_outputs": (
                    f"functions of {2 * runs} probes trained on {num_rows} rows of the train "
                    f"split, each one run of the claim's plan: together (epsilon "
                    f"{all_runs.epsilon(delta):.4g}, delta {delta:g})-DP for those rows (PLD). "
                    "The scores read only w[d, :], which no row moves: for one step of sgd, "
                    "momentum, adam or sign they do not depend on the rows at all"),
                "row_sample": "drawn from OS entropy; the indices are not written",
            } | records.randomness(None, ""),
        }


def _histogram(in_scores, out_scores, bins: int = 60) -> dict:
    edges = np.histogram_bin_edges(np.concatenate([in_scores, out_scores]), bins)
    return {"edges": edges.tolist(), "in": np.histogram(in_scores, edges)[0].tolist(),
            "out": np.histogram(out_scores, edges)[0].tolist()}


def audit_probe(features, labels, spec: probe.ProbeSpec, *, epsilon: float, delta: float,
                steps: int, clip_norm: float, runs: int, confidence: float,
                runs_per_call: int | None = None, quiet: bool = False) -> ProbeAudit:
    """Calibrate the claim's plan, choose the tests' thresholds on scores simulated under it,
    train `runs` probes with the canary and `runs` with a null record in its place, and bound
    epsilon from below (module docstring).

    Args:
      features, labels: the rows the probes train on (beside the canary).
      spec: the probe (classes, loss, optimizer).
      epsilon, delta: the claim; the noise is what `dpprobe probe` uses for them.
      steps, clip_norm: the plan's T and C (full batch).
      runs: runs per side.
      confidence: the confidence of each bound.
      runs_per_call: runs trained per compiled call (None: the trainer's choice).
      quiet: no progress lines.

    Returns:
      A `ProbeAudit`.
    """
    from dpprobe import dp  # JAX: imported when the audit runs, not at the CLI's start

    num_examples = len(features) + 1  # the rows and the canary (or its null record)
    num_classes = spec.num_classes

    # The claim: the noise `dpprobe probe` would use for (epsilon, delta), and its epsilon from
    # the ledger (PLD, zero-out neighbours); each audited model is one run of this plan.
    plan = accounting.calibrate_plan(epsilon, delta, steps=steps, clip_norm=clip_norm)
    claim = accounting.PrivacyLedger()
    claim.record("one audited model", plan)
    claimed_epsilon, claimed_mu = claim.epsilon(delta), claim.gdp_mu()
    run = probe.RunSpec(plan, probe.audit_learning_rate(plan, num_examples))

    # Thresholds of the tests, from scores simulated under the claim (before any training).
    significance = 1.0 - confidence
    rng = np.random.default_rng()
    count = max(runs, min(_SIMULATED, _SIMULATED_VALUES // (steps * num_classes)))
    simulated = [probe.claimed_canary_scores(run, spec, num_examples=num_examples,
                                             count=count, include=include, rng=rng)
                 for include in (True, False)]
    gdp_threshold, cp_threshold = dp.choose_thresholds(
        *simulated, delta, significance, sizes=(runs, runs))

    # Train: M runs with the canary, M with a null record in its place.
    log(f"audit: {runs} runs with the canary and {runs} without, "
        f"{spec.optimizer}, T={steps}, on {len(features)} rows + the canary", quiet)
    train_start = time.perf_counter()
    progress = RateProgress("audit", 2 * runs, "runs", quiet)
    scores = {side: probe.train_canary_runs(
        features, labels, [run] * runs, spec, include=side == "in",
        runs_per_call=runs_per_call,
        progress=lambda done, offset=offset: progress(offset + done))
        for side, offset in (("in", 0), ("out", runs))}
    train_seconds = time.perf_counter() - train_start

    # Bounds, each at `confidence`, at the claim's delta.
    bounds = dp.audit_bounds(scores["in"], scores["out"], delta=delta,
                             gdp_threshold=gdp_threshold, cp_threshold=cp_threshold,
                             significance=significance)
    ratios = {
        "gdp_mu_lower_over_claim": bounds.gdp_mu_lower / claimed_mu,
        "gdp_mu_estimate_over_claim": bounds.gdp_mu_estimate / claimed_mu,
        "gdp_epsilon_lower_over_claim": bounds.gdp_epsilon_lower / claimed_epsilon,
        "cp_epsilon_lower_over_claim": bounds.cp_epsilon_lower / claimed_epsilon,
    }
    refuted = (bounds.gdp_mu_lower > claimed_mu
               or bounds.cp_epsilon_lower > claimed_epsilon)

    return ProbeAudit(plan, run, claimed_epsilon, claimed_mu, scores, bounds, ratios, refuted,
                      train_seconds)
