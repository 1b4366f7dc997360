"""The tune job: private hyperparameter search with the linear scaling rule on a feature store
(`probe.search`: the algorithm, and whether a search pays), then the final probe, ledger.
`linear_scaling_search` reads as the steps it takes (`probe.search_steps`)."""

from __future__ import annotations

import numpy as np

from dpprobe import accounting, checks, files, model_files, preflight, timings
from dpprobe.messages import log
from dpprobe.pipelines.reporting import PRIVACY_EPILOG, format_table, warning_lines
from dpprobe.pipelines.tune_config import TuneConfig
from dpprobe.probe import search_steps as steps
from dpprobe.probe.search_calls import load_public_validation, private_standardization

__all__ = [
    "TuneConfig", "linear_scaling_search", "load_public_validation", "private_standardization",
    "run_tune", "tune_report",
]


# `dpprobe tune`'s parser texts (help, description, epilog).
TEXTS = dict(
    allow_abbrev=False,  # `--seed` must not silently mean `--seeds`
    help="private hyperparameter search (linear scaling rule) + final probe",
    description="Panda et al.'s linear scaling rule: search r = lr x T at budgets eps0 "
    "and eps1, fit r = alpha * epsilon + b, extrapolate, train the final full-batch "
    "DP-SGD probe with the remaining budget. The total epsilon includes every trial.",
    epilog=PRIVACY_EPILOG.format(""),
)


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


def tune_report(results: dict) -> str:
    """The recipe, trials, the fitted line, the final run and the ledger, for the terminal."""
    spec, standardization = results["probe"], results.get("standardization")
    normalization = spec["normalization"] + (
        f" ({spec['groups']} groups)" if spec["normalization"] == "group" else "")
    standardization = standardization or {}
    lines = [f"recipe: per-example normalization {normalization}, "
             + ("no standardization" if "epsilon" not in standardization else
                f"private feature standardization (epsilon {standardization['epsilon']:.4g})")
             + f", {spec['optimizer']}"
             + (f"; standardization {standardization['decision']}"
                if standardization.get("decision") else "")]
    for stage in results["stages"]:
        lines.append(f"stage {stage['stage']}: epsilon {stage['epsilon_stage']:.4g} for the "
                     f"stage ({stage['epsilon_per_trial']:.4g} per trial), best r = "
                     f"{stage['best_r']:.4g}")
        rows = [t | {"score": f"{100 * t['score']:.2f}"} for t in stage["trials"]]
        lines.append(format_table(rows, [
            ("r", "r"), ("lr", "learning_rate"), ("steps", "steps"),
            ("noise mult", "noise_multiplier"), ("score % (DP)", "score")]))
    line, chosen, final = results["line"], results["chosen"], results["final"]
    lines.insert(1, results["search"].get("decision") or "")
    if results["stages"]:
        lines.append(_line_report(line, results["privacy"]["epsilon_final_alone"]))
    else:
        lines.append(f"default recipe: r = {line['r_star']:.4g} (the linear scaling rule "
                     f"r = 0.011 x mu x N at the final run's epsilon "
                     f"{results['privacy']['epsilon_final_alone']:.4g})")
    lines.append(f"final run: lr = {chosen['learning_rate']:.4g}, T = {chosen['steps']}, "
                 f"noise multiplier = {chosen['noise_multiplier']:.4g} -> test accuracy "
                 f"{100 * final['test_accuracy']:.2f}%"
                 + (f" (top-5 {100 * final['test_top5_accuracy']:.2f}%)"
                    if results["probe"]["num_classes"] > 5 else ""))
    privacy = results["privacy"]
    lines.append(f"selection: {results['selection']['scoring']}")
    lines.append(f"total epsilon (tuning and selection included) = "
                 f"{privacy['epsilon_total']:.4f} <= requested {privacy['epsilon_requested']:g}, "
                 f"delta = {privacy['delta']:g}, {privacy['neighboring_relation_text']}; covers "
                 f"{privacy['covers']}")
    ledger = results["ledger"]
    lines.append(f"privacy ledger: {ledger['num_mechanisms']} mechanisms, PLD composition "
                 f"epsilon = {ledger['epsilon']:.4f}; Gaussian DP mu = {ledger['gdp_mu']:.4g} "
                 f"(epsilon {ledger['gdp_epsilon']:.4f}); basic composition epsilon = "
                 f"{ledger['basic_composition_epsilon']:.4f}")
    return "\n".join(lines + warning_lines(results))


def _line_report(line: dict, epsilon_final: float) -> str:
    """The fitted line and r*, and, when r* was clipped, what that means and what to do."""
    kind = line.get("extrapolation", "linear")
    fit = (f"r = {line['alpha']:.4g} * epsilon + {line['b']:.4g}" if kind != "log"
           else f"r = r1 (epsilon / eps1)^{line['exponent']:.3g}")
    text = (f"linear scaling ({kind}): {fit} -> r* = {line['r_star']:.4g} at the final run's "
            f"epsilon {epsilon_final:.4g}"
            + (" (fit not positive: kept stage 1's best r)" if line["fallback_used"] else ""))
    if line.get("clipped"):
        low, high = line["searched"]
        above = (line.get("r_line") or line["r_star"]) > line["r_star"]
        text += (f"\n  the line gave r = {line.get('r_line', float('nan')):.4g}, "
                 f"{'above' if above else 'below'} the r the search tried "
                 f"([{low:.3g}, {high:.3g}]), so the final run uses {line['r_star']:.4g}, the "
                 "nearest r it tried: an r the search never scored would be a guess. If the "
                 f"trials' best r sat at that edge, rerun with --r-{'max' if above else 'min'} "
                 f"{(high * 3) if above else (low / 3):.3g} to search further, or "
                 "--extrapolation linear to follow the line")
    return text
