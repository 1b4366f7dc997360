"""The steps of `linear_scaling_search`, in the order it takes them, each named after what it
does in Panda et al. 2023, Alg. 1 or in the choices Alg. 1 leaves open:

  load_store          the train and test splits (Alg. 1's X = F(D): the features are extracted)
  decide_search       whether a search pays, from public quantities (`search.decide_search`)
  split_data          what trains the trials and what scores them ("train", "holdout", "public")
  probe_spec          the linear model: per-example normalization from the store's backbone
  plan_budget         mu of every mechanism (Gaussian DP) and the noise of the selection counts
  standardize         the private feature standardization, recorded in the ledger
  trainer             training runs on the training part (standardized, then folded back)
  stage_runner        one search stage: train its trials, score them (noisy counts, recorded)
  total_step_size     Alg. 1's two searches, the line r = alpha epsilon + b and r* at eps_f
                      (`search.search_line`), or the default recipe's r without a search
  final_run           Alg. 1's last steps: r* = lr x T, sigma calibrated, one training run
  record              the results: DP outputs and public inputs only

Host work and accounting stay here; `probe` (JAX) is imported on first use (`search_calls`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from dpprobe import accounting, extract
from dpprobe.accounting import records
from dpprobe.messages import log
from dpprobe.probe import recipe, search
from dpprobe.probe.search_calls import (
    correct_counts,
    load_public_validation,
    private_standardization,
    test_metrics,
    train_runs,
)

__all__ = ["SCORING", "Budget", "FinalRun", "Parts", "Standardization", "StoreData",
           "decide_search", "final_run", "load_store", "plan_budget", "probe_spec", "record",
           "split_data", "stage_runner", "standardize", "total_step_size", "trainer"]

SCORING = {
    "train": "noisy correct counts on the training data (Gaussian, sensitivity 1), composed "
             "with training",
    "holdout": "noisy correct counts on a held-out validation part (Gaussian, sensitivity 1); "
               "the parts compose in parallel",
    "public": "exact accuracy on a validation set declared public by the user",
}


class StoreData(NamedTuple):
    """The store's splits as loaded (features in their stored dtype)."""

    x: np.ndarray
    y: np.ndarray
    train_attrs: dict
    test_x: np.ndarray
    test_y: np.ndarray
    test_attrs: dict
    num_classes: int
    warnings: list


class Parts(NamedTuple):
    """What trains the trials (and the final run) and what scores the trials, and the names
    the ledger gives those parts of the data."""

    train_x: np.ndarray
    train_y: np.ndarray
    score_x: np.ndarray
    score_y: np.ndarray
    training_data: str
    scored_data: str


class Budget(NamedTuple):
    """mu of every mechanism (`search.budget_split` or `search.final_budget`), whether to
    standardize and its budget (None: not standardized), the noise of each selection count."""

    mu: dict
    standardize: bool
    eps_standardize: float | None
    count_sigma: float


class Standardization(NamedTuple):
    """The released standardizer (None: none), the spec the models train with, and why."""

    standardizer: Any
    train_spec: Any
    why: str


class FinalRun(NamedTuple):
    """The final run's plan and learning rate, the model it trained and its test metrics."""

    plan: accounting.DpPlan
    learning_rate: float
    params: dict
    metrics: dict


def load_store(config) -> StoreData:
    """Both splits of the store, its declared class count, and the warnings a user must see."""
    x, y, train_attrs = extract.load_split(config.store, "train", dtype=None)
    test_x, test_y, test_attrs = extract.load_split(config.store, "test", dtype=None)
    num_classes = records.declared_num_classes(train_attrs, test_attrs)
    warnings = records.warnings(train_attrs, delta=config.delta, num_examples=len(y))
    for warning in warnings:
        log(f"tune: warning: {warning}", config.quiet)
    return StoreData(x, y, train_attrs, test_x, test_y, test_attrs, num_classes, warnings)


