"""What a finetune job is asked: `FinetuneConfig`, its fields' checks and command-line options."""

from __future__ import annotations

import dataclasses

from dpprobe import checks
from dpprobe.finetune import recipe
from dpprobe.options import (
    OPTIMIZERS,
    TRAIN_MODES,
    accountant_option,
    delta_option,
    integer,
    num_classes_option,
    number,
    option,
    process_fields,
)

__all__ = ["AUDIT_KINDS", "MAX_CANARIES", "FinetuneConfig"]

# Canaries of one audited run (each is an extra training row), and their kinds.
MAX_CANARIES = 10_000_000
AUDIT_KINDS = ("gradient", "image")


@dataclasses.dataclass(frozen=True)
@process_fields
class FinetuneConfig:
    """What `run_finetune` does; `dpprobe finetune --help` explains each option.

    Attributes:
      data: a data spec as for `extract` (fashion-mnist, digits, npz:, imagefolder:, cifar10:).
      test_data: the test split's spec, for sources of one split (npz:, imagefolder:); the
        test split is public (the accuracy on it is published).
      model: "cnn", "cnn_cifar", "scatternet_cnn", "scatternet_cnn_linear", "wrn16_4" or a
        timm ViT name (`finetune.models`); None: chosen from the input side
        (`finetune.recipe.default_model`); from Python, your own Flax NNX module
        (`finetune.own_model`).
      weights, random_init: a timm model's local weights file, or random init; the hub
        otherwise. Models trained from scratch (`finetune.models.MODEL_NAMES`) take neither.
      resize, crop: resize each image's short side to `resize`, then center-crop `crop` x
        `crop` (default: a square of the short side): the model's input; default: the data's
        own size.
      epsilon, delta: the run's budget (zero-out neighbours, N public; `accountant`).
      batch_size: the expected logical batch B (Poisson rate q = B / N).
      epochs, steps: the length (T = ceil(epochs N / B) unless `steps` is given).
      learning_rate, optimizer, momentum, schedule, warmup_steps, clip_norm: the DP-SGD recipe.
        `batch_size`, `epochs`, `learning_rate` and `clip_norm` left None are chosen from
        public quantities (`finetune.recipe`) and recorded with the results.
      augmult, crop_padding, flip: K views per example (crops of the padded image, flips).
      train: which parameters are trained (`finetune.modes`): all, head, bias (DP-BiTFiT) or
        lora (adapters of rank `lora_rank` on a ViT's qkv, proj, fc1, fc2; merged into the
        kernels in the released model); the head in every mode.
      non_private: NOT private: the plain batch gradient (no clipping, no noise, no
        accounting) on the same Poisson batches, for side-by-side comparisons; `epsilon`,
        `delta`, `accountant` and `clip_norm` are then unused and the results say epsilon inf.
      ema_decay: EMA of the parameters (0 turns it off; None: the recipe's 0.999, De et al.);
        step t's decay is min(ema_decay, (1 + t) / (10 + t)), their warm-up.
      physical_batch_size, mixed_precision, devices: speed knobs (`physical_batch_size` sets
        the memory: book-keeping clipping keeps no per-example kernel gradients).
      microbatch_size: refused (None only): it has no effect on book-keeping clipping.
      seed: drives only the model's initialization (never a mechanism).
      out: a folder for results.json and model.safetensors (the released model: the EMA
        parameters when EMA is on; `dpprobe.model_files`), and checkpoints while it runs.
      checkpoint_every: steps between checkpoints (with `out`); a run with the same options
        and `out` resumes from the latest one.
      coordinator, num_processes, process_id, process_timeout: run as one of several
        processes (`multihost.processes`: each trains on its own rows, process 0 writes; no
        checkpoints, no audit).
      audit_canaries: m > 0 trains an audit model instead: m canaries (their coins seeded by
        `seed`), each in with probability 1/2, and the one-run bounds on epsilon
        (`finetune.canaries`); 0: off. The epochs count the real records only, so an audited
        run takes as many steps as the run it audits.
      audit_kind: "gradient" (white-box Dirac gradient canaries on the model's own
        coordinates, at most one per trained parameter, `dp.canaries`: a rigorous lower bound
        and an estimate of epsilon) or "image" (black-box noise-image canaries, loose).
    """

    data: str = option("fashion-mnist",
                       help="data spec, as for extract (default %(default)s)")
    test_data: str | None = option(
        None, help="the test split's data spec, for sources holding one split (npz:PATH, "
        "imagefolder:PATH); public: its accuracy is published")
    data_dir: str | None = option(None, help="directory of Fashion-MNIST's gzipped IDX files")
    num_classes: int | None = num_classes_option()
    model: str | None = option(None, help="cnn (Tramer & Boneh's CNN), scatternet_cnn (their "
                               "CNN on a fixed ScatterNet), scatternet_cnn_linear (that CNN and "
                               "a linear model on the ScatterNet: the best measured here), "
                               "wrn16_4 (WRN-16-4 with GroupNorm + weight standardization), or "
                               "a timm ViT name (vit_*, deit_*) (default: scatternet_cnn_linear "
                               "for images of 8 to 32 px, a side divisible by 4; else cnn)")
    weights: str | None = option(None,
                                 help="local .safetensors/.pth weights of the timm model")
    random_init: bool = option(False, action="store_true", help="a timm model with random "
                               "weights (seeded by --seed); for tests")
    resize: int | None = option(None, type=integer, help="resize each image's short side to R "
                                "(default: the data's size)")
    crop: int | None = option(
        None, type=integer, help="center-crop S x S after --resize: the model's input side "
        "(default: a square of the short side); ViTs adapt their position embeddings")
    epsilon: float = option(3.0, type=number, help="target epsilon; inf trains without noise "
                            "(default %(default)s)")
    delta: float = delta_option()
    accountant: str = accountant_option()
    # None: chosen from public quantities (`finetune.recipe`: Tramer & Boneh's recipe
    # for their CNN at large N, measured here at 86.4% on Fashion-MNIST at (3, 1e-5), scaled
    # down for small N); augmentation multiplicity (K = 2, crops and flips) trailed it at equal
    # steps, so it is off by default.
    batch_size: int | None = option(None, type=integer, help="expected batch size B, q = B/N "
                                    "(default: largest 2^k <= N/5, <= 2048)")
    epochs: float | None = option(None, type=number, exclusive="length", help="length in "
                                  "epochs, T = epochs N / B (default: 30, 40 for the ScatterNet "
                                  "models, or more so that T >= 300)")
    steps: int | None = option(None, type=integer, exclusive="length",
                               help="training length in steps T")
    learning_rate: float | None = option(None, "--lr", type=number, help="learning rate "
                                         "(default 4 sqrt(B / 2048) for momentum 0.9: 4 at B = "
                                         "2048; 10x for sgd; 0.01 for adam, sign, lamb)")
    optimizer: str = option(recipe.OPTIMIZER, choices=OPTIMIZERS, metavar="NAME",
                            help="%(choices)s (default %(default)s)")
    momentum: float = option(recipe.BASE_MOMENTUM, type=number,
                             help="momentum (default %(default)s)")
    schedule: str = option(recipe.SCHEDULE, choices=recipe.SCHEDULES,
                           help="learning-rate schedule (default %(default)s)")
    warmup_steps: int = option(0, type=integer,
                               help="linear warm-up steps (default %(default)s)")
    clip_norm: float | None = option(None, type=number,
                                     help="per-example clip norm C (default "
                                     f"{recipe.CLIP_NORM:g})")
    train: str = option(recipe.TRAIN_MODE, choices=TRAIN_MODES, metavar="MODE", help="which "
                        "parameters are trained: %(choices)s (the head always; bias: every bias "
                        "and norm offset, DP-BiTFiT; lora: low-rank adapters on a ViT's attention "
                        "and MLP layers) (default %(default)s)")
    lora_rank: int = option(8, type=integer, metavar="R",
                            help="rank of the LoRA adapters of --train lora (default %(default)s)")
    non_private: bool = option(False, action="store_true", help="NOT private: train with the "
                               "plain batch gradient (no clipping, no noise, epsilon inf) on "
                               "the same Poisson batches, for side-by-side comparisons")
    augmult: int = option(1, type=integer, help="augmentation multiplicity K: views per "
                          "example (random crops with --crop-padding, flips with --flip), "
                          "averaged before clipping (default %(default)s)")
    crop_padding: int = option(0, type=integer, help="random crops of the image padded by P "
                               "pixels (default %(default)s)")
    flip: bool = option(False, action="store_true",
                        help="random horizontal flips of the views")
    ema_decay: float | None = option(None, type=number, help="EMA of the parameters, 0 for "
                                     f"none (default {recipe.EMA_DECAY:g}, De et al.; step "
                                     "t's decay is min(D, (1 + t) / (10 + t)), their warm-up)")
    head_bias_init: float = 0.0
    physical_batch_size: int = option(
        recipe.PHYSICAL_BATCH_SIZE, type=integer,
        help="examples per clipped sum (default %(default)s)")
    # Not an option: the job's book-keeping clipping forms no per-example kernel gradients,
    # so microbatches (`FinetuneFlags.microbatch_size`, the per-example clipper's) would
    # change nothing; kept (None) so that saved runs' options still match, refused if set.
    microbatch_size: int | None = None
    mixed_precision: bool = option(False, action="store_true", help="bfloat16 forward/backward; "
                                   "clipping and noise stay float32")
    devices: int = option(1, type=integer, help="data parallel over N local devices")
    seed: int = option(0, type=integer,
                       help="seed of the model's initialization only (default %(default)s)")
    out: str | None = option(None, help="folder for results.json and model.safetensors; a "
                             "rerun with the same options resumes from its checkpoint")
    checkpoint_every: int = option(50, type=integer,
                                   help="steps between checkpoints (default %(default)s)")
    audit_canaries: int = option(
        0, type=integer, metavar="M", help="one-run privacy audit (Steinke et al. 2023): add M "
        "canaries, each in with probability 1/2 (seeded by --seed), and bound epsilon from "
        "below; the model is then an audit artefact. Exit status 1 when the bound exceeds the "
        "claim (default 0: off; 5000 gives a tight audit)")
    audit_kind: str = option(
        "gradient", choices=AUDIT_KINDS, help="gradient (default): white-box gradient "
        "canaries on the model's own coordinates (M at most its trained parameters), a "
        "rigorous lower bound and an estimate of epsilon; image: black-box noise images "
        "(loose)")
    quiet: bool = option(False, action="store_true", help="no progress output")

    def __post_init__(self):
        checks.check_processes(self)
        checks.freeze(self, epsilon=checks.check_epsilon("epsilon", self.epsilon, allow_inf=True),
                   delta=checks.check_delta("delta", self.delta))
        for name in ("learning_rate", "clip_norm", "epochs"):
            if getattr(self, name) is not None:
                checks.freeze(self, **{name: checks.check_number(name, getattr(self, name), 0)})
        for name in ("physical_batch_size", "augmult", "devices", "checkpoint_every",
                     "lora_rank"):
            checks.check_int(name, getattr(self, name))
        if self.microbatch_size is not None:
            raise checks.ConfigError("microbatch_size", "has no effect: the job's book-keeping "
                                  "clipping forms no per-example kernel gradients; lower "
                                  "`physical_batch_size` to use less memory")
        checks.check_optional_ints(self, ("batch_size", "steps", "resize", "crop",
                                          "num_classes"), high=checks.MAX_STEPS)
        checks.check_int("warmup_steps", self.warmup_steps, 0)
        checks.check_int("audit_canaries", self.audit_canaries, 0, MAX_CANARIES)
        if self.audit_canaries == 1:
            raise checks.ConfigError("audit_canaries", "needs at least 2 canaries (0: no audit)")
        if self.non_private and self.audit_canaries:
            raise checks.ConfigError("audit_canaries", "audits a privacy claim; `non_private=True` "
                                  "trains without one")
        if self.audit_kind not in AUDIT_KINDS:
            raise checks.ConfigError("audit_kind", f"must be one of {', '.join(AUDIT_KINDS)}, got "
                                  f"{self.audit_kind!r}")
        checks.check_int("crop_padding", self.crop_padding, 0)
        for name in ("momentum", "ema_decay"):  # in [0, 1)
            if getattr(self, name) is not None:
                checks.check_number(name, getattr(self, name), 0.0, 1.0, low_open=False,
                                 high_open=True)
        if self.weights is not None and self.random_init:
            raise checks.ConfigError("weights", "`weights` and `random_init` exclude each other")
