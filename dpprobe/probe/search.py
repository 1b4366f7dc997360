"""Private hyperparameter search with the linear scaling rule (Panda et al. 2023, Alg. 1).

The total step size r = lr x T of full-batch DP-SGD with momentum grows linearly with epsilon.
So: search r with a tiny budget eps0, search again near (eps1 / eps0) r0 with a small budget
eps1, fit r = alpha * epsilon + b through the two best points, extrapolate to the final run's
epsilon, and train once. Every trial is a DP mechanism on the training data and goes into the
ledger; the final run gets exactly the budget that remains, so the whole job, tuning and
selection included, is (epsilon, delta)-DP for every record of the store's train split
(zero-out neighbours, N public).

Budget split (Gaussian DP, exact for full-batch Gaussian mechanisms): the job is mu-GDP with
mu^2 = mu_std^2 + mu_0^2 + mu_1^2 + mu_sel^2 + mu_f^2, where mu = gdp_mu(epsilon, delta), mu_s =
gdp_mu(eps_s, delta) for the private feature standardization (`probe.private_standardizer`,
its two releases together), the two search stages (each stage's trials together) and the
selection counts, and the final run gets the rest. A stage of n trials gives each trial
mu_s / sqrt(n); a trial of T steps then needs noise multiplier sigma = sqrt(T) sqrt(n) / mu_s.

Model selection is a DP mechanism too. Three ways to score the trials (`selection`):
  * "train" (default): each trial's count of correct predictions on the training data itself,
    plus Gaussian noise (sensitivity 1, `probe.noisy_correct_counts`), paid from eps_select
    (default epsilon/20) and composed with everything else;
  * "holdout": a random validation part carved from train (independently of the data) is held
    out of all training and scored with noisy counts; under zero-out neighbours the two
    disjoint parts compose in parallel (the ledger takes the larger), so training keeps the whole
    budget and the counts get the whole budget too, at the price of fewer training examples;
  * "public": the trials are scored exactly on a validation set the user declares public.
Panda et al. account for the training runs only and do not say what data scores the trials;
scoring private records without noise would leave them unprotected. The test split (public) is
used only for the final report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from dpprobe import accounting
from dpprobe.accounting import validation

__all__ = [
    "SearchDecision",
    "StageResult",
    "Trial",
    "budget_split",
    "decide_search",
    "final_budget",
    "extrapolate",
    "fit_linear_scaling",
    "search_line",
    "validation_split",
    "EXTRAPOLATIONS",
    "SEARCHES",
    "SEARCH_CHOICES",
    "SELECTIONS",
]

SEARCHES: tuple[str, ...] = ("random", "grid")
# `dpprobe tune --search`: decide from public quantities (auto), search, or never search (none).
SEARCH_CHOICES: tuple[str, ...] = ("auto", *SEARCHES, "none")
# A search must resolve accuracy differences of about this size (0.5 point) between its trials:
# when the noise of one trial's score is larger, it picks at random.
MAX_SCORE_NOISE = 0.005
# ... and its stage-0 trials must learn something: mu_trial N below this (digits at epsilon 8:
# 75) leaves a trial's model at the linear scaling rule's r = 0.011 mu N < 1.1, barely trained.
MIN_TRIAL_MU_N = 100.0
SELECTIONS: tuple[str, ...] = ("train", "holdout", "public")
EXTRAPOLATIONS: tuple[str, ...] = ("linear", "clipped", "log")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One hyperparameter setting: total step size r decomposed as r = lr x T."""

    r: float
    learning_rate: float
    steps: int


@dataclasses.dataclass
class StageResult:
    epsilon_per_trial: float  # epsilon of one trial alone (the x of the linear fit)
    epsilon_stage: float  # epsilon of the whole stage (its trials composed)
    trials: list[Trial]
    plans: list[accounting.DpPlan]
    scores: np.ndarray  # a DP output: noisy (or public) accuracies
    best: int

    @property
    def best_r(self) -> float:
        return self.trials[self.best].r