def decide_search(config, data: StoreData) -> tuple[search.SearchDecision, tuple | None]:
    """Search or not, decided from public quantities (N, the scored part's size, the budgets),
    and the public validation set (features, labels) when one is declared."""
    selection, y = config.selection, data.y
    public = config.public_validation
    if selection == "public" and isinstance(public, str):
        public = load_public_validation(public, data.x.shape[-1])
    num_scored = {"holdout": max(1, round(config.validation_fraction * len(y))),
                  "public": len(public[1]) if public is not None else 0}.get(selection, len(y))
    num_trained = len(y) - num_scored if selection == "holdout" else len(y)
    decision = (search.decide_search(
        num_trained=num_trained, num_scored=num_scored, epsilon=config.epsilon,
        delta=config.delta, eps0=config.eps0, eps_select=config.eps_select,
        trials=config.trials, scoring=selection) if config.search == "auto"
        else search.SearchDecision(
            config.search != "none", f"{'no ' * (config.search == 'none')}search: asked for "
            f"(--search {config.search})", None, 0.0))
    log(f"tune: {decision.reason}", config.quiet)
    return decision, public


def split_data(config, data: StoreData, public, searching: bool, rng) -> Parts:
    """The part the trials and the final run train on and the part the trials are scored on:
    a holdout split drawn by `rng` independently of the data, the public validation set, or
    the training data itself."""
    x, y = data.x, data.y
    if searching and config.selection == "holdout":
        train_idx, val_idx = search.validation_split(len(y), config.validation_fraction, rng)
        return Parts(x[train_idx], y[train_idx], x[val_idx], y[val_idx],
                     "train part", "validation part")
    if config.selection == "public":
        return Parts(x, y, *public, "all", "all")
    return Parts(x, y, x, y, "all", "all")


def probe_spec(config, data: StoreData):
    """The linear model the trials and the final run train: its normalization chosen from the
    store's backbone (public provenance) unless the config names one."""
    from dpprobe import probe

    normalization, groups, _ = recipe.normalization_for(
        config.normalization, config.groups, data.train_attrs.get("backbone"))
    return probe.ProbeSpec(num_classes=data.num_classes, loss=config.loss,
                           optimizer=config.optimizer, normalization=normalization,
                           groups=groups or 1)


def plan_budget(config, spec, parts: Parts, searching: bool) -> tuple[Budget, str]:
    """(`Budget`, why): whether to standardize and why, mu of every mechanism (Gaussian DP,
    exact) and the noise of the selection counts (each stage scores `trials` models,
    sensitivity 1 each)."""
    from dpprobe import probe

    bound = probe.normalized_norm_bound(spec.normalization, parts.train_x.shape[-1])
    standardize, why = recipe.decide_standardization(
        config.standardize, config.eps_standardize, config.delta, bound, len(parts.train_y))
    log(f"tune: private standardization {why}", config.quiet)
    eps_standardize = config.eps_standardize if standardize else None
    mu = (search.budget_split(config.epsilon, config.delta, config.eps0, config.eps1,
                              config.eps_select, eps_standardize) if searching
          else search.final_budget(config.epsilon, config.delta, eps_standardize))
    mu_count = (mu["mu"] * (1.0 - 1e-9) if config.selection == "holdout" else mu["mu_select"]
                ) if searching else None
    count_sigma = (math.sqrt(2 * config.trials) / mu_count
                   if searching and config.selection != "public" else 0.0)
    return Budget(mu, standardize, eps_standardize, count_sigma), why


def standardize(spec, parts: Parts, budget: Budget, why: str, ledger: accounting.PrivacyLedger
                ) -> tuple[Standardization, Parts]:
    """Private feature standardization (Tramer & Boneh's data normalization): two Gaussian
    releases on the training rows, in the ledger. Models train on the standardized features
    and are folded back (`Standardizer.fold`), so that every model scored, tested or saved
    applies to the features with the per-example normalization alone. Returns it and the parts
    with the training features standardized."""
    if not budget.standardize:
        return Standardization(None, spec, why), parts
    from dpprobe import probe

    normalized = probe.prepare_features(parts.train_x, spec)
    standardizer, plan = private_standardization(normalized, parts.train_y, spec,
                                                 budget.mu["mu_standardize"])
    ledger.record("standardization", plan, role="standardization", data=parts.training_data,
                  mechanism="Gaussian noise on the sums of the clipped features and of "
                            "their clipped absolute deviations (two releases)")
    train_x = standardizer.apply(normalized)
    train_spec = dataclasses.replace(spec, normalization="none", groups=1)
    return Standardization(standardizer, train_spec, why), parts._replace(train_x=train_x)


