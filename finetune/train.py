"""DP-SGD on every weight of a Flax NNX model: one linear trainer (big_vision style).

Each step t of a run of `accounting.DpPlan(sigma, T, q, C)`:

  1. sample: the logical batch includes every training example independently with
     probability q (`probe.poisson_batches`, on `jax_privacy.batch_selection`), cut into
     physical batches of p rows, the last one padded and masked (Beltran et al. 2024,
     https://arxiv.org/abs/2406.17298, Alg. A1): one compiled program for every batch size;
  2. per example: K views (`finetune.augment`), the loss averaged over them, and its gradient
     (De et al. 2022, https://arxiv.org/abs/2204.13650, eq. 4) clipped to C as a whole
     (`jax_privacy.clipped_grad`), summed over the physical batches of the step;
  3. noise: N(0, (sigma C)^2 I) added once to the step's sum, divided by the expected batch
     size q N, then the optimizer and the learning rate (`probe.privatized_optimizer`: optax,
     post-processing);
  4. EMA of the parameters (De et al., App. C), itself post-processing.

Null records: an example whose image holds a NaN or Inf, whose label is outside the class
set, or whose gradient is not finite contributes exactly zero (its whole gradient is zeroed
before clipping, a function of that example alone).

Formal guarantee: for zero-out neighbours (N public), each step is the Poisson-sampled
Gaussian mechanism of noise multiplier sigma on a sum of L2 sensitivity C, so a run is exactly
the `DpEvent` of its plan (`plan.dp_event()`), whatever the model, the views, the optimizer,
the precision of the forward pass (clipping and noise are float32) or the device layout.
Noise and sampling randomness come from OS entropy unless a test passes its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from accounting import DpPlan
from finetune.augment import views_of
from probe.batching import poisson_batches
from probe.clipping import zero_nonfinite_rows
from probe.mechanism import make_keys, noise_stddev, privatized_optimizer
from probe.optimizers import OPTIMIZERS, make_optimizer

__all__ = [
    "SCHEDULES",
    "FinetuneFlags",
    "FinetuneResult",
    "FinetuneSpec",
    "TrainState",
    "ema_decay_at",
    "evaluate_model",
    "print_progress",
    "train_finetune",
]

SCHEDULES: tuple[str, ...] = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class FinetuneSpec:
    """How a model is trained. None of it changes epsilon (privacy lives in the `DpPlan`).

    Attributes:
      num_classes: the declared class count (public).
      optimizer: one of `probe.OPTIMIZERS` (post-processing of the noisy mean gradient).
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
    """

    num_classes: int
    optimizer: str = "momentum"
    learning_rate: float = 1.0
    momentum: float = 0.9
    schedule: str = "constant"
    warmup_steps: int = 0
    augmult: int = 1
    crop_padding: int = 0
    flip: bool = False
    ema_decay: float | None = 0.999
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

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


@dataclasses.dataclass(frozen=True)
class FinetuneFlags:
    """Speed and memory knobs. None of them changes epsilon: every example's whole gradient is
    clipped to C and the noise is sigma C whatever they are.

    Attributes:
      physical_batch_size: examples per compiled call (a logical batch is cut into such
        physical batches, the last one padded and masked).
      microbatch_size: `jax_privacy.clipped_grad`'s microbatches inside a physical batch
        (less memory, more sequential work); None: the whole physical batch at once.
      mixed_precision: forward and backward in bfloat16; the per-example gradients are cast
        to float32 before clipping, and clipping and noise are float32.
      devices: data parallel over this many local devices (the physical batch is split
        between them; it must divide `physical_batch_size`).
    """

    physical_batch_size: int = 64
    microbatch_size: int | None = None
    mixed_precision: bool = False
    devices: int = 1

    def __post_init__(self):
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
    for local debugging only, never to be published.
    """

    model: nnx.Module
    ema_model: nnx.Module | None
    steps: int
    batch_sizes: np.ndarray


def ema_decay_at(step: int | jax.Array, decay: float):
    """De et al.'s EMA decay at (0-based) step t: min(decay, (1 + t) / (10 + t))."""
    return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


# ------------------------------------------------------------------------------------------
# The compiled pieces: per-example clipped sum of a physical batch, and the DP update.
# ------------------------------------------------------------------------------------------


def _inputs(images, spec: FinetuneSpec) -> jax.Array:
    x = images.astype(jnp.float32)
    if images.dtype == jnp.uint8:
        x = x / 255.0
    mean, std = jnp.asarray(spec.mean, jnp.float32), jnp.asarray(spec.std, jnp.float32)
    return (x - mean) / std


def _null_if_nonfinite(grads):
    """A gradient with any non-finite coordinate becomes zero (a null record): a function of
    one example, so the sum's sensitivity stays C."""
    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    return jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)