def budget_split(epsilon: float, delta: float, eps0: float, eps1: float,
                 eps_select: float | None = None, eps_standardize: float | None = None) -> dict:
    """mu of the whole job, of each search stage, of the selection counts (`eps_select`, when
    they compose with training), of the private feature standardization (`eps_standardize`,
    its two releases together) and of the final run (Gaussian DP, exact)."""
    named = [("epsilon", epsilon), ("eps0", eps0), ("eps1", eps1)]
    if eps_select is not None:
        named.append(("eps_select", eps_select))
    if eps_standardize is not None:
        named.append(("eps_standardize", eps_standardize))
    validation.check_delta(delta)
    for name, value in named:
        try:
            validation.check_epsilon(value, allow_inf=False)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    if not eps0 < eps1:
        raise ValueError(f"eps0 must be < eps1 (two points on a line), got {eps0} and {eps1}")
    mu = accounting.gdp_mu(epsilon, delta)
    mu0, mu1 = accounting.gdp_mu(eps0, delta), accounting.gdp_mu(eps1, delta)
    mu_select = 0.0 if eps_select is None else accounting.gdp_mu(eps_select, delta)
    mu_standardize = (0.0 if eps_standardize is None
                      else accounting.gdp_mu(eps_standardize, delta))
    spent = mu0 * mu0 + mu1 * mu1 + mu_select * mu_select + mu_standardize * mu_standardize
    if mu * mu - spent <= 0:
        raise ValueError(
            f"the search budgets ({', '.join(f'{n}={v:g}' for n, v in named[1:])}) use all of "
            f"epsilon={epsilon:g} (Gaussian DP: their mu^2 sum to {spent:.4g} >= mu^2 = "
            f"{mu**2:.4g}); lower them"
        )
    # A relative 1e-9 below the exact remainder, so that float rounding can never push the
    # composed total above the request.
    mu_final = math.sqrt(mu * mu - spent) * (1.0 - 1e-9)
    return {"mu": mu, "mu0": mu0, "mu1": mu1, "mu_select": mu_select,
            "mu_standardize": mu_standardize, "mu_final": mu_final,
            "epsilon_final": accounting.gdp_epsilon(mu_final, delta)}


@dataclasses.dataclass(frozen=True)
class SearchDecision:
    """Whether `dpprobe tune` searches, and why, in a sentence a user can act on."""

    search: bool
    reason: str
    score_noise: float | None  # std of one trial's noisy score, as an accuracy
    trial_mu_n: float  # mu of one stage-0 trial times N


def decide_search(*, num_trained: int, num_scored: int, epsilon: float, delta: float,
                  eps0: float, eps_select: float | None, trials: int,
                  scoring: str) -> SearchDecision:
    """Whether a private search pays: it does when one trial's score is precise to
    MAX_SCORE_NOISE (the count noise sqrt(2 trials) / mu_select over the scored examples; with
    "holdout" the counts take the whole mu, with "public" they are exact) and a stage-0 trial,
    at mu_0 / sqrt(trials), still trains (mu_trial N >= MIN_TRIAL_MU_N). Otherwise the search
    would choose r by noise: the whole budget is better spent on the default recipe.

    Args:
      num_trained, num_scored: sizes of the part trials train on and of the part they are
        scored on (N, a holdout split's parts, or the public validation set).
      epsilon, delta, eps0, eps_select: the job's budget, stage 0's, the counts'.
      trials: trials per stage.
      scoring: "train", "holdout" or "public".

    Returns:
      A `SearchDecision` whose reason says which and why, in words a user can act on.

    Formal guarantee: a function of public quantities only (sizes, budgets, counts of
    trials); deciding costs no privacy.
    """
    mu_trial = accounting.gdp_mu(eps0, delta) / math.sqrt(trials)
    trial_mu_n = mu_trial * num_trained
    noise = None
    if scoring != "public":
        mu_count = accounting.gdp_mu(epsilon if scoring == "holdout" else eps_select, delta)
        noise = math.sqrt(2 * trials) / mu_count / num_scored
    if noise is not None and noise > MAX_SCORE_NOISE:
        return SearchDecision(False, (
            f"no search: with {num_scored} examples to score on, each trial's noisy score "
            f"has a std of {100 * noise:.2g} accuracy points (a search needs below "
            f"{100 * MAX_SCORE_NOISE:g} to tell r apart), so it would pick r by noise; the "
            "whole budget goes to the default recipe instead (--search random forces one)"),
            noise, trial_mu_n)
    if trial_mu_n < MIN_TRIAL_MU_N:
        return SearchDecision(False, (
            f"no search: each of the {trials} stage-0 trials would get epsilon "
            f"{accounting.gdp_epsilon(mu_trial, delta):.2g} on {num_trained} examples (mu N = "
            f"{trial_mu_n:.3g} < {MIN_TRIAL_MU_N:g}), too little to train a model worth "
            "comparing; the whole budget goes to the default recipe instead (--search random "
            "forces one)"), noise, trial_mu_n)
    return SearchDecision(True, (
        f"search: each trial's score is precise to {100 * (noise or 0.0):.2g} accuracy points "
        f"and each stage-0 trial trains with mu N = {trial_mu_n:.3g}, so a search can tell r "
        "apart (--search none spends the whole budget on the default recipe)"),
        noise, trial_mu_n)


