"""Private hyperparameter search with the linear scaling rule (Panda et al. 2023, Alg. 1).

The total step size r = lr x T of full-batch DP-SGD with momentum grows linearly with epsilon.
So: search r with a tiny budget eps0, search again near (eps1 / eps0) r0 with a small budget
eps1, fit r = alpha * epsilon + b through the two best points, extrapolate to the final run's
epsilon, and train once. Every trial is a DP mechanism on the training data and goes into the
ledger; the final run gets exactly the budget that remains, so the whole job, tuning and
selection included, is (epsilon, delta)-DP for every record of the store's train split
(zero-out neighbours, N public).

Budget split (Gaussian DP, exact for full-batch Gaussian mechanisms): the job is mu-GDP with
mu^2 = mu_0^2 + mu_1^2 + mu_sel^2 + mu_f^2, where mu = gdp_mu(epsilon, delta), mu_s =
gdp_mu(eps_s, delta) for the two search stages (each stage's trials together) and for the
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
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

import accounting
from pipelines import records

__all__ = [
    "StageResult",
    "Trial",
    "budget_split",
    "fit_linear_scaling",
    "linear_scaling_search",
    "search_line",
    "SELECTIONS",
]

SELECTIONS: tuple[str, ...] = ("train", "holdout", "public")


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
                 eps_select: float | None = None) -> dict:
    """mu of the whole job, of each search stage, of the selection counts (`eps_select`, when
    they compose with training) and of the final run (Gaussian DP, exact)."""
    named = [("epsilon", epsilon), ("eps0", eps0), ("eps1", eps1)]
    if eps_select is not None:
        named.append(("eps_select", eps_select))
    for name, value in named:
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be finite and > 0, got {value}")
    if not eps0 < eps1:
        raise ValueError(f"eps0 must be < eps1 (two points on a line), got {eps0} and {eps1}")
    mu = accounting.gdp_mu(epsilon, delta)
    mu0, mu1 = accounting.gdp_mu(eps0, delta), accounting.gdp_mu(eps1, delta)
    mu_select = 0.0 if eps_select is None else accounting.gdp_mu(eps_select, delta)
    spent = mu0 * mu0 + mu1 * mu1 + mu_select * mu_select
    if mu * mu - spent <= 0:
        raise ValueError(
            f"the search budgets ({', '.join(f'{n}={v:g}' for n, v in named[1:])}) use all of "
            f"epsilon={epsilon:g} (Gaussian DP: their mu^2 sum to {spent:.4g} >= mu^2 = "
            f"{mu**2:.4g}); lower them"
        )
    # A relative 1e-9 below the exact remainder, so that float rounding can never push the
    # composed total above the request.
    mu_final = math.sqrt(mu * mu - spent) * (1.0 - 1e-9)
    return {"mu": mu, "mu0": mu0, "mu1": mu1, "mu_select": mu_select, "mu_final": mu_final,
            "epsilon_final": accounting.gdp_epsilon(mu_final, delta)}


def fit_linear_scaling(eps0: float, r0: float, eps1: float, r1: float) -> tuple[float, float]:
    """(alpha, b) of the line r = alpha * epsilon + b through (eps0, r0) and (eps1, r1)."""
    alpha = (r1 - r0) / (eps1 - eps0)
    return alpha, r0 - alpha * eps0


def _candidates(rng, count, low, high, search: str) -> np.ndarray:
    if search == "grid":
        return np.geomspace(low, high, count)
    if search == "random":
        return np.sort(np.exp(rng.uniform(math.log(low), math.log(high), count)))
    raise ValueError(f"search must be 'random' or 'grid', got {search!r}")


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
) -> dict:
    """Panda et al. Alg. 1 up to the final run: two searches, a linear fit, an extrapolation.

    `run_stage(stage, trials, plans)` trains each trial with its DP plan and returns its scores
    (higher is better; a DP output, its own mechanisms recorded by the caller); it is the only
    place data is touched. The trials are recorded in `ledger` as running on `training_data`;
    `eps_select` is the budget the scoring takes out of the total (None when the scoring
    composes in parallel or is free). `rng` drives only data-independent r proposals.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    low, high = r_range
    if not 0 < low < high:
        raise ValueError(f"r_range must satisfy 0 < low < high, got {r_range}")
    budget = budget_split(epsilon, delta, eps0, eps1, eps_select)
    # Each trial of a stage of n trials is (mu_s / sqrt(n))-GDP; its epsilon is the line's x.
    mu_trial = [mu / math.sqrt(trials) for mu in (budget["mu0"], budget["mu1"])]
    eps_trial = [accounting.gdp_epsilon(mu, delta) for mu in mu_trial]
    stages: list[StageResult] = []
    for stage in (0, 1):
        if stage == 0:
            rs = _candidates(rng, trials, low, high, search)
        else:  # linear scaling: around (eps1 / eps0) r0, within a factor of 2
            center = stages[0].best_r * eps_trial[1] / eps_trial[0]
            rs = _candidates(rng, trials, center / 2, center * 2, search) if trials > 1 else [
                center]
        settings = [_decompose(r, steps_choices, rng, search, i) for i, r in enumerate(rs)]
        plans = [accounting.DpPlan(math.sqrt(t.steps) / mu_trial[stage], t.steps, 1.0, clip_norm)
                 for t in settings]
        for i, (trial, plan) in enumerate(zip(settings, plans, strict=True)):
            ledger.record(f"stage{stage}-trial{i}", plan, role="tuning", data=training_data,
                          stage=stage, r=trial.r, learning_rate=trial.learning_rate)
        scores = np.asarray(run_stage(stage, settings, plans), float)
        stages.append(StageResult(
            epsilon_per_trial=eps_trial[stage],
            epsilon_stage=accounting.gdp_epsilon(budget[f"mu{stage}"], delta),
            trials=settings, plans=plans, scores=scores, best=int(np.argmax(scores)),
        ))
    alpha, intercept = fit_linear_scaling(stages[0].epsilon_per_trial, stages[0].best_r,
                                          stages[1].epsilon_per_trial, stages[1].best_r)
    r_star = alpha * budget["epsilon_final"] + intercept
    fallback = None
    if not r_star > 0:
        fallback = stages[1].best_r
        r_star = fallback
    return {"budget": budget, "stages": stages, "alpha": alpha, "b": intercept,
            "r_star": r_star, "fallback": fallback}


