"""The finetune command: its run folder (one run at a time, a finished run kept), the run
(`finetune.job.finetune_run`), and what it writes: the model file, the owner's timings, the
results.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dpprobe import checks, files, model_files, preflight, timings
from dpprobe.finetune import run_folder
from dpprobe.finetune.job import finetune_run
from dpprobe.finetune.run_folder import OPTIONS_FILE
from dpprobe.messages import log
from dpprobe.multihost import processes
from dpprobe.pipelines.finetune_config import FinetuneConfig
from dpprobe.pipelines.reporting import TRAINING_TEXTS, warning_lines

__all__ = ["FinetuneConfig", "finetune_audit_line", "finetune_line", "run_finetune"]

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
    run_folder.check_outside_inputs(out, run_folder.input_paths(config))
    run_folder.check_checkpoint_folder(out / "checkpoint")
    for name in ("results.json", model_files.MODEL_FILE):
        preflight.check_output_paths(out=out / name)
    preflight.check_timings_file(out / "results.json")
    with run_folder.hold(out, "finetune"):  # one run at a time
        finished = run_folder.finished_run(out, config)
        if finished is not None and multi:  # the others would train on without it
            raise ValueError(f"{out} holds a finished run; give a new `out`")
        if finished is not None:
            # A run killed after its results and before removing its checkpoint: remove it.
            shutil.rmtree(out / "checkpoint", ignore_errors=True)
            log(f"already complete: {out / 'results.json'}", config.quiet)
            return finished
        return _train(config, out)


def _train(config: FinetuneConfig, out: Path | None) -> dict:
    """The run (`finetune.job.finetune_run`), its model file, timings and results written to
    `out` (held) when given."""
    stopwatch = timings.Stopwatch()
    # As given (a default model stays None: chosen again on rerun).
    options = run_folder.run_options(config)
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