def trainer(parts: Parts, standardization: Standardization, quiet: bool
            ) -> Callable[[list], dict]:
    """Train a list of `probe.RunSpec`s on the training part; params for unstandardized
    features."""
    standardizer = standardization.standardizer

    def train(runs):
        params = train_runs(parts.train_x, parts.train_y, runs, standardization.train_spec,
                            quiet)
        return params if standardizer is None else standardizer.fold(params)

    return train


def stage_runner(config, spec, parts: Parts, budget: Budget, train: Callable,
                 ledger: accounting.PrivacyLedger) -> Callable:
    """`run_stage(stage, settings, plans)` for `search.search_line`: train each trial, score
    it on the scored part (noisy counts, recorded in the ledger, unless the part is public)."""
    from dpprobe import probe

    selection, count_sigma = config.selection, budget.count_sigma

    def run_stage(stage, settings, plans):
        runs = [probe.RunSpec(p, t.learning_rate) for t, p in zip(settings, plans, strict=True)]
        log(f"tune: stage {stage}, {len(runs)} trials, r in [{min(t.r for t in settings):.3g}, "
            f"{max(t.r for t in settings):.3g}]", config.quiet)
        params = train(runs)
        counts = correct_counts(params, parts.score_x, parts.score_y,
                                None if selection == "public" else count_sigma, spec)
        if selection != "public":
            ledger.record(f"stage{stage}-selection", accounting.DpPlan(count_sigma, len(runs)),
                          role="selection", data=parts.scored_data,
                          mechanism="Gaussian noise on each trial's correct count "
                                    "(sensitivity 1)")
        return counts / len(parts.score_y)

    return run_stage


def total_step_size(config, searching: bool, run_stage: Callable, parts: Parts, budget: Budget,
                    rng, ledger: accounting.PrivacyLedger) -> dict:
    """r* for the final run: Alg. 1's two searches, line and extrapolation (`search.search_line`,
    every trial in the ledger), or without a search the default recipe's r
    (`probe.recipe`) at the final run's epsilon."""
    if not searching:
        return {"stages": [], "r_star": recipe.total_step_size(
            budget.mu["epsilon_final"], config.delta, len(parts.train_y))}
    return search.search_line(
        run_stage, epsilon=config.epsilon, delta=config.delta, eps0=config.eps0,
        eps1=config.eps1, trials=config.trials, r_range=config.r_range,
        steps_choices=config.steps_choices, search=config.search.replace("auto", "random"),
        clip_norm=config.clip_norm, rng=rng, ledger=ledger, eps_select=config.eps_select,
        training_data=parts.training_data, extrapolation=config.extrapolation,
        eps_standardize=budget.eps_standardize)


def final_run(config, spec, data: StoreData, parts: Parts, budget: Budget, r_star: float,
              train: Callable, ledger: accounting.PrivacyLedger) -> FinalRun:
    """Alg. 1's final run on the remaining budget: r* decomposed as lr x T, sigma calibrated to
    mu_final, one training run, then the test metrics (the test split is public; its only use).

    For full-batch GD the noise the weights accumulate is ~ lr sqrt(T) sigma C / N = r C / (mu
    N): it depends on r, not on how r splits into lr x T, so the final run takes the most steps
    (the best optimizer)."""
    from dpprobe import probe

    steps = config.final_steps or max(config.steps_choices)
    sigma = math.sqrt(steps) / budget.mu["mu_final"]
    plan = accounting.DpPlan(sigma, steps, 1.0, config.clip_norm)
    learning_rate = r_star / steps
    log(f"tune: final run, r = {r_star:.4g} (lr {learning_rate:.4g} x T {steps}) at "
        f"epsilon {budget.mu['epsilon_final']:.4g}", config.quiet)
    ledger.record("final", plan, role="final", data=parts.training_data, r=r_star,
                  learning_rate=learning_rate)
    params = train([probe.RunSpec(plan, learning_rate)])
    metrics = test_metrics(params, data.test_x, data.test_y, spec)
    return FinalRun(plan, learning_rate, params, metrics)


