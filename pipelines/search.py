"""Private hyperparameter search with the linear scaling rule (Panda et al. 2023, Alg. 1).

The total step size r = lr x T of full-batch DP-SGD with momentum grows linearly with epsilon.
So: search r with a tiny budget eps0, search again near (eps1 / eps0) r0 with a small budget
eps1, fit r = alpha * epsilon + b through the two best points, extrapolate to the final run's
epsilon, and train once. Every trial is a DP mechanism on the training data and goes into the
ledger; the final run gets exactly the budget that remains, so the whole job, tuning included,
is (epsilon, delta)-DP.

Budget split (Gaussian DP, exact for full-batch Gaussian runs): the job is mu-GDP with
mu^2 = mu_0^2 + mu_1^2 + mu_f^2, where mu = gdp_mu(epsilon, delta), mu_s = gdp_mu(eps_s, delta)
for the two search stages (each stage's trials together), and the final run gets the rest. A
stage of n trials gives each trial mu_s / sqrt(n); a trial of T steps then needs noise
multiplier sigma = sqrt(T) sqrt(n) / mu_s.

Model selection scores trials on a validation split carved from train. Validation examples are
held out of every training run, so the (epsilon, delta) guarantee covers the remaining training
examples; the selection itself reads the validation examples without noise, so they are not
covered (like a test set). The test split is touched only for the final report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

import accounting

__all__ = [
    "StageResult",
    "Trial",
    "budget_split",
    "fit_linear_scaling",
    "linear_scaling_search",
    "search_line",
]


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
    scores: np.ndarray
    best: int

    @property
    def best_r(self) -> float:
        return self.trials[self.best].r


def budget_split(epsilon: float, delta: float, eps0: float, eps1: float) -> dict:
    """mu of the whole job, of each search stage and of the final run (Gaussian DP, exact)."""
    for name, value in (("epsilon", epsilon), ("eps0", eps0), ("eps1", eps1)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be finite and > 0, got {value}")
    if not eps0 < eps1:
        raise ValueError(f"eps0 must be < eps1 (two points on a line), got {eps0} and {eps1}")
    mu = accounting.gdp_mu(epsilon, delta)
    mu0, mu1 = accounting.gdp_mu(eps0, delta), accounting.gdp_mu(eps1, delta)
    remaining = mu * mu - mu0 * mu0 - mu1 * mu1
    if remaining <= 0:
        raise ValueError(
            f"the search budgets eps0={eps0} and eps1={eps1} use all of epsilon={epsilon} "
            f"(Gaussian DP: mu0^2 + mu1^2 = {mu0**2 + mu1**2:.4g} >= mu^2 = {mu**2:.4g}); "
            "lower them"
        )
    # A relative 1e-9 below the exact remainder, so that float rounding can never push the
    # composed total above the request.
    mu_final = math.sqrt(remaining) * (1.0 - 1e-9)
    return {"mu": mu, "mu0": mu0, "mu1": mu1, "mu_final": mu_final,
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
) -> dict:
    """Panda et al. Alg. 1 up to the final run: two searches, a linear fit, an extrapolation.

    `run_stage(trials, plans)` trains each trial with its DP plan and returns validation scores
    (higher is better); it is the only place data is touched.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    low, high = r_range
    if not 0 < low < high:
        raise ValueError(f"r_range must satisfy 0 < low < high, got {r_range}")
    budget = budget_split(epsilon, delta, eps0, eps1)
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
            ledger.record(f"stage{stage}-trial{i}", plan, role="tuning", stage=stage,
                          r=trial.r, learning_rate=trial.learning_rate)
        scores = np.asarray(run_stage(settings, plans), float)
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
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {fraction}")
    count = max(1, int(round(fraction * num_examples)))
    if count >= num_examples:
        raise ValueError(f"validation split of {count} leaves no training examples")
    order = rng.permutation(num_examples)
    return np.sort(order[count:]), np.sort(order[:count])


