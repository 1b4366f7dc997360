"""The probe job: a sweep of DP linear probes over epsilons x steps x learning rates x seeds on a
feature store, trained in one program, evaluated on the test split, recorded with its ledger."""

from __future__ import annotations

import itertools
import math

from dpprobe import (
    accounting,
    checks,
    files,
    model_files,
    plots,
    preflight,
    probe,
    timings,
)
from dpprobe.accounting import records
from dpprobe.messages import format_epsilon, log
from dpprobe.multihost import processes
from dpprobe.pipelines.probe_config import MAX_RUNS, ProbeConfig
from dpprobe.pipelines.reporting import (
    TRAINING_TEXTS,
    format_table,
    pm,
    same_epsilon,
    warning_lines,
)
from dpprobe.probe import recipe, store_runs
from dpprobe.probe import results as probe_results

__all__ = [
    "CSV_COLUMNS", "MAX_RUNS", "OUTPUTS", "ProbeConfig", "probe_job", "probe_table", "run_probe",
]

CSV_COLUMNS = ("epsilon", "epsilon_spent", "delta", "noise_multiplier", "clip_norm", "steps",
               "sampling_probability", "optimizer", "learning_rate", "replicate",
               "test_accuracy", "test_top5_accuracy", "accountant", "neighboring_relation",
               "guarantee")
# The fields that name outputs: only process 0 of a multi-process job writes them.
OUTPUTS = ("out", "csv", "plot", "diagnostics", "save_model")


# `dpprobe probe`'s parser texts (help, description, epilog).
TEXTS = dict(
    TRAINING_TEXTS,
    help="train DP linear probes on a feature store over a sweep of epsilons",
    description="Full-batch DP linear probe (zero init) for every epsilon x steps x lr x "
    "seed, in one compiled program; prints test accuracy mean ± std over seeds.",
)


def run_probe(config: ProbeConfig | str, /, **options) -> dict:
    """Sweep DP linear probes on a store: `run_probe(ProbeConfig(...))`, or
    `run_probe(store, epsilons=..., delta=..., ...)` with the config's fields as keywords.

    Noise multipliers are calibrated to (epsilon, delta) for zero-out neighbours (N public), and
    each run's `epsilon_spent` is computed from its `DpEvent` by `accountant`. Noise keys and
    batch sampling always draw from OS entropy.

    Returns:
      The results dict (also written to `out` as JSON when given).
    """
    return probe_job(config, **options)[0]