def final_budget(epsilon: float, delta: float, eps_standardize: float | None) -> dict:
    """`budget_split` without a search: mu of the job, of the standardization and of the final
    run, which gets everything else (Gaussian DP, exact)."""
    validation.check_delta(delta)
    mu = accounting.gdp_mu(validation.check_epsilon(epsilon, allow_inf=False), delta)
    mu_standardize = (0.0 if eps_standardize is None
                      else accounting.gdp_mu(eps_standardize, delta))
    if mu_standardize >= mu:
        raise ValueError(f"eps_standardize={eps_standardize:g} uses all of epsilon={epsilon:g}")
    mu_final = math.sqrt(mu * mu - mu_standardize * mu_standardize) * (1.0 - 1e-9)
    return {"mu": mu, "mu_standardize": mu_standardize, "mu_final": mu_final,
            "epsilon_final": accounting.gdp_epsilon(mu_final, delta)}


def fit_linear_scaling(eps0: float, r0: float, eps1: float, r1: float) -> tuple[float, float]:
    """(alpha, b) of the line r = alpha * epsilon + b through (eps0, r0) and (eps1, r1)."""
    alpha = (r1 - r0) / (eps1 - eps0)
    return alpha, r0 - alpha * eps0


def extrapolate(kind: str, eps0: float, r0: float, eps1: float, r1: float,
                epsilon_final: float, searched: tuple[float, float]) -> dict:
    """r* at `epsilon_final` from the two stages' best (epsilon, r), and how it was made.

    Args:
      kind: "linear": Panda et al.'s line r = alpha * epsilon + b through the two points;
        "clipped": that line, clipped to `searched`; "log": the line through the two points in
        log-log space, r = r1 (epsilon / eps1)^k, i.e. a power law (k = 1 and b = 0 agree with
        the linear rule; the exponent is clipped to [0, 1], so r* never grows faster than
        epsilon).
      searched: (lowest, highest) r any stage could propose.

    Returns:
      {"r_star", "alpha", "b" (the linear fit, reported for every kind), "exponent" (log only),
      "fallback" (the r kept when the linear fit is not positive, else None), "clipped" (True
      when "clipped" moved r*), "r_line" (r* before clipping)}. All are functions of the
      stages' DP outputs.
    """
    if kind not in EXTRAPOLATIONS:
        raise ValueError(f"extrapolation must be one of {EXTRAPOLATIONS}, got {kind!r}")
    alpha, intercept = fit_linear_scaling(eps0, r0, eps1, r1)
    out = {"alpha": alpha, "b": intercept, "exponent": None, "fallback": None, "clipped": False}
    if kind == "log":
        exponent = min(max(math.log(r1 / r0) / math.log(eps1 / eps0), 0.0), 1.0)
        return out | {"r_star": r1 * (epsilon_final / eps1) ** exponent, "exponent": exponent}
    r_star = alpha * epsilon_final + intercept
    if not r_star > 0:
        out["fallback"] = r_star = r1
    out["r_line"] = r_star
    if kind == "clipped":
        low, high = searched
        clipped = min(max(r_star, low), high)
        out["clipped"] = clipped != r_star
        r_star = clipped
    return out | {"r_star": r_star}


def _candidates(rng, count, low, high, search: str) -> np.ndarray:
    if search == "grid":
        return np.geomspace(low, high, count)
    if search == "random":
        return np.sort(np.exp(rng.uniform(math.log(low), math.log(high), count)))
    raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")


def _decompose(r: float, steps_choices: Sequence[int], rng, search: str, index: int) -> Trial:
    """r = lr x T with T from `steps_choices` (cycled for grids, random otherwise)."""
    steps = (steps_choices[index % len(steps_choices)] if search == "grid"
             else int(rng.choice(steps_choices)))
    return Trial(float(r), float(r) / steps, int(steps))


