"""What a finetuning run asks for, in frozen parts, and what it returns.

  * `FinetuneSpec`: the recipe (optimizer, schedule, views, EMA, input normalization);
  * `FinetuneFlags`: speed and memory knobs only;
  * `TrainState`: what one step hands the next (and a checkpoint holds);
  * `FinetuneResult`: the trained model and its EMA.

Privacy lives in the `accounting.DpPlan` alone: nothing here changes what one example can
contribute or how much noise is added, so none of it changes epsilon.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

from dpprobe.dp.optimizers import OPTIMIZERS
from dpprobe.finetune import recipe
from dpprobe.finetune.modes import TRAIN_MODES

__all__ = ["SCHEDULES", "FinetuneFlags", "FinetuneResult", "FinetuneSpec", "TrainState"]

SCHEDULES = recipe.SCHEDULES


@dataclasses.dataclass(frozen=True)
class FinetuneSpec:
    """How a model is trained. None of it changes epsilon (privacy lives in the `DpPlan`).

    Attributes:
      num_classes: the declared class count (public).
      optimizer: one of `dp.OPTIMIZERS` (post-processing of the noisy mean gradient).
      learning_rate: peak learning rate.
      momentum: rho for "momentum".
      schedule: "constant" or "cosine" (to 0 at the last step), after `warmup_steps` of
        linear warm-up.
      warmup_steps: linear warm-up from 0.
      augmult: K, views per example per step (De et al.'s augmentation multiplicity); their
        gradients are averaged before clipping.
      crop_padding: random crops of the image reflect-padded by this many pixels (0: none).
      flip: random horizontal flips.
      ema_decay: EMA of the parameters with De et al.'s warm-up, decay_t =
        min(ema_decay, (1 + t) / (10 + t)); None: no EMA.
      mean, std: per-channel input normalization (public constants, never data statistics);
        uint8 images are first scaled to [0, 1].
      train: which parameters are trained (`finetune.modes`): "all", "head", "bias" (DP-BiTFiT)
        or "lora" (the model's `nnx.LoRA` adapters, `finetune.modes.add_lora`); the head in
        every mode. The others are constants of the run.
    """

    num_classes: int
    optimizer: str = recipe.OPTIMIZER
    # A unit step: the run's rate depends on the batch size (`finetune.recipe`), which the
    # spec does not know; `FinetuneConfig` leaves it to the recipe (None).
    learning_rate: float = 1.0
    momentum: float = recipe.BASE_MOMENTUM
    schedule: str = recipe.SCHEDULE
    warmup_steps: int = 0
    augmult: int = 1
    crop_padding: int = 0
    flip: bool = False
    ema_decay: float | None = recipe.EMA_DECAY
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    train: str = recipe.TRAIN_MODE

    def __post_init__(self):
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.warmup_steps < 0 or self.augmult < 1 or self.crop_padding < 0:
            raise ValueError("warmup_steps and crop_padding must be >= 0, augmult >= 1")
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if len(self.mean) != len(self.std) or min(self.std) <= 0:
            raise ValueError("mean and std need the same length and std > 0")
        if self.train not in TRAIN_MODES:
            raise ValueError(f"train must be one of {TRAIN_MODES}, got {self.train!r}")

    def learning_rate_schedule(self, steps: int) -> optax.Schedule:
        """The learning rate at each optimizer step."""
        decay = max(1, steps - self.warmup_steps)
        if self.schedule == "cosine":
            after = optax.cosine_decay_schedule(self.learning_rate, decay)
        else:
            after = optax.constant_schedule(self.learning_rate)
        if not self.warmup_steps:
            return after
        warmup = optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
        return optax.join_schedules([warmup, after], [self.warmup_steps])


CLIPPERS = ("bookkeeping", "per_example")


@dataclasses.dataclass(frozen=True)
class FinetuneFlags:
    """Speed and memory knobs. None of them changes epsilon: every example's whole gradient is
    clipped to C and the noise is sigma C whatever they are.

    Attributes:
      physical_batch_size: examples per clipped sum (a logical batch is cut into such
        physical batches, the last one padded and masked).
      microbatch_size: `jax_privacy.clipped_grad`'s microbatches inside a physical batch
        (less memory, more sequential work); None: the whole physical batch at once. Used by
        the "per_example" clipper only.
      mixed_precision: forward and backward in bfloat16; the per-example gradients are cast
        to float32 before clipping, and clipping and noise are float32.
      devices: data parallel over this many local devices (the physical batch is split
        between them; it must divide `physical_batch_size`).
      clipping: "bookkeeping" (`dp.bookkeeping_clipper`: one forward and one backward pass,
        no per-example kernel gradients; the default) or "per_example" (`dp.per_example_clipper`,
        `jax_privacy.clipped_grad`'s vmapped per-example gradients). Both bound each
        example's contribution by C; they agree to float rounding.
      batches_per_call: physical batches summed by one compiled call (a step makes its
        physical batches / this calls, rounded up); None: 1 on a CPU (XLA:CPU runs a loop's
        body slowly), else a whole step in one call but in rare steps, within 64 MiB of
        images (`finetune.batches.batches_per_call`). More: fewer host round trips (a GPU
        waits on them at small batches); fewer: less device memory.
    """

    physical_batch_size: int = recipe.PHYSICAL_BATCH_SIZE
    microbatch_size: int | None = None
    mixed_precision: bool = False
    devices: int = 1
    clipping: str = "bookkeeping"
    batches_per_call: int | None = None

    def __post_init__(self):
        if self.clipping not in CLIPPERS:
            raise ValueError(f"clipping must be one of {CLIPPERS}, got {self.clipping!r}")
        if self.batches_per_call is not None and self.batches_per_call < 1:
            raise ValueError(f"batches_per_call must be >= 1, got {self.batches_per_call}")
        if self.physical_batch_size < 1:
            raise ValueError(f"physical_batch_size must be >= 1, got {self.physical_batch_size}")
        if self.devices < 1 or self.physical_batch_size % self.devices:
            raise ValueError(f"devices ({self.devices}) must be >= 1 and divide "
                             f"physical_batch_size ({self.physical_batch_size})")
        if self.devices > jax.local_device_count():
            raise ValueError(f"devices={self.devices} but this host has "
                             f"{jax.local_device_count()} ({jax.default_backend()})")


class TrainState(NamedTuple):
    """Everything a run needs to go on: the parameters, the optimizer's state (with the
    privatizer's step count), the EMA, and the number of steps done."""

    params: Any
    opt_state: Any
    ema: Any
    step: int


@dataclasses.dataclass(frozen=True)
class FinetuneResult:
    """The trained model and its EMA (DP outputs), and the steps run.

    `batch_sizes` (each sampled logical batch size) is an exact statistic of the private data:
    for local debugging only, never to be published. `canary_projections` (an audited run's
    (T, m) privatized sums at the gradient canaries' coordinates, over C) are DP outputs.

    `compile_seconds` (the first step run, compiling included) and `images_per_second` (the
    steps after it, counted at the expected batch size q N: `finetune.timing`) are wall-clock
    measurements, like a job's run time: not DP outputs, and they depend on the records (one
    slow record, a slow run), so the guarantee does not cover them: for the data's owner only
    (the finetune job writes them to its timing file, `dpprobe.timings`). None when not measured
    (no step, or a single one, was run). `batches_per_call`: the physical batches one
    compiled call summed (`FinetuneFlags.batches_per_call` or its rule's number; public).
    """

    model: nnx.Module
    ema_model: nnx.Module | None
    steps: int
    batch_sizes: np.ndarray
    canary_projections: np.ndarray | None = None
    compile_seconds: float | None = None
    images_per_second: float | None = None
    batches_per_call: int | None = None