def probe_job(config: ProbeConfig | str, /, **options) -> tuple[dict, list]:
    """`run_probe`, and its models in memory: (the results dict, a (file name, arrays,
    document) per model, as `save_model` would write them (`model_files.probe_model_parts`))."""
    config = checks.make_config(ProbeConfig, config, "store", **options)
    processes.start(config)  # a multi-process job: only process 0 writes outputs
    config = processes.writer_config(config, OUTPUTS)
    preflight.check_probe_job(config)
    stopwatch = timings.Stopwatch()
    store, quiet = config.store, config.quiet
    train_attrs, test_attrs = store_runs.split_attrs(store)
    num_examples = int(train_attrs["num_examples"])
    dim = int(train_attrs["feature_shape"][-1])
    stream = config.stream
    if stream is None:
        stream = store_runs.too_big_for_memory(
            num_examples * math.prod(train_attrs["feature_shape"]) * 4)
    if stream and config.sampling_probability < 1.0:
        raise ValueError("Poisson subsampling (q < 1) needs the train split in memory")
    processes.check_rows(num_examples)
    if processes.active() and (config.sampling_probability < 1.0 or (config.devices or 1) > 1):
        raise ValueError("a multi-process probe trains full batch on every device of every "
                         "process: drop `sampling_probability` and `devices`")
    if config.devices and config.devices > 1 and (stream or config.sampling_probability < 1.0):
        raise ValueError("`devices` shards in-memory full-batch training; it does not combine "
                         "with `stream` or `sampling_probability` < 1")
    test_bytes = int(test_attrs["num_examples"]) * math.prod(test_attrs["feature_shape"]) * 4
    test_in_memory = not stream and not store_runs.too_big_for_memory(test_bytes)
    train_x, train_y, test_chunks = store_runs.read_splits(store, stream=stream,
                                                 test_in_memory=test_in_memory,
                                                 num_examples=num_examples)
    delta, accountant = config.delta, config.accountant
    num_classes = records.declared_num_classes(train_attrs, test_attrs)
    # The recipe: what the config gives, else chosen from public quantities (probe.recipe).
    chosen = recipe.probe_recipe(config, train_attrs, num_examples,
                                 store_runs.sweep_cost(config, train_attrs, num_classes, stream))
    log(chosen.describe(config.epsilons), quiet)
    warnings = records.warnings(train_attrs, delta=delta, num_examples=num_examples)
    for warning in warnings:
        log(f"warning: {warning}", quiet)
    spec = probe.ProbeSpec(num_classes=num_classes, loss=config.loss, optimizer=chosen.optimizer,
                           bias_init=config.bias_init, normalization=chosen.normalization,
                           groups=chosen.groups or 1)

    # Calibrate the noise of each (epsilon, T). epsilon = inf is the same recipe without noise
    # (clipping kept): the reference isolates what the noise costs, at the same learning rate.
    plans = {}
    log(f"probe: calibrating the noise of {len(config.epsilons) * len(chosen.steps)} "
        "(epsilon, T) pair(s)", quiet)
    for epsilon, num_steps in itertools.product(config.epsilons, chosen.steps):
        plans[epsilon, num_steps] = accounting.calibrate_plan(
            epsilon, delta, steps=num_steps, sampling_probability=config.sampling_probability,
            clip_norm=config.clip_norm, accountant=accountant)

    # Train every config in one program, then test.
    grid = [(e, t, chosen.learning_rate(e, t, lr), k) for e, t, lr, k in itertools.product(
        config.epsilons, chosen.steps, chosen.learning_rates or (None,), range(config.seeds))]
    runs = [probe.RunSpec(plans[e, t], lr) for e, t, lr, _ in grid]
    log(f"probe: {len(runs)} run(s) on {num_examples} rows; the first step compiles", quiet)
    result, metrics, driver = store_runs.train_and_test(
        config, spec, runs, train_x, train_y, test_chunks, stream=stream,
        num_examples=num_examples, dim=dim)

    # Record: DP outputs and public inputs only (accounting.records).
    run_records = [
        probe_results.run_record(config, chosen.optimizer, e, plans[e, t], lr, k, metrics, i)
        for i, (e, t, lr, k) in enumerate(grid)]
    # Every run touched the same training data: choosing among them, or reporting a summary of
    # several, spends their composition. The summary rows say what each aggregate costs.
    ledger = accounting.PrivacyLedger()
    for (epsilon, num_steps, lr, replicate), run in zip(grid, runs, strict=True):
        ledger.record(f"epsilon={epsilon:g} T={num_steps} lr={lr:g} replicate={replicate}",
                      run.plan, role="private" if run.plan.is_private else "non-private reference")
    summary = probe_results.summarize_runs(run_records, ("epsilon", "steps", "learning_rate"),
                                       ("test_accuracy", "test_top5_accuracy"))
    for row in summary:
        row["epsilon_row"] = probe_results.composed_epsilon(plans[row["epsilon"], row["steps"]],
                                               row["num_seeds"], delta, accountant)
        row["series"] = (f"T={row['steps']}, lr = r(epsilon) / T (linear scaling rule)"
                         if chosen.scaled else None)
    q = config.sampling_probability
    results = records.header("probe", store, train_attrs, test_attrs) | {
        "probe": spec.to_dict() | {"driver": driver},
        "recipe": chosen.to_dict(config.epsilons),
        "warnings": warnings,
        "privacy": {
            "delta": delta,
            "accountant": accountant,
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
            "dataset_size_public": True,
            "sampling": "full batch (q = 1)" if q == 1.0 else f"Poisson, q = {q:g}",
            "non_private_reference": any(not p.is_private for p in plans.values()),
        } | records.randomness(None, ""),
        "num_train": num_examples,
        "num_test": int(test_attrs["num_examples"]),
        "runs": run_records,
        "summary": summary,
        "ledger": ledger.to_dict(delta, accountant) | {
            "note": "each run alone is (epsilon_spent, delta)-DP; a summary row over seeds costs "
                    "epsilon_row (its runs composed); selecting among the runs by their results "
                    "spends the composition of all of them (epsilon)"},
    }
    if config.diagnostics:
        probe_results.write_diagnostics(config.diagnostics, grid, result, train_attrs)
        log(f"wrote {config.diagnostics}", quiet)
    if config.out:
        files.write_json(config.out, results)
        log(f"wrote {config.out}", quiet)  # no duration: it depends on the records
    if config.csv:
        files.write_csv(config.csv, run_records, CSV_COLUMNS)
        log(f"wrote {config.csv}", quiet)
    if config.plot:
        plots.plot_accuracy(summary, config.plot, title=plots.plot_title(results),
                            warnings=warnings)
        log(f"wrote {config.plot}", quiet)
    models = model_files.probe_model_parts(config, results, grid, plans, result.params, spec,
                                           train_attrs)
    if config.save_model:
        results["model_files"] = model_files.probe_models(config.save_model, models)
        for path in results["model_files"]:
            log(f"wrote {path}", quiet)
    if config.out:  # the owner's, never published: how long depends on the records
        timings.write_timings(config.out, "probe", stopwatch, quiet=quiet)
    return results, models