def _validation_split(num_examples: int, fraction: float, rng) -> tuple[np.ndarray, np.ndarray]:
    """A random partition of the row indices, drawn independently of the data (N is public)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {fraction}")
    count = max(1, int(round(fraction * num_examples)))
    if count >= num_examples:
        raise ValueError(f"validation split of {count} leaves no training examples")
    order = rng.permutation(num_examples)
    return np.sort(order[count:]), np.sort(order[:count])


def load_public_validation(spec: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of a public validation set, `npz:PATH` holding `features` (in the
    store's feature space: the same backbone and preprocessing) and `labels`."""
    kind, _, path = spec.partition(":")
    if kind != "npz" or not path:
        raise ValueError(f"--public-validation must be npz:PATH (features, labels), got {spec!r}")
    try:
        with np.load(path, allow_pickle=False) as data:
            features, labels = np.asarray(data["features"]), np.asarray(data["labels"])
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"cannot read the public validation set {path}: {err}") from err
    if features.ndim not in (2, 3) or features.shape[-1] != dim or len(labels) != len(features):
        raise ValueError(f"public validation set {path}: features {features.shape} and labels "
                         f"{labels.shape} do not fit the store's feature dim {dim}")
    return features, labels.astype(np.int32)


def linear_scaling_search(
    store: str,
    epsilon: float,
    delta: float,
    *,
    eps0: float | None = None,
    eps1: float | None = None,
    eps_select: float | None = None,
    trials: int = 5,
    search: str = "random",
    r_range: tuple[float, float] = (1.0, 1000.0),
    steps_choices: Sequence[int] = (25, 50, 100),
    final_steps: int | None = None,
    optimizer: str = "momentum",
    loss: str = "softmax",
    clip_norm: float = 1.0,
    normalization: str = "none",
    groups: int = 1,
    selection: str = "train",
    validation_fraction: float = 0.1,
    public_validation: str | tuple[np.ndarray, np.ndarray] | None = None,
    seed: int | None = None,
    quiet: bool = False,
) -> dict:
    """Tune r = lr x T privately with the linear scaling rule, then train the final probe.

    Args:
      store: feature store with complete train and test splits.
      epsilon, delta: the total budget of the job, tuning and selection included.
      eps0, eps1: budgets of the two search stages (default epsilon/20 and epsilon/10).
      eps_select: budget of the noisy selection counts of both stages with selection "train"
        (default epsilon/20).
      trials: trials per stage.
      search: "random" (log-uniform r) or "grid" (geometric grid of r).
      r_range: range of r for the first stage.
      steps_choices: T values a trial's r is decomposed over (lr = r / T).
      final_steps: T of the final run (default: the largest of `steps_choices`).
      optimizer: update rule (Panda et al.: "momentum", 0.9).
      clip_norm, loss, normalization, groups: as for `run_probe`.
      selection: "train", "holdout" or "public" (module docstring).
      validation_fraction: share of train held out with selection "holdout".
      public_validation: with selection "public": `npz:PATH` or (features, labels), public.
      seed: drives only data-independent randomness: the r proposals and the holdout split.
        Noise and counts always draw from OS entropy.

    Returns:
      A results dict: the chosen (lr, T, r), the fitted line, every trial with its (noisy)
      score, the final test accuracy and the ledger (its composition is the job's epsilon);
      plus "params", the final probe.
    """
    import extract
    import probe

    start_time = time.perf_counter()
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    if (selection == "public") != (public_validation is not None):
        raise ValueError("a public validation set goes with selection 'public', and only there")
    eps0 = epsilon / 20 if eps0 is None else eps0
    eps1 = epsilon / 10 if eps1 is None else eps1
    if selection == "train":
        eps_select = epsilon / 20 if eps_select is None else eps_select
    elif eps_select is not None:
        raise ValueError(f"eps_select applies to selection 'train', not {selection!r}")
    budget = budget_split(epsilon, delta, eps0, eps1, eps_select)  # fails fast if impossible

    # Load the store; choose what trains and what scores.
    x, y, train_attrs = extract.load_split(store, "train", dtype=None)
    test_x, test_y, test_attrs = extract.load_split(store, "test", dtype=None)
    num_classes = records.declared_num_classes(train_attrs, test_attrs)
    if delta >= 1.0 / len(y) and not quiet:
        print(f"tune: warning: delta={delta:g} >= 1/N = {1 / len(y):.3g}; a meaningful "
              "guarantee usually needs delta << 1/N", file=sys.stderr)
    rng = np.random.default_rng(seed)  # data-independent choices only
    training_data, scored_data = "all", "all"
    if selection == "holdout":
        train_idx, val_idx = _validation_split(len(y), validation_fraction, rng)
        train_x, train_y, score_x, score_y = x[train_idx], y[train_idx], x[val_idx], y[val_idx]
        training_data, scored_data = "train part", "validation part"
    elif selection == "public":
        train_x, train_y = x, y
        score_x, score_y = (public_validation if not isinstance(public_validation, str) else
                            load_public_validation(public_validation, x.shape[-1]))
    else:
        train_x, train_y, score_x, score_y = x, y, x, y
    if len(score_y) < 1000 and not quiet:
        print(f"tune: warning: trials are scored on only {len(score_y)} examples; their "
              "accuracies are coarse (noisy counts add more), so the choice of r may be poor",
              file=sys.stderr)
    spec = probe.ProbeSpec(num_classes=num_classes, loss=loss, optimizer=optimizer,
                           normalization=normalization, groups=groups)
    # Noise of the counts, per stage (each stage scores `trials` models, sensitivity 1 each).
    mu_count = (budget["mu"] * (1.0 - 1e-9) if selection == "holdout" else budget["mu_select"])
    count_sigma = math.sqrt(2 * trials) / mu_count if selection != "public" else 0.0

    # Search: two stages; every trial and every count recorded in the ledger.
    ledger = accounting.PrivacyLedger()

    def run_stage(stage, settings, plans):
        runs = [probe.RunSpec(p, t.learning_rate) for t, p in zip(settings, plans, strict=True)]
        if not quiet:
            print(f"tune: stage {stage}, {len(runs)} trials, r in "
                  f"[{min(t.r for t in settings):.3g}, {max(t.r for t in settings):.3g}]",
                  file=sys.stderr)
        result = probe.train_probe(train_x, train_y, runs, probe.make_keys(len(runs)), spec,
                                   progress=not quiet)
        kwargs = dict(normalization=normalization, groups=groups)
        if selection == "public":
            counts = probe.correct_counts(result.params, score_x, score_y, **kwargs)
        else:
            counts = probe.noisy_correct_counts(result.params, score_x, score_y, count_sigma,
                                                **kwargs)
            ledger.record(f"stage{stage}-selection", accounting.DpPlan(count_sigma, len(runs)),
                          role="selection", data=scored_data,
                          mechanism="Gaussian noise on each trial's correct count "
                                    "(sensitivity 1)")
        return counts / len(score_y)

    line = search_line(run_stage, epsilon=epsilon, delta=delta, eps0=eps0, eps1=eps1,
                       trials=trials, r_range=r_range, steps_choices=steps_choices,
                       search=search, clip_norm=clip_norm, rng=rng, ledger=ledger,
                       eps_select=eps_select, training_data=training_data)
    stages = line["stages"]

    # Final run: the remaining budget, r* decomposed as lr x T. For full-batch GD the noise the
    # weights accumulate is ~ lr sqrt(T) sigma C / N = r C / (mu N): it depends on r, not on
    # how r splits into lr x T, so the final run takes the most steps (the best optimizer).
    steps = final_steps or max(steps_choices)
    sigma = math.sqrt(steps) / budget["mu_final"]
    plan = accounting.DpPlan(sigma, steps, 1.0, clip_norm)
    learning_rate = line["r_star"] / steps
    ledger.record("final", plan, role="final", data=training_data, r=line["r_star"],
                  learning_rate=learning_rate)
    final = probe.train_probe(train_x, train_y, [probe.RunSpec(plan, learning_rate)],
                              probe.make_keys(1), spec, progress=not quiet)

    # Evaluate the final model on test (public; the only use of test).
    metrics = probe.evaluate(final.params, test_x, test_y, normalization=normalization,
                             groups=groups)

    # Record: DP outputs and public inputs only.
    total = ledger.epsilon(delta)
    stage_records = [
        {
            "stage": index,
            "epsilon_stage": stage.epsilon_stage,
            "epsilon_per_trial": stage.epsilon_per_trial,
            "best_r": stage.best_r,
            "trials": [
                {"r": t.r, "learning_rate": t.learning_rate, "steps": t.steps,
                 "noise_multiplier": p.noise_multiplier, "score": float(s)}
                for t, p, s in zip(stage.trials, stage.plans, stage.scores, strict=True)
            ],
        }
        for index, stage in enumerate(stages)
    ]
    scoring = {
        "train": "noisy correct counts on the training data (Gaussian, sensitivity 1), "
                 "composed with training",
        "holdout": "noisy correct counts on a held-out validation part (Gaussian, sensitivity "
                   "1); the parts compose in parallel",
        "public": "exact accuracy on a validation set declared public by the user",
    }[selection]
    return {
        "dpprobe_version": records.VERSION,
        "job": "tune",
        "created": records.now(),
        "store": str(store),
        "provenance": {"train": records.public_split_attrs(train_attrs),
                       "test": records.public_split_attrs(test_attrs)},
        "probe": spec.to_dict(),
        "method": "linear scaling rule (Panda et al. 2023, Alg. 1), full-batch DP-SGD",
        "privacy": {
            "epsilon_requested": epsilon,
            "delta": delta,
            "epsilon_total": total,
            "accountant": "pld",
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
            "covers": "every record of the store's train split (tuning, selection and the "
                      "final run included)",
            "eps0": eps0,
            "eps1": eps1,
            "eps_select": eps_select,
            "epsilon_final_alone": budget["epsilon_final"],
        } | records.randomness(seed, "the r proposals" + (
            " and the holdout split" if selection == "holdout" else "")),
        "selection": {"kind": selection, "scoring": scoring,
                      "count_noise_std": count_sigma if selection != "public" else None,
                      "num_scored": int(len(score_y)),
                      "num_trained": int(len(train_y))}
        | ({"validation_fraction": validation_fraction} if selection == "holdout" else {}),
        "search": {"kind": search, "trials_per_stage": trials, "r_range": list(r_range),
                   "steps_choices": list(steps_choices)},
        "stages": stage_records,
        "line": {"alpha": line["alpha"], "b": line["b"], "r_star": line["r_star"],
                 "fallback_used": line["fallback"] is not None},
        "chosen": {"r": line["r_star"], "learning_rate": learning_rate, "steps": steps,
                   "noise_multiplier": sigma},
        "final": {"test_accuracy": float(metrics["top1"][0]),
                  "test_top5_accuracy": float(metrics["top5"][0]),
                  "per_class_accuracy": metrics["per_class"][0].tolist(),
                  "epsilon_alone": plan.epsilon(delta)},
        "runs": [{"epsilon": total, "delta": delta, "noise_multiplier": sigma, "steps": steps,
                  "optimizer": optimizer, "learning_rate": learning_rate,
                  "test_accuracy": float(metrics["top1"][0]), "accountant": "pld",
                  "includes_tuning": True}],
        "ledger": ledger.to_dict(delta),
        "params": final.params,
        "wall_seconds": time.perf_counter() - start_time,
    }