def linear_scaling_search(
    store: str,
    epsilon: float,
    delta: float,
    *,
    eps0: float | None = None,
    eps1: float | None = None,
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
    validation_fraction: float = 0.1,
    seed: int | None = None,
    quiet: bool = False,
) -> dict:
    """Tune r = lr x T privately with the linear scaling rule, then train the final probe.

    Args:
      store: feature store with complete train and test splits.
      epsilon, delta: the total budget of the job, tuning included.
      eps0, eps1: budgets of the two search stages (default epsilon/20 and epsilon/10).
      trials: trials per stage.
      search: "random" (log-uniform r) or "grid" (geometric grid of r).
      r_range: range of r for the first stage.
      steps_choices: T values a trial's r is decomposed over (lr = r / T).
      final_steps: T of the final run (default: the largest of `steps_choices`).
      optimizer: update rule (Panda et al.: "momentum", 0.9).
      clip_norm, loss, normalization, groups: as for `run_probe`.
      validation_fraction: share of train held out to score trials.
      seed: seeds the validation split, r sampling and noise (default: OS entropy).

    Returns:
      A results dict: the chosen (lr, T, r), the fitted line, every trial with its validation
      accuracy, the final test accuracy, the validation split record, and the ledger (its PLD
      composition is the job's total epsilon).
    """
    import extract
    import probe
    from pipelines.jobs import VERSION, _now, _num_classes

    start_time = time.perf_counter()
    eps0 = epsilon / 20 if eps0 is None else eps0
    eps1 = epsilon / 10 if eps1 is None else eps1
    budget_split(epsilon, delta, eps0, eps1)  # fail fast on an impossible split

    # Load the store and carve the validation split.
    x, y, train_attrs = extract.load_split(store, "train", dtype=None)
    test_x, test_y, test_attrs = extract.load_split(store, "test", dtype=None)
    rng = np.random.default_rng(seed)
    train_idx, val_idx = _validation_split(len(y), validation_fraction, rng)
    train_x, train_y, val_x, val_y = x[train_idx], y[train_idx], x[val_idx], y[val_idx]
    num_classes = _num_classes(train_attrs, test_attrs, y, test_y)
    spec = probe.ProbeSpec(num_classes=num_classes, loss=loss, optimizer=optimizer,
                           normalization=normalization, groups=groups)
    # Independent noise for every mechanism (composition assumes it): with a seed, one child
    # seed per stage and one for the final run; without, fresh OS entropy each time.
    key_seeds = ([None] * 3 if seed is None else
                 [int(c.generate_state(1)[0]) for c in np.random.SeedSequence(seed).spawn(3)])
    stage_index = iter(range(2))

    # Search: two stages, every trial recorded in the ledger.
    ledger = accounting.PrivacyLedger()

    def run_stage(settings, plans):
        runs = [probe.RunSpec(p, t.learning_rate) for t, p in zip(settings, plans, strict=True)]
        if not quiet:
            print(f"tune: {len(runs)} trials, r in [{min(t.r for t in settings):.3g}, "
                  f"{max(t.r for t in settings):.3g}]", file=sys.stderr)
        keys = probe.make_keys(len(runs), key_seeds[next(stage_index)])
        result = probe.train_probe(train_x, train_y, runs, keys, spec, progress=not quiet)
        metrics = probe.evaluate(result.params, val_x, val_y, normalization=normalization,
                                 groups=groups)
        return metrics["top1"]

    line = search_line(run_stage, epsilon=epsilon, delta=delta, eps0=eps0, eps1=eps1,
                       trials=trials, r_range=r_range, steps_choices=steps_choices,
                       search=search, clip_norm=clip_norm, rng=rng, ledger=ledger)
    budget, stages = line["budget"], line["stages"]

    # Final run: the remaining budget, r* decomposed as lr x T. For full-batch GD the noise the
    # weights accumulate is ~ lr sqrt(T) sigma C / N = r C / (mu N): it depends on r, not on
    # how r splits into lr x T, so the final run takes the most steps (the best optimizer).
    steps = final_steps or max(steps_choices)
    sigma = math.sqrt(steps) / budget["mu_final"]
    plan = accounting.DpPlan(sigma, steps, 1.0, clip_norm)
    learning_rate = line["r_star"] / steps
    ledger.record("final", plan, role="final", r=line["r_star"], learning_rate=learning_rate)
    final = probe.train_probe(train_x, train_y, [probe.RunSpec(plan, learning_rate)],
                              probe.make_keys(1, key_seeds[2]), spec,
                              progress=not quiet)

    # Evaluate the final model on test (the only use of test).
    metrics = probe.evaluate(final.params, test_x, test_y, normalization=normalization,
                             groups=groups)

    # Record.
    total = ledger.epsilon(delta)
    stage_records = [
        {
            "stage": index,
            "epsilon_stage": stage.epsilon_stage,
            "epsilon_per_trial": stage.epsilon_per_trial,
            "best_r": stage.best_r,
            "trials": [
                {"r": t.r, "learning_rate": t.learning_rate, "steps": t.steps,
                 "noise_multiplier": p.noise_multiplier, "validation_accuracy": float(s)}
                for t, p, s in zip(stage.trials, stage.plans, stage.scores, strict=True)
            ],
        }
        for index, stage in enumerate(stages)
    ]
    return {
        "dpprobe_version": VERSION,
        "job": "tune",
        "created": _now(),
        "store": str(store),
        "provenance": {"train": train_attrs, "test": {k: test_attrs.get(k) for k in (
            "split", "num_examples", "dataset", "backbone", "complete")}},
        "probe": spec.to_dict(),
        "method": "linear scaling rule (Panda et al. 2023, Alg. 1), full-batch DP-SGD",
        "privacy": {
            "epsilon_requested": epsilon,
            "delta": delta,
            "epsilon_total": total,
            "accountant": "pld",
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "covers": f"the {len(train_idx)} training examples outside the validation split",
            "eps0": eps0,
            "eps1": eps1,
            "epsilon_final_alone": budget["epsilon_final"],
            "noise_keys": "os-entropy" if seed is None else f"seeded ({seed})",
        },
        "validation": {
            "fraction": validation_fraction,
            "num_examples": int(len(val_idx)),
            "num_train": int(len(train_idx)),
            "indices_sha256": hashlib.sha256(val_idx.astype(np.int64).tobytes()).hexdigest(),
            "split_seed": seed,
            "note": "held out of all training; used without noise to select r, so not "
                    "covered by the guarantee",
        },
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
                  "optimizer": optimizer, "learning_rate": learning_rate, "seed": 0,
                  "test_accuracy": float(metrics["top1"][0]), "accountant": "pld",
                  "includes_tuning": True}],
        "ledger": ledger.to_dict(delta),
        "params": final.params,
        "wall_seconds": time.perf_counter() - start_time,
    }