def probe_table(results: dict) -> str:
    """The printed table: epsilon per run and of the row (its seeds composed), noise
    multiplier, steps, lr, accuracy mean ± std; the non-private reference labelled as such."""
    rows = []
    for row in results["summary"]:
        private = math.isfinite(row["epsilon"])
        rows.append(
            row
            | {
                "epsilon": row["epsilon"] if private else "inf: non-private, no guarantee",
                "acc": pm(row["test_accuracy_mean"], row["test_accuracy_std"]),
                "top5": pm(row["test_top5_accuracy_mean"], row["test_top5_accuracy_std"]),
            }
        )
    columns = [
        ("epsilon per run", "epsilon"),
        ("eps spent", "epsilon_spent"),
        ("eps of row (seeds composed)", "epsilon_row"),
        ("noise mult", "noise_multiplier"),
        ("steps", "steps"),
        ("lr", "learning_rate"),
        ("seeds", "num_seeds"),
        ("test acc % (mean ± std)", "acc"),
        ("top-5 %", "top5"),
    ]
    if (results.get("probe") or {}).get("num_classes", 6) <= 5:
        columns.pop()  # top-5 of at most 5 classes is always 100%: not shown
    if all(same_epsilon(row["epsilon"], row.get("epsilon_spent")) for row in results["summary"]):
        columns.remove(("eps spent", "epsilon_spent"))  # it would repeat the first column
    if all(row.get("num_seeds") == 1 for row in results["summary"]):
        columns.remove(("eps of row (seeds composed)", "epsilon_row"))  # so would this one
    privacy = results["privacy"]
    header = (
        f"delta={privacy['delta']:g}, accountant={privacy['accountant'].upper()}, "
        f"{privacy['neighboring_relation_text']}, {privacy['sampling']}; "
        f"N_train={results['num_train']}, N_test={results['num_test']}"
    )
    ledger = results["ledger"]
    private = sum(1 for e in ledger["entries"] if e["role"] == "private")
    footer = (f"all {private} private runs together (e.g. picking the best): epsilon = "
              f"{format_epsilon(ledger['epsilon_by_role'].get('private', 0.0))} at "
              f"delta={privacy['delta']:g}")
    if private < ledger["num_mechanisms"]:
        footer += "; the non-private reference has no guarantee"
    return "\n".join([header, format_table(rows, columns), footer, *warning_lines(results)])
