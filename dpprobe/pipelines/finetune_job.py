"""The finetune command: its run folder (one run at a time, a finished run kept), the run
(`finetune.job.finetune_run`), and what it writes: the model file, the owner's timings, the
results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from dpprobe import checks, extract, files, model_files, preflight, timings
from dpprobe.finetune import run_folder
from dpprobe.finetune.job import finetune_run
from dpprobe.finetune.own_model import own_module_name
from dpprobe.messages import log
from dpprobe.multihost import processes
from dpprobe.pipelines.finetune_config import FinetuneConfig
from dpprobe.pipelines.reporting import TRAINING_TEXTS, warning_lines

__all__ = ["FinetuneConfig", "finetune_audit_line", "finetune_line", "run_finetune"]

# In a finished run's --out: the options it ran with (private to its owner: they hold --seed).
OPTIONS_FILE = ".dpprobe-finetune-options.json"


# `dpprobe finetune`'s parser texts (help, description, epilog).
TEXTS = dict(
    TRAINING_TEXTS,
    help="train every weight of a backbone with DP-SGD on images",
    description="DP-SGD on a whole model (Flax NNX): Poisson-sampled batches, per-example "
    "clipping, augmentation multiplicity, EMA (De et al.; Beltran et al.). Reports the "
    "test accuracy at the (epsilon, delta) it spent.",
)


def run_finetune(config: FinetuneConfig | None = None, /, **options) -> dict:
    """DP-SGD finetuning of a whole model: `run_finetune(FinetuneConfig(...))` or the config's
    fields as keywords. Returns the results dict (also `out`/results.json).

    Formal guarantee: one run of the Poisson-sampled Gaussian (`accounting.DpPlan(sigma, T, q, C)`,
    sigma calibrated to (epsilon, delta) by `accountant`, zero-out neighbours, N public), on
    the parameters `train` names (the others are public constants: the initialization). Noise
    keys and batch sampling draw from OS entropy; the results hold only the DP outputs (the
    trained model, its test accuracy) and public inputs; the run's wall-clock timings go to
    the owner's `out`/results.timings.json (`dpprobe.timings`), which is not covered. With
    `non_private=True` there is NO guarantee (plan `DpPlan(0, T, q, inf)`, epsilon inf), and the
    results and model file say so.
    """
    config = checks.make_config(FinetuneConfig, config, "data", **options)
    processes.start(config)  # a multi-process job: only process 0 writes outputs
    multi, config = processes.active(), processes.writer_config(config, ("out",))
    if multi and config.audit_canaries:
        raise ValueError("`audit_canaries` needs a one-process job")
    if not config.out:
        return _train(config, None)
    out = Path(config.out)
    run_folder.check_outside_inputs(out, _input_paths(config))
    run_folder.check_checkpoint_folder(out / "checkpoint")
    for name in ("results.json", model_files.MODEL_FILE):
        preflight.check_output_paths(out=out / name)
    preflight.check_timings_file(out / "results.json")
    with run_folder.hold(out, "finetune"):  # one run at a time
        finished = _finished_run(out, config)
        if finished is not None and multi:  # the others would train on without it
            raise ValueError(f"{out} holds a finished run; give a new `out`")
        if finished is not None:
            # A run killed after its results and before removing its checkpoint: remove it.
            shutil.rmtree(out / "checkpoint", ignore_errors=True)
            log(f"already complete: {out / 'results.json'}", config.quiet)
            return finished
        return _train(config, out)


def _input_paths(config: FinetuneConfig) -> list[str]:
    """The local files and folders the job reads (its output must not be, nor lie in, one)."""
    paths = [config.data_dir, config.weights]
    for spec in (config.data, config.test_data):
        try:
            paths.append(extract.parse_data_spec(spec)[1] if spec else None)
        except ValueError:
            pass  # refused by the reader, in its own words
    return [p.partition("?")[0] for p in paths if p and os.path.exists(p.partition("?")[0])]


def _train(config: FinetuneConfig, out: Path | None) -> dict:
    """The run (`finetune.job.finetune_run`), its model file, timings and results written to
    `out` (held) when given."""
    stopwatch = timings.Stopwatch()
    options = _options(config)  # as given (a default model stays None: chosen again on rerun)
    run = finetune_run(config, None if out is None else out / "checkpoint", options)
    results = run.results
    if out is None:
        return results
    model_files.finetune_model(out / model_files.MODEL_FILE, results, run.model,
                               **run.model_file)
    results["model_file"] = str(out / model_files.MODEL_FILE)
    # The options before the results: a run killed between the two reruns, not refused.
    files.atomic_write_text(out / OPTIONS_FILE, json.dumps(options))
    os.chmod(out / OPTIONS_FILE, 0o600)  # the seed drives the audit's coins: not published
    # The owner's, never published (how long the run took depends on its records): the
    # first step run (it compiles the step) and the expected images (q N per step) per
    # second over the steps after it (`finetune.timing`). Before the results, whose
    # presence marks a finished run.
    timings.write_timings(out / "results.json", "finetune", stopwatch, quiet=config.quiet,
                          compile_seconds=run.trained.compile_seconds,
                          images_per_second=run.trained.images_per_second)
    files.write_json(out / "results.json", results)
    if run.checkpointer is not None:
        run.checkpointer.close()
        shutil.rmtree(out / "checkpoint")  # it holds the noise key: gone once done
    for path in (model_files.MODEL_FILE, "results.json"):
        log(f"wrote {out / path}", config.quiet)
    log(f"wrote {out / OPTIONS_FILE} (the run's options, for its rerun: yours only)",
        config.quiet)
    return results




def _options(config: FinetuneConfig) -> dict:
    """The options that make a run what it is (not where it writes, not how much it prints)."""
    config = dataclasses.replace(config, model=own_module_name(config.model))
    return json.loads(json.dumps(dataclasses.asdict(config) | {"quiet": None, "out": None},
                                 default=str))


def _finished_run(out: Path, config: FinetuneConfig) -> dict | None:
    """The results of the finished run in `out` when it ran with `config`'s options; None when
    `out` holds no finished run. A finished run with other options is refused (one line)."""
    results_file = out / "results.json"
    if not results_file.is_file():
        return None
    try:
        results = json.loads(results_file.read_text())
        finished = results.get("job") == "finetune"
    except (OSError, ValueError, AttributeError):
        return None  # not a run of ours: the output checks refuse it
    if not finished:
        return None
    try:
        previous = json.loads((out / OPTIONS_FILE).read_text())
    except (OSError, ValueError):
        previous = None
    if previous != _options(config):
        differ = ("" if not isinstance(previous, dict) else " (differs in: " + ", ".join(
            sorted(k for k in set(previous) | set(_options(config))
                   if previous.get(k) != _options(config).get(k))) + ")")
        hint = ""
        if isinstance(previous, dict) and previous.get("model") and config.model is None:
            hint = (f" (that run trained model {previous['model']}, and a run naming no model "
                    f"now gets the default for its image size: add `--model "
                    f"{previous['model']}` for that run)")
        raise ValueError(f"{out} holds a finished finetune run with other options{differ}; "
                         f"give a new `out` to train another model{hint}")
    return results | {"already_complete": str(results_file)}


def finetune_line(results: dict) -> str:
    """One line: the model, its test accuracy (and its EMA's) and the guarantee; no duration
    or speed (they depend on the records: the owner's timing file, `dpprobe.timings`)."""
    privacy = results["privacy"]
    ema = results.get("test_accuracy_ema")
    ema_text = f", EMA {100 * ema:.2f}%" if ema is not None else ""
    claim = ("NOT PRIVATE (--non-private: no clipping, no noise; epsilon inf)"
             if "claim" in privacy else
             f"(epsilon {privacy['epsilon']:.3g}, delta {privacy['delta']:g}), "
             f"{privacy['accountant']}, {privacy['neighboring_relation_text']}")
    return "\n".join([
        f"{results['model']['name']} on {results['data']['spec']}: test accuracy "
        f"{100 * results['test_accuracy']:.2f}%{ema_text} at {claim}",
        *warning_lines(results)])


def finetune_audit_line(audit: dict) -> str:
    """One line: the one-run lower bound (and estimate) against the claim
    (`finetune.canaries`)."""
    if audit.get("kind") == "gradient":
        verdict = ("CLAIM REFUTED" if audit["refuted"] else
                   "consistent with the claim (a lower bound, not a proof of privacy)")
        return (f"audit (white box, {audit['canaries']} gradient canaries, {audit['included']} "
                f"in): epsilon >= {audit['epsilon_lower']:.3f} at "
                f"{100 * audit['confidence']:g}% confidence (rigorous), estimate "
                f"{audit['epsilon_estimate']:.3f} (not a bound), delta {audit['delta']:g}; "
                f"claimed {audit['claimed_epsilon']:.3f}; {verdict}; the model is an audit "
                "artefact (the canaries moved its weights)")
    verdict = ("CLAIM REFUTED" if audit["refuted"] else
               "consistent with the claim (a weak one-run lower bound, not a proof of privacy)")
    return (f"audit (one run, {audit['canaries']} canaries, {audit['included']} in): epsilon >= "
            f"{audit['epsilon_lower']:.3f} at {100 * audit['confidence']:g}% confidence, delta "
            f"{audit['delta']:g}; claimed {audit['claimed_epsilon']:.3f} (ratio "
            f"{audit['ratio']:.3f}); AUROC {audit['auroc']:.3f}; {verdict}; the model is an "
            "audit model (trained with the canaries)")