def record(config, data: StoreData, decision: search.SearchDecision, parts: Parts, spec,
           standardization: Standardization, budget: Budget, line: dict, final: FinalRun,
           ledger: accounting.PrivacyLedger) -> dict:
    """The results: DP outputs and public inputs only (and "params", "standardizer", the final
    model, which the caller takes out)."""
    epsilon, delta, selection = config.epsilon, config.delta, config.selection
    searching, standardizer = decision.search, standardization.standardizer
    eps_standardize, why = budget.eps_standardize, standardization.why
    plan, learning_rate, metrics = final.plan, final.learning_rate, final.metrics
    steps, sigma = plan.steps, plan.noise_multiplier
    total = ledger.epsilon(delta)
    return records.header("tune", config.store, data.train_attrs, data.test_attrs) | {
        "probe": spec.to_dict(),
        "standardization": {"decision": why} if standardizer is None else (
            {"epsilon": eps_standardize, "data": parts.training_data, "decision": why}
            | standardizer.to_dict()),
        "method": ("linear scaling rule (Panda et al. 2023, Alg. 1), full-batch DP-SGD"
                   if searching else "the default recipe's r (no search), full-batch DP-SGD"),
        "warnings": data.warnings,
        "privacy": {
            "epsilon_requested": epsilon,
            "delta": delta,
            "epsilon_total": total,
            "accountant": "pld",
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
            "covers": "every record of the store's train split (tuning, selection and the "
                      "final run included)",
            "eps0": config.eps0 if searching else None,
            "eps1": config.eps1 if searching else None,
            "eps_select": config.eps_select if searching else None,
            "eps_standardize": eps_standardize,
            "epsilon_final_alone": budget.mu["epsilon_final"],
        } | records.randomness(config.seed, "the r proposals" + (
            " and the holdout split" if selection == "holdout" else "")),
        "selection": {"kind": selection if searching else None,
                      "scoring": SCORING[selection] if searching else "none (no search)",
                      "count_noise_std": budget.count_sigma if selection != "public" else None,
                      "num_scored": int(len(parts.score_y)),
                      "num_trained": int(len(parts.train_y))}
        | ({"validation_fraction": config.validation_fraction}
           if searching and selection == "holdout" else {}),
        "search": {"kind": config.search.replace("auto", "random") if searching else "none",
                   "asked": config.search, "decision": decision.reason,
                   "score_noise": decision.score_noise,
                   "trials_per_stage": config.trials,
                   "extrapolation": config.extrapolation,
                   "r_range": list(config.r_range), "steps_choices": list(config.steps_choices)},
        "stages": _stage_records(line["stages"]),
        "line": {"extrapolation": config.extrapolation, "alpha": line["alpha"], "b": line["b"],
                 "exponent": line["exponent"], "r_star": line["r_star"],
                 "r_line": line.get("r_line"), "searched": list(line["searched"]),
                 "clipped": line["clipped"], "fallback_used": line["fallback"] is not None}
        if searching else {"rule": "default recipe: r = recipe.total_step_size(epsilon of the "
                                   "final run, delta, N)", "r_star": line["r_star"]},
        "chosen": {"r": line["r_star"], "learning_rate": learning_rate, "steps": steps,
                   "noise_multiplier": sigma},
        "final": {"test_accuracy": float(metrics["top1"][0]),
                  "test_top5_accuracy": float(metrics["top5"][0]),
                  "per_class_accuracy": metrics["per_class"][0].tolist(),
                  "epsilon_alone": plan.epsilon(delta)},
        "runs": [{"epsilon": total, "delta": delta, "noise_multiplier": sigma, "steps": steps,
                  "optimizer": config.optimizer, "learning_rate": learning_rate,
                  "test_accuracy": float(metrics["top1"][0]), "accountant": "pld",
                  "includes_tuning": True}],
        "ledger": ledger.to_dict(delta),
        "params": final.params,
        "standardizer": standardizer,
    }


def _stage_records(stages) -> list[dict]:
    return [
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
