"""Lower bounds on epsilon from canary scores: the privacy a trained model at least lacks.

An audit trains models with a canary and without it (or, in one run, many canaries each in or
out at random), scores each model (or canary) so that "in" tends to score higher, and tests the
privacy claim against the two samples of scores. A bound holds with its stated confidence for
*this* canary and *this* attack (the threat model of the scores): it can show that a claim is
false, never that it is true.

Through `jax_privacy.auditing.CanaryScoreAuditor` (jax-privacy 2.0.0): the Clopper-Pearson
epsilon bound (Jagielski et al. 2020), TPR at a given FPR, and the one-run bound of
Steinke, Nasr & Jagielski (2023). The AUROC is computed here (`empirical_auroc`, the
Mann-Whitney statistic), not by `CanaryScoreAuditor.attack_auroc`: that is the area under the
convex hull of the empirical ROC (classifiers randomizing between thresholds), the best any
such test does on *these* scores, so it is biased high on few scores: 0.712 on average against
the true 0.638 for 20 + 20 scores of N(0.5, 1) and N(0, 1) (`tests/dp/test_audit.py`).
The Gaussian-DP bound (Nasr et al. 2023) is computed here
(`gdp_mu_bounds`), not by `CanaryScoreAuditor.epsilon_from_gdp`: in 2.0.0 that maximizes |mu|
over thresholds, so where FPR + FNR > 1 it bounds the reversed test with the one-sided *upper*
confidence bounds, the wrong side for it; two samples of one distribution (epsilon 0) then get
a "lower bound" near 4 at delta 1e-5 with 10^4 scores each (`tests/dp/test_audit.py`).

Thresholds. A bound at one threshold fixed before the scores are seen holds at its confidence.
The best of many thresholds on the same scores does not, unless paid for: a Bonferroni
correction over every threshold costs too much (at delta 1e-5 it leaves no one-run bound at
all), and `CanaryScoreAuditor`'s default `Bonferroni()` divides by the number of thresholds on
the empirical ROC hull, a number the scores choose. So the probe audit picks its thresholds
from scores simulated under the claim (`choose_thresholds`), before its own scores exist, and
the one-run bound chooses on one half of the canaries and bounds on the other
(`MultiSplit`, Meinshausen et al. 2009), unless given a threshold.

References:
  Nasr et al. 2023, Tight Auditing of Differentially Private Machine Learning:
    https://arxiv.org/abs/2302.07956
  Steinke, Nasr & Jagielski 2023, Privacy Auditing with One (1) Training Run:
    https://arxiv.org/abs/2305.08846
  Jagielski, Ullman & Oprea 2020, Auditing Differentially Private Machine Learning:
    https://arxiv.org/abs/2006.07709
  Dong, Roth & Su 2019, Gaussian Differential Privacy (trade-off curves):
    https://arxiv.org/abs/1905.02383
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
from scipy import stats

from dpprobe.accounting import gdp_epsilon
from dpprobe.accounting.validation import check_delta

__all__ = [
    "AuditBounds",
    "OneRunAudit",
    "audit_bounds",
    "choose_thresholds",
    "empirical_auroc",
    "gdp_mu_bounds",
    "one_run_epsilon_bound",
    "tradeoff_curve",
]

# FPRs at which the attack's TPR is reported.
LOW_FPRS = (0.001, 0.01, 0.1)


@dataclasses.dataclass(frozen=True)
class AuditBounds:
    """What two samples of canary scores show, each bound at `confidence`.

    Attributes:
      confidence: 1 - significance of every bound.
      delta: the delta of both epsilon bounds (the claim's).
      gdp_threshold, gdp_mu_lower, gdp_mu_estimate, gdp_epsilon_lower: the Gaussian-DP bound:
        at that threshold, mu >= gdp_mu_lower (Clopper-Pearson FPR and FNR bounds turned into
        mu, Dong et al. eq. 6), the point estimate of mu there, and the epsilon at `delta` of
        a gdp_mu_lower-GDP mechanism. It tests a Gaussian-DP claim (a full-batch Gaussian
        mechanism's, exactly); it is not a bound on an arbitrary (epsilon, delta) claim.
      cp_threshold, cp_epsilon_lower: the Clopper-Pearson bound, valid for any
        (epsilon, delta)-DP claim: epsilon >= log((TPR_low - delta) / FPR_high).
      tpr_at_fpr: {fpr: TPR} of the best threshold test (point estimates).
      auroc: area under the attack's empirical ROC curve, P(in > out) + P(in = out) / 2
        over the pairs of scores (`empirical_auroc`; an unbiased point estimate).
    """

    confidence: float
    delta: float
    gdp_threshold: float
    gdp_mu_lower: float
    gdp_mu_estimate: float
    gdp_epsilon_lower: float
    cp_threshold: float
    cp_epsilon_lower: float
    tpr_at_fpr: dict
    auroc: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "tpr_at_fpr": {f"{fpr:g}": tpr for fpr, tpr in self.tpr_at_fpr.items()}}


@dataclasses.dataclass(frozen=True)
class OneRunAudit:
    """What every one-run audit reports: its rigorous lower bound beside the claim it tests
    (the white-box gradient audit and the black-box image audit add their own fields).

    Attributes:
      epsilon_lower: the one-run lower bound on epsilon at `delta`, at `confidence`
        (`one_run_epsilon_bound`).
      claimed_epsilon: the plan's epsilon at `delta` (its accountant, zero-out neighbours).
      refuted: epsilon_lower > claimed_epsilon.
      canaries, included: m, and how many were in the training set.
      confidence, delta: of the bound (delta is the claim's).
    """

    epsilon_lower: float
    claimed_epsilon: float
    refuted: bool
    canaries: int
    included: int
    confidence: float
    delta: float

    # What a kind of audit writes beside its fields in results.json: properties computed from
    # them (`DERIVED`, by name) and what it says of itself (`DESCRIPTION`: its canary, its
    # score). One `to_dict` serves every kind.
    DERIVED: ClassVar[tuple[str, ...]] = ()
    DESCRIPTION: ClassVar[dict] = {}

    def to_dict(self) -> dict:
        """The audit for results.json.

        Returns:
          every field, then the `DERIVED` properties, then the `DESCRIPTION`.
        """
        return (dataclasses.asdict(self) | {name: getattr(self, name) for name in self.DERIVED}
                | self.DESCRIPTION)


def _upper_rate(count, total: int, significance: float):
    """One-sided Clopper-Pearson upper bound on a binomial rate: P(rate <= bound) >= 1 - sig."""
    count = np.asarray(count)
    return np.where(count < total, stats.beta.ppf(1.0 - significance, count + 1,
                                                  np.maximum(total - count, 1)), 1.0)


def _error_counts(in_scores, out_scores, thresholds):
    """(false positives, false negatives) of the tests "score >= t means in", per threshold."""
    in_sorted, out_sorted = np.sort(in_scores), np.sort(out_scores)
    false_negatives = np.searchsorted(in_sorted, thresholds, side="left")
    false_positives = len(out_sorted) - np.searchsorted(out_sorted, thresholds, side="left")
    return false_positives, false_negatives


def gdp_mu_bounds(in_scores, out_scores, threshold, significance: float = 0.05
                  ) -> tuple[float, float]:
    """(lower bound, point estimate) of mu from the test "score >= threshold means in".

    A mu-GDP mechanism's tests all have FNR >= Phi(Phi^-1(1 - FPR) - mu) (Dong et al. 2019), so
    mu >= Phi^-1(1 - FPR) - Phi^-1(FNR). With one-sided Clopper-Pearson upper bounds on FPR and
    FNR, each at significance / 2, the lower bound holds with probability >= 1 - significance,
    if `threshold` was fixed without these scores. It is 0 when the test shows nothing.

    Args:
      in_scores, out_scores: scores of models trained with and without the canary (1-D).
      threshold: the test's threshold, chosen before the scores were seen.
      significance: 1 - confidence.
    """
    in_scores, out_scores = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    _check_significance(significance)
    fp, fn = _error_counts(in_scores, out_scores, np.asarray([threshold], float))
    n_in, n_out = len(in_scores), len(out_scores)
    fpr_high = _upper_rate(fp, n_out, significance / 2)[0]
    fnr_high = _upper_rate(fn, n_in, significance / 2)[0]
    lower = float(stats.norm.isf(fpr_high) - stats.norm.ppf(fnr_high))
    # The estimate keeps counts of 0 (or all) finite, as if half a score lay beyond.
    fpr = np.clip(fp[0], 0.5, n_out - 0.5) / n_out
    fnr = np.clip(fn[0], 0.5, n_in - 0.5) / n_in
    estimate = float(stats.norm.isf(fpr) - stats.norm.ppf(fnr))
    return max(lower, 0.0), estimate


def _cp_epsilon(in_scores, out_scores, threshold: float, delta: float, significance: float):
    from jax_privacy import auditing

    auditor = auditing.CanaryScoreAuditor(in_scores, out_scores)
    return float(auditor.epsilon_clopper_pearson(
        significance, delta, one_sided=True,
        threshold_strategy=auditing.Explicit(float(threshold))))


def _candidate_thresholds(in_scores, out_scores) -> np.ndarray:
    """Thresholds at quantiles of the pooled scores, dense in the middle and in the upper tail
    (where the Clopper-Pearson bound peaks), each moved halfway down to the next lower score: the
    same tests on these scores, and robust to rounding where scores take few values (sign
    updates), so that a threshold never sits exactly on a score."""
    pooled = np.sort(np.concatenate([in_scores, out_scores]))
    tail = 1.0 - np.geomspace(0.02, 0.5 / len(pooled), 60)
    levels = np.unique(np.concatenate([np.linspace(0.01, 0.99, 99), tail]))
    quantiles = np.unique(np.quantile(pooled, levels, method="lower"))
    below = pooled[np.maximum(np.searchsorted(pooled, quantiles, side="left") - 1, 0)]
    return np.unique(np.where(below < quantiles, (below + quantiles) / 2, quantiles))


def choose_thresholds(in_scores, out_scores, delta: float, significance: float = 0.05, *,
                      sizes: tuple[int, int] | None = None) -> tuple[float, float]:
    """(Gaussian-DP threshold, Clopper-Pearson threshold): the thresholds whose bounds would be
    largest if the rates of these scores were observed on `sizes` = (in, out) scores.

    Pass scores simulated under the claim (or a split of the data not used for the bounds): a
    threshold chosen on the scores that are then bounded breaks the bound's confidence. Many
    simulated scores and the real `sizes` give the thresholds that maximize what the real
    scores can show if the claim is exact (the expected bound, not one noisy draw of it).

    Args:
      in_scores, out_scores: the scores to choose on.
      delta, significance: of the bounds that will be computed.
      sizes: numbers of in and out scores that will be bounded (default: these).
    """
    in_scores, out_scores = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    n_in, n_out = sizes or (len(in_scores), len(out_scores))
    candidates = _candidate_thresholds(in_scores, out_scores)
    fp, fn = _error_counts(in_scores, out_scores, candidates)
    fpr_high = _upper_rate(fp * (n_out / len(out_scores)), n_out, significance / 2)
    fnr_high = _upper_rate(fn * (n_in / len(in_scores)), n_in, significance / 2)
    mu_lower = stats.norm.isf(fpr_high) - stats.norm.ppf(fnr_high)
    # Jagielski et al.'s bound, as CanaryScoreAuditor.epsilon_clopper_pearson computes it.
    with np.errstate(divide="ignore", invalid="ignore"):
        cp = np.where(1.0 - fnr_high > delta,
                      np.log(1.0 - fnr_high - delta) - np.log(fpr_high), -np.inf)
    return float(candidates[np.argmax(mu_lower)]), float(candidates[np.argmax(cp)])


def audit_bounds(in_scores, out_scores, *, delta: float, gdp_threshold: float,
                 cp_threshold: float, significance: float = 0.05) -> AuditBounds:
    """Every bound and attack statistic of two samples of canary scores.

    Args:
      in_scores, out_scores: scores of the models trained with and without the canary
        (independent runs); "in" is expected to score higher.
      delta: the claim's delta (both epsilon bounds are at it).
      gdp_threshold, cp_threshold: thresholds fixed before these scores were seen
        (`choose_thresholds` on scores simulated under the claim).
      significance: 1 - confidence of each bound.
    """
    from jax_privacy import auditing

    delta = check_delta(delta)
    in_scores, out_scores = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    mu_lower, mu_estimate = gdp_mu_bounds(in_scores, out_scores, gdp_threshold, significance)
    auditor = auditing.CanaryScoreAuditor(in_scores, out_scores)
    tpr = np.atleast_1d(auditor.tpr_at_given_fpr(np.asarray(LOW_FPRS)))
    return AuditBounds(
        confidence=1.0 - significance,
        delta=delta,
        gdp_threshold=float(gdp_threshold),
        gdp_mu_lower=mu_lower,
        gdp_mu_estimate=mu_estimate,
        gdp_epsilon_lower=gdp_epsilon(mu_lower, delta),
        cp_threshold=float(cp_threshold),
        cp_epsilon_lower=_cp_epsilon(in_scores, out_scores, cp_threshold, delta, significance),
        tpr_at_fpr={fpr: float(v) for fpr, v in zip(LOW_FPRS, tpr, strict=True)},
        auroc=empirical_auroc(in_scores, out_scores),
    )


def empirical_auroc(in_scores, out_scores) -> float:
    """The area under the empirical ROC curve of "in scores higher": the fraction of (in, out)
    pairs where the in score is higher, ties counting half (the Mann-Whitney U statistic over
    n_in n_out), an unbiased estimate of P(in > out) + P(in = out) / 2; below 0.5 when the out
    scores tend higher (the convex hull's AUROC never is). From ranks: O(n log n) time, O(n)
    memory."""
    from scipy.stats import rankdata

    in_scores, out_scores = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    ranks = rankdata(np.concatenate([in_scores, out_scores]))  # ties: their average rank
    n_in, n_out = len(in_scores), len(out_scores)
    u = float(ranks[:n_in].sum()) - n_in * (n_in + 1) / 2
    return u / (n_in * n_out)


def one_run_epsilon_bound(scores, included, delta: float, significance: float = 0.05, *,
                          threshold: float | None = None) -> float:
    """Epsilon lower bound from one training run with many canaries (Steinke, Nasr &
    Jagielski 2023), through `CanaryScoreAuditor.epsilon_one_run`.

    Each of the m canaries must have been included in the training set independently with
    probability 1/2 (`included`), and scored from the trained model alone. The auditor guesses
    "in" for the canaries scoring at least a threshold and abstains on the rest; for an
    (epsilon, delta)-DP training run the number of correct guesses is dominated by a binomial
    (Steinke et al. Thm. 3.1), which the observed count refutes or not. One-sided (guesses "in"
    only), at `significance`.

    It is much weaker than the many-run audit: even perfect guesses of the ~m/2 included
    canaries refute only epsilon of about log(m/2 / log(1/significance)); with m = 1,000 at
    95% that is ~5 (the paper's 5.8 guesses every canary, in and out), and the threshold search
    below costs more (`tests/dp/test_audit.py` measures it).

    Args:
      scores: (m,) one score per canary, higher meaning "more likely included".
      included: (m,) booleans, whether each canary was in the training set.
      delta: the claim's delta.
      significance: 1 - confidence.
      threshold: a threshold fixed before the scores were seen; None chooses it on one half of
        the canaries and bounds on the other, median over 100 random halvings at
        significance / 2 (jax_privacy's `MultiSplit`, valid by Meinshausen et al. 2009).
    """
    from jax_privacy import auditing

    delta = check_delta(delta)
    scores = _scores(scores, "scores")
    included = np.asarray(included)
    if included.shape != scores.shape or included.dtype != bool:
        raise ValueError(f"included must be booleans shaped like scores {scores.shape}, got "
                         f"{included.dtype} {included.shape}")
    if included.all() or not included.any():
        raise ValueError("the canaries must include some in and some out of the training set")
    if not 0.0 < significance < 1.0:
        raise ValueError(f"significance must be in (0, 1), got {significance}")
    auditor = auditing.CanaryScoreAuditor(scores[included], scores[~included])
    strategy = (auditing.MultiSplit(num_samples=100, threshold_estimation_frac=0.5)
                if threshold is None else auditing.Explicit(float(threshold)))
    return float(auditor.epsilon_one_run(significance, delta, threshold_strategy=strategy))


def tradeoff_curve(in_scores, out_scores, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """The empirical trade-off curve of the threshold tests: (FPR, FNR) at `points` thresholds
    spread over the pooled scores, FPR increasing."""
    in_scores, out_scores = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    pooled = np.sort(np.concatenate([in_scores, out_scores]))
    thresholds = np.concatenate([pooled[np.linspace(0, len(pooled) - 1, points).astype(int)],
                                 [np.inf]])[::-1]
    fp, fn = _error_counts(in_scores, out_scores, thresholds)
    return fp / len(out_scores), fn / len(in_scores)


def _scores(values, name: str) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError(f"{name} must be finite")
    return values


def _check_significance(significance: float) -> None:
    if not 0.0 < significance < 0.5 or math.isnan(significance):
        raise ValueError(f"significance must be in (0, 0.5), got {significance}")
