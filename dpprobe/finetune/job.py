"""One finetune run, from a job's config to its results: DP-SGD on the weights of a backbone
(`finetune.train_finetune`; all, the head, biases or LoRA adapters, `finetune.modes`), on images
from the same data specs as `extract`, evaluated on the test split, recorded with its ledger.

load images -> build the model (LoRA adapters) -> calibrate sigma for (epsilon, delta) from
q = B/N and T -> train (checkpointed, resumable) -> merge the adapters -> evaluate the model and
its EMA -> record. `non_private=True`: the same without clipping, noise or accounting. The
command (`dpprobe.pipelines.finetune_job`) writes what this returns.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from dpprobe import accounting, extract, finetune
from dpprobe.accounting import records
from dpprobe.finetune.data import DATA_RULE, load_images
from dpprobe.finetune.own_model import (
    check_own_module,
    own_model_parts,
    own_module,
    own_module_name,
)
from dpprobe.finetune.recipe import default_model, finetune_recipe
from dpprobe.messages import log
from dpprobe.multihost import processes

__all__ = ["NON_PRIVATE", "TRAIN_NOTES", "FinetuneRun", "finetune_run"]

# What --non-private says wherever it is recorded.
NON_PRIVATE = ("--non-private: trained with the plain batch gradient (no clipping, no noise, no "
               "accounting) on the same Poisson batches as DP-SGD; this model and its results "
               "carry NO privacy guarantee (epsilon inf)")
TRAIN_NOTES = {
    "all": "every parameter",
    "head": "the classifier head only; the rest is the initialization, unchanged",
    "bias": "every bias and normalization offset, and the head (DP-BiTFiT); the rest is the "
            "initialization, unchanged",
    "lora": "low-rank adapters W + A B on the attention and MLP layers (qkv, proj, fc1, fc2), "
            "and the head; released merged into the kernels (the model file holds W + A B)",
}

@dataclasses.dataclass
class FinetuneRun:
    """What a run gives its command to write.

    Attributes:
      results: the results dict (DP outputs and public inputs only; results.json).
      model: the released model (the EMA parameters when EMA is on, else the final iterate).
      model_file: the keywords of `model_files.finetune_model` besides the path, the results
        and the model (name, image size, channels, preprocessing, ...).
      trained: the trainer's result (its compile seconds and images per second: the owner's).
      checkpointer: the run's checkpointer (None without a checkpoint folder), still open.
    """

    results: dict
    model: Any
    model_file: dict
    trained: Any
    checkpointer: Any


def finetune_run(config, checkpoint: Path | None, options: dict) -> FinetuneRun:
    """Load, build, calibrate, train, evaluate and record (module docstring).

    Args:
      config: the job's `FinetuneConfig`.
      checkpoint: the checkpoint folder (resumed from when it holds one), or None.
      options: the options that make the run what it is (a checkpoint is resumed only by a
        run with the same).

    Returns:
      A `FinetuneRun`.
    """
    own = own_module(config.model)
    if own is not None:  # from here on `model` is its class's name; the module is `own`
        check_own_module(own, config)
        config = dataclasses.replace(config, model=own_module_name(own))
    if config.train == "lora" and (config.model is None
                                   or config.model in finetune.models.MODEL_NAMES):
        raise ValueError(f"`train=lora` adapts a ViT's attention and MLP layers; "
                         f"`model={config.model or 'the default'}` has none: name a timm ViT, "
                         "or train all, head or bias")
    if config.model is None and (config.weights or config.random_init):
        raise ValueError("`weights` and `random_init` are for a timm model: name it (`model`); "
                         "the default models train from scratch")

    quiet = config.quiet

    # Load: train and test images as uint8 (N, S, S, C), resized once to the model's input,
    # by the public per-record rule (a bad record trains as a null record; nothing counts them).
    model_is_timm = (own is None and config.model is not None
                     and config.model not in finetune.models.MODEL_NAMES)
    train, test, class_names = load_images(config, rgb=model_is_timm)
    log(DATA_RULE, quiet)
    num_real, num_classes = len(train[1]), len(class_names)
    num_examples = num_real + config.audit_canaries  # rows trained on (N + m, public)
    multi, rows = processes.active(), None
    if multi:  # each process keeps its own rows (every process reads the spec)
        from dpprobe.dp.distributed import process_rows  # JAX: imported when the job runs

        processes.check_rows(num_real)
        first, stop = process_rows(num_real)
        train, rows = (train[0][first:stop], train[1][first:stop]), (first, stop, num_real)
    image_size, channels = train[0].shape[1], train[0].shape[-1]
    model_choice = None
    if config.model is None:  # from the public input side (`finetune.recipe.default_model`)
        config = dataclasses.replace(config, model=default_model(image_size))
        model_choice = f"the default for {image_size} px images"
        log(f"model: {config.model} [{model_choice}]", quiet)

    # Model: from scratch, or a timm ViT with its weights; zero-initialized head; with
    # train="lora", adapters (A from the seed, B = 0) on its attention and MLP layers.
    model, mean, std, model_info = (
        own_model_parts(own, image_size, channels, num_classes) if own is not None
        else _build_model(config, num_classes, image_size, channels))

    # The recipe: what the config gives, else chosen from public quantities (N, size, model).
    chosen = finetune_recipe(config, num_examples=num_real, image_size=image_size,
                             num_classes=num_classes)
    log(chosen.describe(), quiet)
    warnings = records.warnings(delta=config.delta, num_examples=num_examples)
    if config.augmult > 1 and not config.crop_padding and not config.flip:
        warnings.append(f"augmult {config.augmult} without crop padding or flips: the "
                        f"{config.augmult} views of an example are the same image, so the run "
                        f"costs {config.augmult}x for the same model")
    for warning in warnings:
        log(f"warning: {warning}", quiet)

    # Calibrate: q = B / N, T steps, sigma for (epsilon, delta).
    q = min(1.0, chosen.batch_size / num_examples)
    # Epochs over the real records (an audited run takes the steps of the run it audits).
    steps = config.steps or max(1, math.ceil(chosen.epochs * num_real / (q * num_examples)))
    if config.non_private:  # NOT private: no clipping, no noise
        plan = accounting.DpPlan(0.0, steps, q, math.inf)
    else:  # epsilon = inf: no noise, clipping kept
        plan = accounting.calibrate_plan(config.epsilon, config.delta, steps=steps,
                                         sampling_probability=q, clip_norm=chosen.clip_norm,
                                         accountant=config.accountant)
    sigma, clip = plan.noise_multiplier, plan.clip_norm
    spec = _from_config(finetune.FinetuneSpec, config, num_classes=num_classes, mean=mean,
                        std=std, learning_rate=chosen.learning_rate,
                        ema_decay=chosen.ema_decay or None)
    flags = _from_config(finetune.FinetuneFlags, config)
    trained_info = _trained_info(config, model, spec)
    log(f"finetune {config.model} on {config.data}: {num_classes} classes, {image_size} px, "
        f"B = {chosen.batch_size} (q = {q:.4g}), T = {steps}, sigma = {sigma:.4g}, "
        f"K = {config.augmult}, training {trained_info['parameters']:,} of "
        f"{trained_info['of']:,} parameters ({config.train})", quiet)
    if config.non_private:
        log(f"NOT PRIVATE: {NON_PRIVATE}", quiet)

    # Train: checkpointed under out/checkpoint, resumed from it when present.
    checkpointer = None
    if checkpoint is not None and not multi:  # a multi-process run does not checkpoint
        checkpointer = finetune.Checkpointer(checkpoint, every=config.checkpoint_every,
                                             config=options)
        if checkpointer.latest_step() is not None:
            log(f"resuming from {checkpoint} at step {checkpointer.latest_step()}", quiet)

    def epsilon_at(done: int) -> float:
        return (accounting.DpPlan(sigma, done, q, clip).epsilon(config.delta, config.accountant)
                if sigma else math.inf)

    log("finetune: compiling the training step (the first step includes it)", quiet)
    progress = None if quiet else finetune.print_progress(
        steps, q * num_examples, config.augmult, None if config.non_private else epsilon_at,
        first_step=(checkpointer.latest_step() or 0) if checkpointer else 0)
    audit = None
    if config.audit_canaries:
        from dpprobe.finetune.canaries import (  # JAX: imported when an audit runs
            audit_finetune,
            audit_finetune_gradients,
        )

        log(f"audit: {config.audit_canaries} {config.audit_kind} canaries, each in with "
            f"probability 1/2 (seed {config.seed}); this trains an audit artefact, not the "
            "production model", quiet)
        auditor = audit_finetune_gradients if config.audit_kind == "gradient" else audit_finetune
        trained, audit = auditor(model, *train, plan, spec, canaries=config.audit_canaries,
                                 delta=config.delta, seed=config.seed,
                                 accountant=config.accountant, flags=flags,
                                 checkpointer=checkpointer, progress=progress)
    else:
        trained = finetune.train_finetune(model, *train, plan, spec, flags=flags,
                                          checkpointer=checkpointer, progress=progress,
                                          rows=rows)

    # The released form: LoRA adapters merged into the kernels (W + A B), evaluated as saved.
    merge = finetune.modes.merge_lora
    trained = dataclasses.replace(trained, model=merge(trained.model), ema_model=None if
                                  trained.ema_model is None else merge(trained.ema_model))

    # Evaluate on the (public) test split.
    accuracy = finetune.evaluate_model(trained.model, *test, spec)
    ema_accuracy = (finetune.evaluate_model(trained.ema_model, *test, spec)
                    if trained.ema_model is not None else None)

    # Record: DP outputs and public inputs only.
    ledger = accounting.PrivacyLedger()
    ledger.record(f"SGD {config.model} (NOT private)" if config.non_private
                  else f"DP-SGD {config.model}", plan, role="final" if plan.is_private
                  else "NOT private (no clipping, no noise)" if config.non_private
                  else "non-private reference")
    results = {
        "dpprobe_version": records.VERSION,
        "job": "finetune",
        "data": {"spec": config.data, "num_classes": num_classes, "class_names": class_names,
                 "num_train": num_real, "num_test": len(test[1]),
                 "image_size": image_size, "channels": channels},
        "model": model_info | ({"chosen": model_choice} if model_choice else {}),
        "recipe": dataclasses.asdict(spec) | dataclasses.asdict(flags) | {
            "batches_per_call": trained.batches_per_call,  # the number used (public)
            "batch_size": chosen.batch_size, "epochs": chosen.epochs,
            "clip_norm": clip, "chosen": chosen.chosen},
        "trained": trained_info,
        "warnings": warnings,
        "privacy": {
            "epsilon": plan.epsilon(config.delta, config.accountant) if plan.is_private
            else math.inf,
            "delta": config.delta,
            "accountant": config.accountant,
            "plan": plan.to_dict(),
            "dp_event": accounting.event_to_dict(plan.dp_event()),
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
            "dataset_size_public": True,
            "sampling": f"Poisson, q = {q:g} (expected batch {chosen.batch_size})",
            "private": plan.is_private,
        } | ({"claim": NON_PRIVATE} if config.non_private else {}) | records.randomness(
            config.seed, "the model's initialization"
            + (" and the audit's canaries' in/out coins" if audit else "")),
        "test_accuracy": accuracy,
        "test_accuracy_ema": ema_accuracy,
        "ledger": ledger.to_dict(config.delta, config.accountant),
    }
    if audit is not None:
        moved = (" whose Dirac gradients moved the coordinates they sit on"
                 if config.audit_kind == "gradient" else "")
        results["audit"] = audit.to_dict() | {"model": (
            f"an audit artefact, not the production model: trained on the {num_real} real "
            f"records and {audit.included} of the {audit.canaries} canaries{moved} "
            f"({audit.canaries - audit.included} null records), with fewer real records per "
            "step, so its weights and accuracy are not the production model's; the privacy "
            "claim covers the real records with the canaries present")}
        results["privacy"]["num_canaries"] = config.audit_canaries
    # Whether the released model is an audited run's (its file says so too).
    results["model"]["audit_artefact"] = audit is not None
    released = "EMA" if trained.ema_model is not None else "final iterate"
    results["model"]["released_parameters"] = released
    released_model = trained.ema_model if released == "EMA" else trained.model
    model_file = dict(released=released, name=config.model, image_size=image_size,
                      channels=channels, resize=config.resize, crop=config.crop,
                      rgb=model_is_timm or channels == 3, mean=mean, std=std,
                      timm_architecture=model_info.get("architecture"), trained=trained_info)
    return FinetuneRun(results, released_model, model_file, trained, checkpointer)


def _from_config(cls, config, **given):
    """The trainer's `cls` (`FinetuneSpec`, `FinetuneFlags`) from the config's fields of the
    same names (declared with the trainer's defaults, `finetune.recipe`) and `given` values."""
    names = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(config)}
    return cls(**{name: getattr(config, name) for name in names - given.keys()}, **given)