def search_line(
    run_stage: Callable[[list[Trial], list[accounting.DpPlan]], np.ndarray],
    *,
    epsilon: float,
    delta: float,
    eps0: float,
    eps1: float,
    trials: int,
    r_range: tuple[float, float],
    steps_choices: Sequence[int],
    search: str,
    clip_norm: float,
    rng: np.random.Generator,
    ledger: accounting.PrivacyLedger,
    eps_select: float | None = None,
    training_data: str = "all",
    extrapolation: str = "linear",
    eps_standardize: float | None = None,
) -> dict:
    """Panda et al. Alg. 1 up to the final run: two searches, a linear fit, an extrapolation.

    `run_stage(stage, trials, plans)` trains each trial with its DP plan and returns its scores
    (higher is better; a DP output, its own mechanisms recorded by the caller); it is the only
    place data is touched. The trials are recorded in `ledger` as running on `training_data`;
    `eps_select` is the budget the scoring takes out of the total (None when the scoring
    composes in parallel or is free). `rng` drives only data-independent r proposals.
    `extrapolation` is how r* is read off the two stages (`extrapolate`; Panda et al.: linear).
    `eps_standardize` is the budget the caller spent on feature standardization (None: none).
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    low, high = r_range
    if not 0 < low < high:
        raise ValueError(f"r_range must satisfy 0 < low < high, got {r_range}")
    budget = budget_split(epsilon, delta, eps0, eps1, eps_select, eps_standardize)
    # Each trial of a stage of n trials is (mu_s / sqrt(n))-GDP; its epsilon is the line's x.
    mu_trial = [mu / math.sqrt(trials) for mu in (budget["mu0"], budget["mu1"])]
    eps_trial = [accounting.gdp_epsilon(mu, delta) for mu in mu_trial]

    def stage(index: int, rs) -> StageResult:
        """One search stage: each proposed r decomposed as lr x T, its plan, recorded in the
        ledger, trained and scored by `run_stage`; the best score wins."""
        settings = [_decompose(r, steps_choices, rng, search, i) for i, r in enumerate(rs)]
        plans = [accounting.DpPlan(math.sqrt(t.steps) / mu_trial[index], t.steps, 1.0,
                                   clip_norm) for t in settings]
        for i, (trial, plan) in enumerate(zip(settings, plans, strict=True)):
            ledger.record(f"stage{index}-trial{i}", plan, role="tuning", data=training_data,
                          stage=index, r=trial.r, learning_rate=trial.learning_rate)
        scores = np.asarray(run_stage(index, settings, plans), float)
        return StageResult(
            epsilon_per_trial=eps_trial[index],
            epsilon_stage=accounting.gdp_epsilon(budget[f"mu{index}"], delta),
            trials=settings, plans=plans, scores=scores, best=int(np.argmax(scores)))

    # Alg. 1, first search: r0, the best r within r_range at eps0.
    first = stage(0, _candidates(rng, trials, low, high, search))
    # Second search, around (eps1 / eps0) r0 (linear scaling), within a factor of 2: r1.
    center = first.best_r * eps_trial[1] / eps_trial[0]
    spread = 2.0 if trials > 1 else 1.0
    second = stage(1, _candidates(rng, trials, center / spread, center * spread, search)
                   if trials > 1 else [center])
    # The line r = alpha epsilon + b through (eps0, r0) and (eps1, r1); r* at eps_f.
    searched = (min(low, center / spread), max(high, center * spread))
    fit = extrapolate(extrapolation, first.epsilon_per_trial, first.best_r,
                      second.epsilon_per_trial, second.best_r, budget["epsilon_final"],
                      searched)
    return {"budget": budget, "stages": [first, second], "extrapolation": extrapolation,
            "searched": searched} | fit


def validation_split(num_examples: int, fraction: float, rng) -> tuple[np.ndarray, np.ndarray]:
    """A random partition of the row indices, drawn independently of the data (N is public)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {fraction}")
    count = max(1, int(round(fraction * num_examples)))
    if count >= num_examples:
        raise ValueError(f"validation split of {count} leaves no training examples")
    order = rng.permutation(num_examples)
    return np.sort(order[count:]), np.sort(order[:count])