def _example_loss_fn(graphdef, rest, spec: FinetuneSpec, flags: FinetuneFlags, aug_key):
    """The loss of one example (leading batch axis of 1, as `clipped_grad` calls it): the mean
    over its K views of the cross-entropy."""

    def loss(params, image, label, row):
        key = jax.random.fold_in(aug_key, row[0])
        views = views_of(image[0], key, views=spec.augmult, padding=spec.crop_padding,
                         flip=spec.flip)
        views = _inputs(views, spec)
        if flags.mixed_precision:
            params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
            views = views.astype(jnp.bfloat16)
        logits = nnx.merge(graphdef, params, rest)(views).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.broadcast_to(label, logits.shape[:1])).mean()

    return loss


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "flags"))
def clipped_sum(graphdef, params, rest, images, labels, mask, rows, clip, aug_key, *,
                spec: FinetuneSpec, flags: FinetuneFlags):
    """The sum over one physical batch of each example's view-averaged gradient clipped to
    `clip` (float32); masked rows and null records contribute exactly zero.

    Args:
      images: (p, H, W, C) (views drawn on the device) or (p, K, H, W, C) (given views),
        uint8 or float.
      labels, mask, rows: (p,) labels, 0/1 mask, and global row indices (they pick each
        example's augmentation key, so a view never depends on the batch).
    """
    from jax_privacy import clipped_grad

    if jnp.issubdtype(images.dtype, jnp.floating):  # uint8 images are always finite
        images, mask = zero_nonfinite_rows(images.astype(jnp.float32), mask)
    valid = (labels >= 0) & (labels < spec.num_classes)
    mask = mask * valid
    labels = jnp.where(valid, labels, 0)
    grad_fn = clipped_grad(
        _example_loss_fn(graphdef, rest, spec, flags, aug_key), l2_clip_norm=clip,
        batch_argnums=(1, 2, 3), microbatch_size=flags.microbatch_size,
        pre_clipping_transform=_null_if_nonfinite, dtype=jnp.float32)
    return grad_fn(params, images, labels, rows, is_padding_example=mask == 0)


def _transform(spec: FinetuneSpec, steps: int, stddev, key, denominator):
    optimizer = optax.chain(
        make_optimizer(spec.optimizer, momentum=spec.momentum),
        optax.scale_by_schedule(lambda t: spec.learning_rate_schedule(steps)(t)
                                / spec.learning_rate))
    return privatized_optimizer(optimizer, stddev=stddev, key=key, denominator=denominator,
                                learning_rate=spec.learning_rate)


@functools.partial(jax.jit, static_argnames=("spec", "steps"), donate_argnums=(0, 1, 2))
def dp_update(params, opt_state, ema, sums, stddev, key, denominator, *, spec: FinetuneSpec,
              steps: int):
    """Noise, mean, optimizer, learning rate (`probe.privatized_optimizer`), then the EMA."""
    tx = _transform(spec, steps, stddev, key, denominator)
    updates, opt_state = tx.update(sums, opt_state, params)
    params = optax.apply_updates(params, updates)
    if spec.ema_decay is not None:
        count = opt_state[0].count - 1  # the privatizer's count: this step's index
        decay = ema_decay_at(count, spec.ema_decay)
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)
    return params, opt_state, ema


def init_state(params, spec: FinetuneSpec, steps: int) -> TrainState:
    """Step 0: the model's parameters, a fresh optimizer state, the EMA at the parameters."""
    params = jax.tree.map(jnp.copy, params)  # the update donates them; the model keeps its own
    tx = _transform(spec, steps, 0.0, jax.random.key(0), 1.0)  # init reads neither key nor scale
    ema = jax.tree.map(jnp.copy, params) if spec.ema_decay is not None else None
    return TrainState(params, tx.init(params), ema, 0)


# ------------------------------------------------------------------------------------------
# The trainer.
# ------------------------------------------------------------------------------------------


