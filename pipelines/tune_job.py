"""The tune job: private hyperparameter search with the linear scaling rule on a feature store
(`pipelines.search`: the algorithm, and whether a search pays), then the final probe, ledger."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

import accounting
import extract
from pipelines import config as cfg
from pipelines import preflight, recipe, records, reporting, search
from pipelines.reporting import log
from pipelines.tune_calls import (
    correct_counts,
    load_public_validation,
    private_standardization,
    test_metrics,
    train_runs,
)
from pipelines.tune_config import TuneConfig

__all__ = ["TuneConfig", "linear_scaling_search", "load_public_validation",
           "private_standardization", "run_tune"]

SCORING = {
    "train": "noisy correct counts on the training data (Gaussian, sensitivity 1), composed "
             "with training",
    "holdout": "noisy correct counts on a held-out validation part (Gaussian, sensitivity 1); "
               "the parts compose in parallel",
    "public": "exact accuracy on a validation set declared public by the user",
}


def run_tune(config: TuneConfig | str, /, **options) -> dict:
    """`linear_scaling_search` on a store; writes results JSON (and the model file).

    Takes a `TuneConfig`, or the store and the config's fields as keywords.
    """
    config = cfg.make_config(TuneConfig, config, "store", **options)
    preflight.check_tune_job(config)
    results = linear_scaling_search(config)
    params, standardizer = results.pop("params"), results.pop("standardizer")
    if config.save_model:
        from pipelines import model_files

        model_files.tune_model(config, results, params, standardizer)
        results["model_file"] = str(config.save_model)
    if config.out:
        reporting.write_json(config.out, results)
    results["params"] = params
    return results


def linear_scaling_search(config: TuneConfig | str, epsilon: float | None = None,
                          delta: float | None = None, /, **options) -> dict:
    """Tune r = lr x T privately with the linear scaling rule, then train the final probe.

    `linear_scaling_search(TuneConfig(...))`, or `linear_scaling_search(store, epsilon, delta,
    ...)` with the config's other fields as keywords.

    Returns:
      A results dict: the chosen (lr, T, r), the fitted line, every trial with its (noisy)
      score, the final test accuracy and the ledger (its composition is the job's epsilon);
      plus "params", the final probe.
    """
    if not isinstance(config, TuneConfig):
        options |= {"epsilon": epsilon} if epsilon is not None else {}
        options |= {"delta": delta} if delta is not None else {}
    config = cfg.make_config(TuneConfig, config, "store", **options)
    start_time = time.perf_counter()
    epsilon, delta, selection, quiet = config.epsilon, config.delta, config.selection, config.quiet

    # Load the store; choose what trains and what scores.
    x, y, train_attrs = extract.load_split(config.store, "train", dtype=None)
    test_x, test_y, test_attrs = extract.load_split(config.store, "test", dtype=None)
    num_classes = records.declared_num_classes(train_attrs, test_attrs)
    warnings = records.warnings(train_attrs, delta=delta, num_examples=len(y))
    for warning in warnings:
        log(f"tune: warning: {warning}", quiet)
    rng = np.random.default_rng(config.seed)  # data-independent choices only
    # Search or not: decided from public quantities (N, the scored part's size, the budgets).
    public = config.public_validation
    if selection == "public" and isinstance(public, str):
        public = load_public_validation(public, x.shape[-1])
    num_scored = {"holdout": max(1, round(config.validation_fraction * len(y))),
                  "public": len(public[1]) if public is not None else 0}.get(selection, len(y))
    num_trained = len(y) - num_scored if selection == "holdout" else len(y)
    decision = (search.decide_search(
        num_trained=num_trained, num_scored=num_scored, epsilon=epsilon, delta=delta,
        eps0=config.eps0, eps_select=config.eps_select, trials=config.trials,
        scoring=selection) if config.search == "auto" else search.SearchDecision(
        config.search != "none", f"{'no ' * (config.search == 'none')}search: asked for "
        f"(--search {config.search})", None, 0.0))
    searching, search_kind = decision.search, config.search.replace("auto", "random")
    log(f"tune: {decision.reason}", quiet)
    training_data, scored_data = "all", "all"
    if searching and selection == "holdout":
        train_idx, val_idx = search._validation_split(len(y), config.validation_fraction, rng)
        train_x, train_y, score_x, score_y = x[train_idx], y[train_idx], x[val_idx], y[val_idx]
        training_data, scored_data = "train part", "validation part"
    elif selection == "public":
        train_x, train_y, (score_x, score_y) = x, y, public
    else:
        train_x, train_y, score_x, score_y = x, y, x, y
    import probe

    normalization, groups = config.normalization, config.groups
    if normalization is None:  # from the store's backbone: public provenance
        normalization, groups = recipe.backbone_normalization(train_attrs.get("backbone"))
    spec = probe.ProbeSpec(num_classes=num_classes, loss=config.loss, optimizer=config.optimizer,
                           normalization=normalization, groups=groups or 1)
    bound = probe.normalized_norm_bound(normalization, x.shape[-1])
    standardize, why = recipe.decide_standardization(
        config.standardize, config.eps_standardize, delta, bound, len(train_y))
    log(f"tune: private standardization {why}", quiet)
    eps_standardize = config.eps_standardize if standardize else None
    budget = (search.budget_split(epsilon, delta, config.eps0, config.eps1, config.eps_select,
                                  eps_standardize) if searching
              else search.final_budget(epsilon, delta, eps_standardize))
    # Noise of the counts, per stage (each stage scores `trials` models, sensitivity 1 each).
    mu_count = (budget["mu"] * (1.0 - 1e-9) if selection == "holdout" else budget["mu_select"]
                ) if searching else None
    count_sigma = (math.sqrt(2 * config.trials) / mu_count
                   if searching and selection != "public" else 0.0)

    ledger = accounting.PrivacyLedger()

    # Private feature standardization (Tramer & Boneh's data normalization): two Gaussian
    # releases on the training rows, in the ledger. Models train on the standardized features
    # and are folded back (`Standardizer.fold`), so that every model scored, tested or saved
    # applies to the features with the per-example normalization alone.
    standardizer, train_spec = None, spec
    if standardize:
        normalized = probe.prepare_features(train_x, spec)
        standardizer, plan = private_standardization(normalized, train_y, spec,
                                                     budget["mu_standardize"])
        ledger.record("standardization", plan, role="standardization", data=training_data,
                      mechanism="Gaussian noise on the sums of the clipped features and of "
                                "their clipped absolute deviations (two releases)")
        train_x = standardizer.apply(normalized)
        del normalized
        train_spec = dataclasses.replace(spec, normalization="none", groups=1)

    def train(runs):
        params = train_runs(train_x, train_y, runs, train_spec, quiet)
        return params if standardizer is None else standardizer.fold(params)

    # Search: two stages; every trial and every count recorded in the ledger.
    def run_stage(stage, settings, plans):
        runs = [probe.RunSpec(p, t.learning_rate) for t, p in zip(settings, plans, strict=True)]
        log(f"tune: stage {stage}, {len(runs)} trials, r in [{min(t.r for t in settings):.3g}, "
            f"{max(t.r for t in settings):.3g}]", quiet)
        params = train(runs)
        counts = correct_counts(params, score_x, score_y,
                                None if selection == "public" else count_sigma, spec)
        if selection != "public":
            ledger.record(f"stage{stage}-selection", accounting.DpPlan(count_sigma, len(runs)),
                          role="selection", data=scored_data,
                          mechanism="Gaussian noise on each trial's correct count "
                                    "(sensitivity 1)")
        return counts / len(score_y)

    if searching:
        line = search.search_line(
            run_stage, epsilon=epsilon, delta=delta, eps0=config.eps0, eps1=config.eps1,
            trials=config.trials, r_range=config.r_range, steps_choices=config.steps_choices,
            search=search_kind, clip_norm=config.clip_norm, rng=rng, ledger=ledger,
            eps_select=config.eps_select, training_data=training_data,
            extrapolation=config.extrapolation, eps_standardize=eps_standardize)
    else:  # the default recipe's r (pipelines.recipe) at the final run's epsilon
        line = {"stages": [], "r_star": recipe.total_step_size(budget["epsilon_final"], delta,
                                                               len(train_y))}

    # Final run: the remaining budget, r* decomposed as lr x T. For full-batch GD the noise the
    # weights accumulate is ~ lr sqrt(T) sigma C / N = r C / (mu N): it depends on r, not on
    # how r splits into lr x T, so the final run takes the most steps (the best optimizer).
    steps = config.final_steps or max(config.steps_choices)
    sigma = math.sqrt(steps) / budget["mu_final"]
    plan = accounting.DpPlan(sigma, steps, 1.0, config.clip_norm)
    learning_rate = line["r_star"] / steps
    log(f"tune: final run, r = {line['r_star']:.4g} (lr {learning_rate:.4g} x T {steps}) at "
        f"epsilon {budget['epsilon_final']:.4g}", quiet)
    ledger.record("final", plan, role="final", data=training_data, r=line["r_star"],
                  learning_rate=learning_rate)
    params = train([probe.RunSpec(plan, learning_rate)])
    metrics = test_metrics(params, test_x, test_y, spec)  # test is public; its only use

    # Record: DP outputs and public inputs only.
    total = ledger.epsilon(delta)
    return records.header("tune", config.store, train_attrs, test_attrs) | {
        "probe": spec.to_dict(),
        "standardization": {"decision": why} if standardizer is None else (
            {"epsilon": eps_standardize, "data": training_data, "decision": why}
            | standardizer.to_dict()),
        "method": ("linear scaling rule (Panda et al. 2023, Alg. 1), full-batch DP-SGD"
                   if searching else "the default recipe's r (no search), full-batch DP-SGD"),
        "warnings": warnings,
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
            "epsilon_final_alone": budget["epsilon_final"],
        } | records.randomness(config.seed, "the r proposals" + (
            " and the holdout split" if selection == "holdout" else "")),
        "selection": {"kind": selection if searching else None,
                      "scoring": SCORING[selection] if searching else "none (no search)",
                      "count_noise_std": count_sigma if selection != "public" else None,
                      "num_scored": int(len(score_y)),
                      "num_trained": int(len(train_y))}
        | ({"validation_fraction": config.validation_fraction}
           if searching and selection == "holdout" else {}),
        "search": {"kind": search_kind if searching else "none", "asked": config.search,
                   "decision": decision.reason, "score_noise": decision.score_noise,
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
        "params": params,
        "standardizer": standardizer,
        "wall_seconds": time.perf_counter() - start_time,
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
