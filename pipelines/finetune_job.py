"""The finetune job: DP-SGD on every weight of a backbone (`finetune.train_finetune`), on images
from the same data specs as `extract`, evaluated on the test split, recorded with its ledger.

load images -> build the model -> calibrate sigma for (epsilon, delta) from q = B/N and T ->
train (checkpointed, resumable) -> evaluate the model and its EMA -> record.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from pathlib import Path

import numpy as np

import accounting
from pipelines import config as cfg
from pipelines import model_files, preflight, records, reporting
from pipelines.reporting import log

__all__ = ["DEFAULT_MODEL", "FinetuneConfig", "run_finetune"]

# Trains well on small grayscale images on a CPU (README, "Finetuning"): Tramer & Boneh's CNN.
DEFAULT_MODEL = "cnn"
# Inputs of models trained from scratch are scaled to [-1, 1] (public constants).
_FROM_SCRATCH_MEAN_STD = (0.5, 0.5)
# Canaries of one audited run (each is an extra training row), and their kinds.
MAX_CANARIES = 10_000_000
AUDIT_KINDS = ("gradient", "image")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """What `run_finetune` does; `dpprobe finetune --help` explains each option.

    Attributes:
      data: a data spec as for `extract` (fashion-mnist, digits, npz:, imagefolder:, cifar10:).
      test_data: the test split's spec, for sources of one split (npz:, imagefolder:); the
        test split is public (the accuracy on it is published).
      model: "cnn", "wrn16_4" or a timm ViT name (`finetune.models`).
      weights, random_init: a timm model's local weights file, or random init; the hub
        otherwise. Models trained from scratch ("cnn", "wrn16_4") take neither.
      resize, crop: resize each image's short side to `resize`, then center-crop `crop` x
        `crop` (default: a square of the short side): the model's input; default: the data's
        own size.
      epsilon, delta: the run's budget (zero-out neighbours, N public; `accountant`).
      batch_size: the expected logical batch B (Poisson rate q = B / N).
      epochs, steps: the length (T = ceil(epochs N / B) unless `steps` is given).
      learning_rate, optimizer, momentum, schedule, warmup_steps, clip_norm: the DP-SGD recipe.
      augmult, crop_padding, flip: K views per example (crops of the padded image, flips).
      ema_decay: EMA of the parameters (0 turns it off).
      physical_batch_size, microbatch_size, mixed_precision, devices: speed knobs.
      seed: drives only the model's initialization (never a mechanism).
      out: a folder for results.json and model.safetensors (the released model: the EMA
        parameters when EMA is on; `pipelines.model_files`), and checkpoints while it runs.
      checkpoint_every: steps between checkpoints (with `out`); a run with the same options
        and `out` resumes from the latest one.
      audit_canaries: m > 0 trains an audit model instead: m canaries (their coins seeded by
        `seed`), each in with probability 1/2, and the one-run bounds on epsilon
        (`finetune.canaries`); 0: off. The epochs count the real records only, so an audited
        run takes as many steps as the run it audits.
      audit_kind: "gradient" (white-box gradient canaries, `dp.canaries`: a rigorous lower
        bound and an estimate of epsilon) or "image" (black-box noise-image canaries, loose).
    """

    data: str = "fashion-mnist"
    test_data: str | None = None
    data_dir: str | None = None
    model: str = DEFAULT_MODEL
    weights: str | None = None
    random_init: bool = False
    resize: int | None = None
    crop: int | None = None
    epsilon: float = 3.0
    delta: float = 1e-5
    accountant: str = "pld"
    # The defaults: Tramer & Boneh's recipe for their CNN, measured here at 86.4% on
    # Fashion-MNIST at (3, 1e-5) (README, "dpprobe finetune"); augmentation multiplicity (K = 2,
    # crops and flips) trailed it at equal steps, so it is off by default.
    batch_size: int = 2048
    epochs: float = 30.0
    steps: int | None = None
    learning_rate: float = 4.0
    optimizer: str = "momentum"
    momentum: float = 0.9
    schedule: str = "constant"
    warmup_steps: int = 0
    clip_norm: float = 0.1
    augmult: int = 1
    crop_padding: int = 0
    flip: bool = False
    ema_decay: float = 0.999
    head_bias_init: float = 0.0
    physical_batch_size: int = 256
    microbatch_size: int | None = None
    mixed_precision: bool = False
    devices: int = 1
    seed: int = 0
    out: str | None = None
    checkpoint_every: int = 50
    audit_canaries: int = 0
    audit_kind: str = "gradient"
    quiet: bool = False

    def __post_init__(self):
        cfg.freeze(self, epsilon=cfg.check_epsilon("epsilon", self.epsilon, allow_inf=True),
                   delta=cfg.check_delta("delta", self.delta),
                   learning_rate=cfg.check_number("learning_rate", self.learning_rate, 0),
                   clip_norm=cfg.check_number("clip_norm", self.clip_norm, 0),
                   epochs=cfg.check_number("epochs", self.epochs, 0))
        for name in ("batch_size", "physical_batch_size", "augmult", "devices",
                     "checkpoint_every"):
            cfg.check_int(name, getattr(self, name))
        for name in ("steps", "resize", "crop", "microbatch_size"):
            if getattr(self, name) is not None:
                cfg.check_int(name, getattr(self, name), high=cfg.MAX_STEPS)
        cfg.check_int("warmup_steps", self.warmup_steps, 0)
        cfg.check_int("audit_canaries", self.audit_canaries, 0, MAX_CANARIES)
        if self.audit_canaries == 1:
            raise cfg.ConfigError("audit_canaries", "needs at least 2 canaries (0: no audit)")
        if self.audit_kind not in AUDIT_KINDS:
            raise cfg.ConfigError("audit_kind", f"must be one of {', '.join(AUDIT_KINDS)}, got "
                                  f"{self.audit_kind!r}")
        cfg.check_int("crop_padding", self.crop_padding, 0)
        if not 0.0 <= self.ema_decay < 1.0:
            raise cfg.ConfigError("ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        if self.weights is not None and self.random_init:
            raise cfg.ConfigError("weights", "--weights and --random-init exclude each other")


def run_finetune(config: FinetuneConfig | None = None, /, **options) -> dict:
    """DP-SGD finetuning of a whole model: `run_finetune(FinetuneConfig(...))` or the config's
    fields as keywords. Returns the results dict (also `out`/results.json).

    Privacy: one run of the Poisson-sampled Gaussian (`accounting.DpPlan(sigma, T, q, C)`,
    sigma calibrated to (epsilon, delta) by `accountant`, zero-out neighbours, N public). Noise
    keys and batch sampling draw from OS entropy; the results hold only the DP outputs (the
    trained model, its test accuracy) and public inputs.
    """
    import finetune

    config = cfg.make_config(FinetuneConfig, config, "data", **options)
    out = Path(config.out) if config.out else None
    if out is not None:
        for name in ("results.json", model_files.MODEL_FILE):
            preflight.check_output_paths(**{"--out": out / name})
    start = time.perf_counter()
    quiet = config.quiet

    # Load: train and test images as uint8 (N, S, S, C), resized once to the model's input.
    model_is_timm = config.model not in finetune.models.MODEL_NAMES
    train, test, class_names = _load_images(config, rgb=model_is_timm)
    num_real, num_classes = len(train[1]), len(class_names)
    num_examples = num_real + config.audit_canaries  # rows trained on (N + m, public)
    image_size, channels = train[0].shape[1], train[0].shape[-1]

    # Model: from scratch, or a timm ViT with its weights; zero-initialized head.
    model, mean, std, model_info = _build_model(config, num_classes, image_size, channels)

    # Calibrate: q = B / N, T steps, sigma for (epsilon, delta).
    q = min(1.0, config.batch_size / num_examples)
    # Epochs over the real records (an audited run takes the steps of the run it audits).
    steps = config.steps or max(1, math.ceil(config.epochs * num_real / (q * num_examples)))
    if math.isinf(config.epsilon):
        sigma, clip = 0.0, config.clip_norm
    else:
        sigma = accounting.calibrate_noise_multiplier(
            config.epsilon, config.delta, steps=steps, sampling_probability=q,
            accountant=config.accountant)
        clip = config.clip_norm
    plan = accounting.DpPlan(sigma, steps, q, clip)
    spec = finetune.FinetuneSpec(
        num_classes, optimizer=config.optimizer, learning_rate=config.learning_rate,
        momentum=config.momentum, schedule=config.schedule, warmup_steps=config.warmup_steps,
        augmult=config.augmult, crop_padding=config.crop_padding, flip=config.flip,
        ema_decay=config.ema_decay or None, mean=mean, std=std)
    flags = finetune.FinetuneFlags(physical_batch_size=config.physical_batch_size,
                                   microbatch_size=config.microbatch_size,
                                   mixed_precision=config.mixed_precision, devices=config.devices)
    log(f"finetune {config.model} on {config.data}: {num_classes} classes, {image_size} px, "
        f"B = {config.batch_size} (q = {q:.4g}), T = {steps}, sigma = {sigma:.4g}, "
        f"K = {config.augmult}", quiet)

    # Train: checkpointed under out/checkpoint, resumed from it when present.
    checkpointer = None
    if out is not None:
        public = dataclasses.asdict(config) | {"quiet": None, "out": None}
        checkpointer = finetune.Checkpointer(out / "checkpoint", every=config.checkpoint_every,
                                             config=public)
        if checkpointer.latest_step() is not None:
            log(f"resuming from {out / 'checkpoint'} at step {checkpointer.latest_step()}", quiet)

    def epsilon_at(done: int) -> float:
        return (accounting.DpPlan(sigma, done, q, clip).epsilon(config.delta, config.accountant)
                if sigma else math.inf)

    progress = None if quiet else finetune.print_progress(
        steps, q * num_examples, config.augmult, epsilon_at,
        first_step=(checkpointer.latest_step() or 0) if checkpointer else 0)
    audit = None
    if config.audit_canaries:
        from finetune.canaries import audit_finetune, audit_finetune_gradients

        log(f"audit: {config.audit_canaries} {config.audit_kind} canaries, each in with "
            f"probability 1/2 (seed {config.seed}); this trains an audit model", quiet)
        auditor = audit_finetune_gradients if config.audit_kind == "gradient" else audit_finetune
        trained, audit = auditor(model, *train, plan, spec, canaries=config.audit_canaries,
                                 delta=config.delta, seed=config.seed,
                                 accountant=config.accountant, flags=flags,
                                 checkpointer=checkpointer, progress=progress)
    else:
        trained = finetune.train_finetune(model, *train, plan, spec, flags=flags,
                                          checkpointer=checkpointer, progress=progress)

    # Evaluate on the (public) test split.
    accuracy = finetune.evaluate_model(trained.model, *test, spec)
    ema_accuracy = (finetune.evaluate_model(trained.ema_model, *test, spec)
                    if trained.ema_model is not None else None)

    # Record: DP outputs and public inputs only.
    ledger = accounting.PrivacyLedger()
    ledger.record(f"DP-SGD {config.model}", plan, role="final" if plan.is_private
                  else "non-private reference")
    results = {
        "dpprobe_version": records.VERSION,
        "job": "finetune",
        "created": records.now(),
        "data": {"spec": config.data, "num_classes": num_classes, "class_names": class_names,
                 "num_train": num_real, "num_test": len(test[1]),
                 "image_size": image_size, "channels": channels},
        "model": model_info,
        "recipe": dataclasses.asdict(spec) | dataclasses.asdict(flags),
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
            "sampling": f"Poisson, q = {q:g} (expected batch {config.batch_size})",
        } | records.randomness(config.seed, "the model's initialization"
                                + (" and the audit's canaries' in/out coins"
                                   if audit else "")),
        "test_accuracy": accuracy,
        "test_accuracy_ema": ema_accuracy,
        "ledger": ledger.to_dict(config.delta, config.accountant),
        "wall_seconds": time.perf_counter() - start,
    }
    if audit is not None:
        results["audit"] = audit.to_dict() | {"model": (
            f"an audit model: trained on the {num_real} real records and {audit.included} "
            f"of the {audit.canaries} canaries ({audit.canaries - audit.included} null "
            "records), so its accuracy is not the production model's; the privacy claim "
            "covers the real records with the canaries present")}
        results["privacy"]["num_canaries"] = config.audit_canaries
    released = "EMA" if trained.ema_model is not None else "final iterate"
    results["model"]["released_parameters"] = released
    if out is not None:
        model_files.finetune_model(
            out / model_files.MODEL_FILE, results,
            trained.ema_model if released == "EMA" else trained.model, released=released,
            name=config.model, image_size=image_size, channels=channels, resize=config.resize,
            crop=config.crop, rgb=model_is_timm, mean=mean, std=std,
            timm_architecture=model_info.get("architecture"))
        results["model_file"] = str(out / model_files.MODEL_FILE)
        reporting.write_json(out / "results.json", results)
        checkpointer.close()
        shutil.rmtree(out / "checkpoint")  # it holds the noise key: gone once the run is done
    return results


def _load_images(config: FinetuneConfig, *, rgb: bool):
    """(train images, labels), (test images, labels), class names: uint8 NHWC at the model's
    input size. Resizing is a function of each image alone (no privacy cost)."""
    import extract

    if config.test_data is None:
        splits = extract.open_source(config.data, data_dir=config.data_dir)
    else:
        splits = (extract.open_source(config.data, split="train", data_dir=config.data_dir)
                  | extract.open_source(config.test_data, split="test",
                                        data_dir=config.data_dir))
    missing = {"train", "test"} - set(splits)
    if missing:
        raise ValueError(f"{config.data} has no {' or '.join(sorted(missing))} split; give the "
                         "test split of a one-split source (npz:, imagefolder:) with --test-data")
    if splits["train"].class_names != splits["test"].class_names:
        raise ValueError("the train and test data declare different classes")
    out = []
    for name in ("train", "test"):
        split = splits[name]
        out.append((_as_array(split, config.resize, config.crop, rgb),
                    split.labels.astype(np.int32)))
    return out[0], out[1], list(splits["train"].class_names)


def _as_array(split, resize: int | None, crop: int | None, rgb: bool) -> np.ndarray:
    """The split as uint8 (N, S, S, C): as stored when no resize or crop is asked and the
    images are square arrays; else each image resized (short side to `resize`, bicubic) and
    center-cropped (to `crop`, or to a square) by `finetune.images`."""
    from finetune.images import as_channels, images_to_array

    array = split.array
    if array is None or resize or crop or array.shape[1] != array.shape[2]:
        array = np.concatenate([
            images_to_array(split.images(range(start, min(start + 1024, len(split)))), resize,
                            crop, rgb)
            for start in range(0, len(split), 1024)])
    return as_channels(array, rgb)


def _build_model(config: FinetuneConfig, num_classes: int, image_size: int, channels: int):
    """(model, mean, std, public description)."""
    from flax import nnx

    import finetune.models

    rngs = nnx.Rngs(config.seed)
    if config.model in finetune.models.MODEL_NAMES:
        if config.weights or config.random_init:
            raise ValueError(f"--model {config.model} trains from scratch: drop --weights and "
                             "--random-init")
        model = finetune.models.create_model(config.model, num_classes, image_size=image_size,
                                             in_channels=channels, rngs=rngs,
                                             head_bias_init=config.head_bias_init)
        mean, std = _FROM_SCRATCH_MEAN_STD
        return model, (mean,) * channels, (std,) * channels, {
            "name": config.model, "weights": "random init (from scratch)",
            "input": f"{image_size} px, scaled to [-1, 1]"}
    import extract

    backbone = extract.create_backbone(config.model, weights=config.weights,
                                       random_init=config.random_init, seed=config.seed,
                                       crop=image_size, device="cpu")
    model = finetune.models.vit_from_timm(backbone.module, num_classes, rngs=rngs,
                                          head_bias_init=config.head_bias_init)
    prep = backbone.preprocessing
    info = {k: v for k, v in backbone.provenance.items() if k != "embedding"}
    return model, tuple(prep["mean"]), tuple(prep["std"]), info | {"input": f"{image_size} px"}