def train_finetune(
    model: nnx.Module,
    images: np.ndarray,
    labels: np.ndarray,
    plan: DpPlan,
    spec: FinetuneSpec,
    *,
    keys: jax.Array | None = None,
    flags: FinetuneFlags | None = None,
    rng: np.random.Generator | None = None,
    checkpointer=None,
    on_step: Callable[[TrainState, np.random.Generator], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FinetuneResult:
    """DP-SGD on every parameter (`nnx.Param`) of `model` (module docstring).

    Args:
      model: a Flax NNX model, `model(x)` on (n, H, W, C) float32 giving (n, classes) logits,
        without batch statistics (`finetune.models.check_no_batchnorm`). Not modified.
      images: (N, H, W, C) uint8 or float (on the host), or (N, K, H, W, C) given views.
      labels: (N,) ints; a label outside [0, num_classes) makes a null record.
      plan: the run's DP mechanism (sigma, T, q, C).
      spec: the training recipe; flags: speed knobs.
      keys: (2,) keys: noise and augmentation. None (the private choice) draws them from OS
        entropy (`probe.make_keys`); tests pass their own.
      rng: the batch sampler; None (the private choice) seeds one from OS entropy.
      checkpointer: a `finetune.Checkpointer`: the run resumes from its latest save (its
        state, keys and sampler: step t's noise is always `fold_in(noise_key, t)`, and no step
        is run twice) and saves at its interval.
      on_step: called after every step with the state and the sampler.
      progress: called after every step with the number of steps done.
    """
    flags = flags or FinetuneFlags()
    keys = make_keys(2) if keys is None else keys
    rng = np.random.default_rng() if rng is None else rng  # OS entropy
    images, labels = np.asarray(images), np.asarray(labels)
    num_examples, p = len(labels), flags.physical_batch_size
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = init_state(params, spec, plan.steps)
    if checkpointer is not None and (restored := checkpointer.restore(state)) is not None:
        state, keys, rng = restored
    stddev = jnp.float32(noise_stddev(plan))
    clip = jnp.float32(plan.clip_norm)
    denominator = jnp.float32(plan.sampling_probability * num_examples)
    place = _placement(flags)
    batch_sizes = np.zeros(plan.steps, np.int64)
    params, opt_state, ema, start = state
    for step in range(start, plan.steps):
        batch = next(poisson_batches(num_examples, [plan.sampling_probability], [1], p, rng))
        batch_sizes[step] = batch.sizes[0]
        aug_key = jax.random.fold_in(keys[1], step)
        sums = None
        for index, mask in zip(batch.index[:, 0], batch.mask[:, 0], strict=True):
            part = clipped_sum(graphdef, params, rest, *place(images[index], labels[index],
                                                              mask, index.astype(np.int32)),
                               clip, aug_key, spec=spec, flags=flags)
            sums = part if sums is None else jax.tree.map(jnp.add, sums, part)
        params, opt_state, ema = dp_update(params, opt_state, ema, sums, stddev, keys[0],
                                           denominator, spec=spec, steps=plan.steps)
        if checkpointer is not None:
            checkpointer.save(TrainState(params, opt_state, ema, step + 1), keys, rng)
        if on_step is not None:
            on_step(TrainState(params, opt_state, ema, step + 1), rng)
        if progress is not None:
            progress(step + 1)
    trained = nnx.merge(graphdef, params, rest)
    ema_model = None if ema is None else nnx.merge(graphdef, ema, rest)
    return FinetuneResult(trained, ema_model, plan.steps, batch_sizes)


def _placement(flags: FinetuneFlags):
    """Puts a physical batch on the device(s): split over a "data" mesh axis when
    `flags.devices` > 1 (XLA then sums each device's clipped gradients across devices)."""
    if flags.devices == 1:
        return lambda *arrays: arrays
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.local_devices()[: flags.devices]), ("data",))

    def place(*arrays):
        return tuple(jax.device_put(a, NamedSharding(
            mesh, PartitionSpec("data", *([None] * (a.ndim - 1))))) for a in arrays)

    return place


# ------------------------------------------------------------------------------------------
# Evaluation on public data.
# ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _correct(graphdef, params, rest, images, labels, mask, *, spec: FinetuneSpec):
    logits = nnx.merge(graphdef, params, rest)(_inputs(images, spec))
    return jnp.sum((jnp.argmax(logits, -1) == labels) * mask)


def evaluate_model(model: nnx.Module, images, labels, spec: FinetuneSpec, *,
                   batch_size: int = 256) -> float:
    """Top-1 accuracy of `model` on (public) images and labels, in padded batches."""
    from probe.batching import pad_rows

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    correct = 0
    for start in range(0, len(labels), batch_size):
        x, y, mask = pad_rows(images[start:start + batch_size], labels[start:start + batch_size],
                              rows=batch_size)
        correct += int(_correct(graphdef, params, rest, x, y, mask, spec=spec))
    return correct / len(labels)


def print_progress(total_steps: int, expected_batch: float, views: int,
                   epsilon_at: Callable[[int], float] | None = None, *, first_step: int = 0,
                   every: int | None = None, stream=sys.stderr):
    """A `progress` callback: one line per `every` steps (about 20 lines in all) with the
    throughput and, if given, the epsilon spent so far (`epsilon_at(steps)`).

    The throughput counts the *expected* batch size q N (times K views) per step: the sampled
    sizes are kept secret (revealing them is not covered by the accounting). The first step's
    line says how long it took: it includes compiling the step (about 46 s for a ViT on a
    CPU), which would otherwise pass in silence."""
    every = every or max(1, total_steps // 20)
    start = time.perf_counter()
    first = [True]

    def report(step: int):
        if first[0]:  # the first step compiles the training step: say how long that took
            first[0] = False
            print(f"step {step}/{total_steps} took {time.perf_counter() - start:.1f} s "
                  "(it compiled the training step; later steps reuse it)", file=stream,
                  flush=True)
        if step % every and step != total_steps:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        rate = (step - first_step) * expected_batch * views / seconds
        spent = f"  epsilon spent {epsilon_at(step):.3f}" if epsilon_at else ""
        print(f"step {step}/{total_steps}  {rate:.0f} img/s (expected batch){spent}",
              file=stream, flush=True)

    return report