def _trained_info(config, model, spec) -> dict:
    """Which parameters the run trains, and how many of how many (public: the architecture)."""
    _, params, rest = finetune.split_trained(model, spec)
    info = {"mode": config.train, "parameters": finetune.modes.count_params(params),
            "of": finetune.modes.count_params(params) + finetune.modes.count_params(rest),
            "note": TRAIN_NOTES[config.train]}
    if config.train == "lora":
        info["lora_rank"] = config.lora_rank
    return info


def _build_model(config, num_classes: int, image_size: int, channels: int):
    """(model, mean, std, public description)."""
    from flax import nnx  # JAX: imported when the job runs, not at the CLI's start

    rngs = nnx.Rngs(config.seed)
    if config.model in finetune.models.MODEL_NAMES:
        if config.weights or config.random_init:
            raise ValueError(f"`model={config.model}` trains from scratch: drop `weights` and "
                             "`random_init`")
        model = finetune.models.create_model(config.model, num_classes, image_size=image_size,
                                             in_channels=channels, rngs=rngs,
                                             head_bias_init=config.head_bias_init)
        mean, std = finetune.models.input_mean_std(config.model)
        low, high = (0.0 - mean) / std + 0.0, (1.0 - mean) / std  # + 0.0: no "-0"
        return model, (mean,) * channels, (std,) * channels, {
            "name": config.model, "weights": "random init (from scratch)",
            "input": f"{image_size} px, scaled to [{low:g}, {high:g}]"}
    backbone = extract.create_backbone(config.model, weights=config.weights,
                                       random_init=config.random_init, seed=config.seed,
                                       crop=image_size, device="cpu")
    model = finetune.models.model_from_timm(backbone.module, num_classes, rngs=rngs,
                                            head_bias_init=config.head_bias_init)
    if config.train == "lora":
        finetune.modes.add_lora(model, config.lora_rank, rngs=rngs)
    prep = backbone.preprocessing
    info = {k: v for k, v in backbone.provenance.items() if k != "embedding"}
    return model, tuple(prep["mean"]), tuple(prep["std"]), info | {"input": f"{image_size} px"}
