"""The tune job: private hyperparameter search with the linear scaling rule on a feature store
(`probe.search`: the algorithm, and whether a search pays), then the final probe, ledger.
`linear_scaling_search` reads as the steps it takes (`probe.search_steps`)."""

from __future__ import annotations

import numpy as np

from dpprobe import accounting, checks, files, model_files, preflight, timings
from dpprobe.messages import log
from dpprobe.pipelines.tune_config import TuneConfig
from dpprobe.probe import search_steps as steps
from dpprobe.probe.search_calls import load_public_validation, private_standardization

__all__ = ["TuneConfig", "linear_scaling_search", "load_public_validation",
           "private_standardization", "run_tune"]


def run_tune(config: TuneConfig | str, /, **options) -> dict:
    """`linear_scaling_search` on a store; writes results JSON (and the model file).

    Takes a `TuneConfig`, or the store and the config's fields as keywords.
    """
    config = checks.make_config(TuneConfig, config, "store", **options)
    preflight.check_tune_job(config)
    stopwatch = timings.Stopwatch()
    results = linear_scaling_search(config)
    params, standardizer = results.pop("params"), results.pop("standardizer")
    if config.save_model:
        model_files.tune_model(config, results, params, standardizer)
        results["model_file"] = str(config.save_model)
        log(f"wrote {config.save_model}", config.quiet)
    if config.out:
        files.write_json(config.out, results)
        log(f"wrote {config.out}", config.quiet)
        # The owner's, never published: how long it took depends on the records.
        timings.write_timings(config.out, "tune", stopwatch, quiet=config.quiet)
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
    config = checks.make_config(TuneConfig, config, "store", **options)
    rng = np.random.default_rng(config.seed)  # data-independent choices only

    # Inputs: the store; search or not (public quantities); what trains, what scores.
    data = steps.load_store(config)
    decision, public = steps.decide_search(config, data)
    parts = steps.split_data(config, data, public, decision.search, rng)

    # The probe and the budget of every mechanism; private standardization (in the ledger).
    spec = steps.probe_spec(config, data)
    budget, why = steps.plan_budget(config, spec, parts, decision.search)
    ledger = accounting.PrivacyLedger()
    standardization, parts = steps.standardize(spec, parts, budget, why, ledger)
    train = steps.trainer(parts, standardization, config.quiet)

    # Alg. 1: two searches, the line through their best r, r* at the final run's epsilon
    # (every trial and every count in the ledger); without a search, the default recipe's r.
    run_stage = steps.stage_runner(config, spec, parts, budget, train, ledger)
    line = steps.total_step_size(config, decision.search, run_stage, parts, budget, rng, ledger)

    # Alg. 1's final run: r* = lr x T on the remaining budget, then the (public) test split.
    final = steps.final_run(config, spec, data, parts, budget, line["r_star"], train, ledger)

    # Record: DP outputs and public inputs only.
    return steps.record(config, data, decision, parts, spec, standardization, budget, line,
                        final, ledger)
