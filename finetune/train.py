"""DP-SGD on every weight of a Flax NNX model: one linear trainer (big_vision style).

Each step t of a run of `accounting.DpPlan(sigma, T, q, C)`:

  1. sample: the logical batch includes every training example independently with
     probability q (`dp.poisson_batches`, on `jax_privacy.batch_selection`), cut into
     physical batches of p rows, the last one padded and masked (Beltran et al. 2024,
     https://arxiv.org/abs/2406.17298, Alg. A1): one compiled program for every batch size;
  2. per example: K views (`finetune.augment`), the loss averaged over them, and its gradient
     (De et al. 2022, https://arxiv.org/abs/2204.13650, eq. 4) clipped to C as a whole, by
     book-keeping (`dp.bookkeeping_clipper`: one forward and one backward pass of the batch,
     Bu et al. 2023) or by per-example gradients (`dp.per_example_clipper`, on
     `jax_privacy.clipped_grad`), summed over the physical batches of the step;
  3. noise: N(0, (sigma C)^2 I) added once to the step's sum, divided by the expected batch
     size q N, then the optimizer with its learning-rate schedule (`dp.private_optimizer`:
     an optax chain; the optimizer is post-processing);
  4. EMA of the parameters (De et al., App. C), itself post-processing.

A model with a fixed front (`finetune.fronts`: scatternet_cnn's ScatterNet) trains on the
front's output, computed once per training image, when no augmentation is drawn.

Which parameters: those `spec.train` names (`finetune.modes`: all, the head, biases, LoRA
adapters); the model is split into them and the rest, a constant of the run, so the clipped
sums, the noise (its dimension), the optimizer and the EMA see only the trained ones.

Non-private reference: a plan with clip_norm = inf (so sigma = 0; `--non-private`) trains on
the same Poisson batches with the plain gradient of the summed loss (`gradient_sum`: no
clipping) and an update without the privatizer (no noise): NOT private.

Null records: an example whose image holds a NaN or Inf, whose label is outside the class
set, or whose gradient is not finite contributes exactly zero (its whole gradient is zeroed
before clipping, a function of that example alone).

Formal guarantee:
  For zero-out neighbours (N public), each step is the Poisson-sampled Gaussian mechanism of
  noise multiplier sigma on a sum of L2 sensitivity C, so a run is exactly the `DpEvent` of its
  plan (`plan.dp_event()`), whatever the model, the views, the optimizer, the precision of the
  forward pass (clipping and noise are float32) or the device layout. Noise and sampling
  randomness come from OS entropy unless a test passes its own.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from accounting import DpPlan
from dp.accumulate import add_float64, x64_jit
from dp.bookkeeping import bookkeeping_clipper
from dp.canaries import GradientCanaries, canary_tap
from dp.clipping import NULL_LABEL, per_example_clipper, valid_labels, zero_nonfinite_rows
from dp.distributed import local_batches, shared_generator, sum_over_processes
from dp.noise import make_keys, noise_stddev
from dp.optimizers import make_optimizer, private_optimizer
from dp.sampling import poisson_batches
from finetune.augment import views_of
from finetune.batches import batch_rows, placement
from finetune.evaluation import normalize_images
from finetune.fronts import cached_front
from finetune.graph_key import graph_key, graph_of
from finetune.models._conv import im2col_convolutions
from finetune.modes import count_params, trained_filter
from finetune.specs import FinetuneFlags, FinetuneResult, FinetuneSpec, TrainState
from finetune.timing import StepClock

__all__ = ["clipped_sum", "ema_decay_at", "gradient_sum", "init_state", "model_inputs",
           "split_trained", "train_finetune"]


def ema_decay_at(step: int | jax.Array, decay: float):
    """De et al.'s EMA decay at (0-based) step t: min(decay, (1 + t) / (10 + t))."""
    return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


# ------------------------------------------------------------------------------------------
# The compiled pieces: per-example clipped sum of a physical batch, and the DP update.
# ------------------------------------------------------------------------------------------


def model_inputs(images, spec: FinetuneSpec) -> jax.Array:
    """The model's input from images (`finetune.normalize_images` with the spec's public
    mean and std)."""
    return normalize_images(images, spec.mean, spec.std)


def _example_loss_fn(graphdef, rest, spec: FinetuneSpec, flags: FinetuneFlags, aug_key,
                     canaries: tuple[int, float] | None):
    """The loss of one example (leading batch axis of 1, as `clipped_grad` calls it):
    `_model_loss_fn` on the model merged from `params` (cast to bfloat16 for mixed
    precision). With gradient canaries, params = (the model's, the canary block)."""
    model_loss = _model_loss_fn(spec, aug_key, canaries)

    def loss(params, image, label, row):
        model_params, block = params if canaries is not None else (params, None)
        if flags.mixed_precision:
            model_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), model_params)
        return model_loss(nnx.merge(graphdef, model_params, rest), block, image[0], label[0],
                          row[0])

    return loss


def _model_loss_fn(spec: FinetuneSpec, aug_key, canaries: tuple[int, float] | None):
    """The loss of one example (no batch axis) given the model (`dp.bookkeeping_clipper` calls
    it with the tapped model) and the canary block: the mean over its K views of the
    cross-entropy. With gradient canaries (`canaries` = (N, norm)), row N + j is canary j,
    whose loss is norm * block[j] (`dp.canaries`): its whole gradient is norm e_j in the
    block."""

    def loss(model, block, image, label, row):
        views = model_inputs(views_of(image, jax.random.fold_in(aug_key, row), views=spec.augmult,
                                      padding=spec.crop_padding, flip=spec.flip), spec)
        logits = model(views.astype(jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype))
        value = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), jnp.broadcast_to(label, logits.shape[:1])).mean()
        if canaries is None:
            return value
        num_real, norm = canaries
        canary = row - num_real
        return jnp.where(canary >= 0, norm * block[jnp.clip(canary, 0, block.shape[0] - 1)],
                         value)

    return loss


def _notice(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@functools.partial(x64_jit, static_argnames=("graphdef", "spec", "flags", "canaries",
                                            "structure"))
def clipped_sum(graphdef, params, rest, images, labels, mask, rows, clip, aug_key, *,
                spec: FinetuneSpec, flags: FinetuneFlags,
                canaries: tuple[int, float] | None = None, structure: tuple | None = None):
    """The sum over one physical batch of each example's view-averaged gradient clipped to
    `clip`; masked rows and null records contribute exactly zero. Traced with x64 on so that
    the reduction over the batch's examples is float64 (`dp.bookkeeping`'s guarantee: one
    example moves the computed sum by at most C (1 + 3.1e-7)); the model runs in float32.

    Args:
      images: (p, H, W, C) (views drawn on the device) or (p, K, H, W, C) (given views),
        uint8 or float.
      labels, mask, rows: (p,) labels, 0/1 mask, and global row indices (they pick each
        example's augmentation key, so a view never depends on the batch).
      canaries: (N, norm) when rows N.. are gradient canaries (`_example_loss_fn`).
      structure: None, or the treedefs of (params, rest) when both come as lists of arrays
        (the trainer: no `nnx.Variable` is built or flattened per call); the sums then come
        back as a list too. `graphdef` may be its `graph_key` (hashed once).
    """
    graphdef, params, rest = _unpack(graphdef, params, rest, structure)
    if jnp.issubdtype(images.dtype, jnp.floating):  # uint8 images are always finite
        images, mask = zero_nonfinite_rows(images.astype(jnp.float32), mask)
    valid = valid_labels(labels, spec.num_classes)
    if flags.clipping == "bookkeeping":
        clipper = bookkeeping_clipper(
            _model_loss_fn(spec, aug_key, canaries), graphdef, rest, notices=_notice,
            dtype=jnp.bfloat16 if flags.mixed_precision else None)
        return _pack(structure, clipper(params, (images, jnp.where(valid, labels, 0), rows),
                                        clip, mask * valid).grads)
    clipper = per_example_clipper(
        _example_loss_fn(graphdef, rest, spec, flags, aug_key, canaries),
        microbatch_size=flags.microbatch_size)
    with im2col_convolutions():  # vmapped kernel gradients as batched matmuls (models._conv)
        return _pack(structure, clipper(params, (images, jnp.where(valid, labels, 0), rows),
                                        clip, mask * valid).grads)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "flags", "canaries",
                                             "structure"))
def gradient_sum(graphdef, params, rest, images, labels, mask, rows, clip, aug_key, *,
                 spec: FinetuneSpec, flags: FinetuneFlags,
                 canaries: tuple[int, float] | None = None, structure: tuple | None = None):
    """NOT private: `clipped_sum` without the clipping (`clip` is ignored), for the
    non-private reference: one backward pass of the sum over the batch's unmasked rows of each
    example's (view-averaged) loss. Masked rows, bad labels and non-finite images count zero."""
    del clip
    graphdef, params, rest = _unpack(graphdef, params, rest, structure)
    if jnp.issubdtype(images.dtype, jnp.floating):
        images, mask = zero_nonfinite_rows(images.astype(jnp.float32), mask)
    valid = valid_labels(labels, spec.num_classes)
    loss = _example_loss_fn(graphdef, rest, spec, flags, aug_key, canaries)

    def total(params):
        losses = jax.vmap(lambda image, label, row: loss(params, image[None], label[None],
                                                         row[None]))(
            images, jnp.where(valid, labels, 0), rows)
        return jnp.sum(jnp.where(mask * valid > 0, losses, 0.0))

    return _pack(structure, jax.grad(total)(params))


def _unpack(graphdef, params, rest, structure):
    """The graph and the (params, rest) pytrees of a call (`clipped_sum`'s `structure`)."""
    if structure is not None:
        params, rest = (jax.tree.unflatten(s, v) for s, v in zip(structure, (params, rest),
                                                                   strict=True))
    return graph_of(graphdef), params, rest


def _pack(structure, sums):
    if structure is not None and jax.tree.structure(sums) != structure[0]:  # at trace time
        raise ValueError("the clipped sums are not shaped like the trained parameters")
    return sums if structure is None else jax.tree.leaves(sums)


def _transform(spec: FinetuneSpec, steps: int, stddev, key, denominator, clip,
               canaries: int = 0, private: bool = True):
    """The run's DP update (`dp.private_optimizer`): noise, the mean over the expected batch,
    then the recipe's optimizer with its learning-rate schedule (post-processing); with
    `canaries` > 0, the auditor's tap records each step's noisy sum on the canary block.
    `private=False` (the non-private reference): the same without the noise."""
    optimizer = make_optimizer(spec.optimizer, spec.learning_rate_schedule(steps),
                               momentum=spec.momentum)
    if not private:
        return optax.chain(optax.scale(1.0 / denominator), optimizer)
    tap = (canary_tap(lambda sums: sums[1], steps=steps, count=canaries, clip_norm=clip)
           if canaries else None)
    return private_optimizer(optimizer, stddev=stddev, key=key, expected_batch_size=denominator,
                             observer=tap)


@functools.partial(x64_jit, static_argnames=("spec", "steps", "canaries", "private"),
                   donate_argnums=(0, 1, 2))
def dp_update(params, opt_state, ema, sums, step, stddev, key, denominator, clip, *,
              spec: FinetuneSpec, steps: int, canaries: int = 0, private: bool = True):
    """Noise, mean, optimizer (`_transform`), then the EMA at step `step`'s decay. Not
    private: no noise to add in float64, so the sums go to the optimizer in float32."""
    if not private:
        sums = jax.tree.map(lambda v: v.astype(jnp.float32), sums)
    tx = _transform(spec, steps, stddev, key, denominator, clip, canaries, private)
    updates, opt_state = tx.update(sums, opt_state, params)
    params = optax.apply_updates(params, updates)
    if spec.ema_decay is not None:
        decay = ema_decay_at(step, spec.ema_decay)
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)
    return params, opt_state, ema


def init_state(params, spec: FinetuneSpec, plan: DpPlan, noise_key: jax.Array,
               num_examples: int, canaries: int = 0) -> TrainState:
    """Step 0: the model's parameters (with `canaries` > 0: and a zero canary block), the run's
    optimizer state (the transformation its updates use), the EMA at the parameters."""
    params = jax.tree.map(jnp.copy, params)  # the update donates them; the model keeps its own
    if canaries:
        params = (params, jnp.zeros((canaries,), jnp.float32))
    tx = _transform(spec, plan.steps, *_noise_and_mean(plan, noise_key, num_examples),
                    jnp.float32(plan.clip_norm), canaries, _clipped(plan))
    ema = jax.tree.map(jnp.copy, params) if spec.ema_decay is not None else None
    return TrainState(params, tx.init(params), ema, 0)


def _clipped(plan: DpPlan) -> bool:
    """Whether a plan clips (and noises): clip_norm = inf is the non-private reference."""
    return math.isfinite(plan.clip_norm)


def split_trained(model: nnx.Module, spec: FinetuneSpec):
    """(graphdef, trained parameters, the rest) of `model` for `spec.train`
    (`finetune.modes.trained_filter`); ValueError when that selects nothing (for "lora": no
    adapter)."""
    graphdef, params, rest = nnx.split(model, trained_filter(spec.train), ...)
    if spec.train == "lora" and not count_params(nnx.state(model, nnx.LoRAParam)):
        raise ValueError(f"`train='lora'` selects no parameter of {type(model).__name__}: add "
                         "adapters first (`finetune.add_lora`)")
    if not count_params(params):
        raise ValueError(f"`train={spec.train!r}` selects no parameter of "
                         f"{type(model).__name__}")
    return graphdef, params, rest


def _noise_and_mean(plan: DpPlan, noise_key: jax.Array, num_examples: int):
    """(noise std sigma C, the noise key, the expected batch size q N) of a run."""
    return (jnp.float32(noise_stddev(plan)), noise_key,
            jnp.float32(plan.sampling_probability * num_examples))


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
    canaries: GradientCanaries | None = None,
    rows: tuple[int, int, int] | None = None,
) -> FinetuneResult:
    """DP-SGD on the parameters of `model` that `spec.train` names (module docstring).

    Args:
      model: a Flax NNX model, `model(x)` on (n, H, W, C) float32 giving (n, classes) logits,
        without batch statistics (`finetune.models.check_no_batchnorm`). Not modified.
      images: (N, H, W, C) uint8 or float (on the host), or (N, K, H, W, C) given views.
      labels: (N,) ints; a label outside [0, num_classes) makes a null record.
      plan: the run's DP mechanism (sigma, T, q, C); clip_norm = inf (sigma = 0): the
        NOT private reference (plain batch gradients, no noise).
      spec: the training recipe; flags: speed knobs.
      keys: (2,) keys: noise and augmentation. None (the private choice) draws them from OS
        entropy (`dp.make_keys`); tests pass their own.
      rng: the batch sampler; None (the private choice) seeds one from OS entropy.
      checkpointer: a `finetune.Checkpointer`: the run resumes from its latest save (its
        state, keys and sampler: step t's noise is always `fold_in(noise_key, t)`, and no step
        is run twice) and saves at its interval.
      on_step: called after every step with the state and the sampler.
      progress: called after every step with the number of steps done.
      canaries: white-box gradient canaries (`dp.canaries`): m more rows, N..N+m-1, sampled,
        clipped and noised with the real ones (`plan` is then of N + m rows); each step's
        privatized sum on their block is returned in `canary_projections`.
      rows: (start, stop, N) in a multi-process job (`dp.distributed`): `images` and `labels`
        are rows [start, stop) of the job's N; every process samples the same batches (`rng`
        None: `dp.distributed.shared_generator`), sums the clipped gradients of its own rows,
        and the partial sums are added over processes before the noise, which is added once.
    """
    flags = flags or FinetuneFlags()
    keys = make_keys(2) if keys is None else keys
    rng = shared_generator() if rng is None else rng  # OS entropy (process 0's, shared)
    images, labels = np.asarray(images), np.asarray(labels)
    first, stop, num_real = rows or (0, len(labels), len(labels))
    if stop - first != len(labels) or (rows is not None and canaries is not None):
        raise ValueError(f"rows={rows} needs {stop - first} labels (got {len(labels)}) and no "
                         "canaries")
    model, images, spec, wrap = cached_front(model, images, spec)  # a fixed front: once
    p = flags.physical_batch_size
    count = 0 if canaries is None else canaries.count
    num_examples = num_real + count
    if count:  # canary j's row: any image (its loss ignores it), label 0 if in, else null
        labels = np.concatenate([labels, np.where(canaries.included, 0, NULL_LABEL)])
    static_canaries = (num_real, canaries.norm) if count else None
    private = _clipped(plan)
    if count and not private:
        raise ValueError("canaries audit a privacy claim; a non-private plan (clip_norm = inf) "
                         "has none")
    graphdef, params, rest = split_trained(model, spec)
    key = graph_key(graphdef)  # a static jit argument hashed once, not per physical batch
    batch_sum = clipped_sum if private else gradient_sum
    state = init_state(params, spec, plan, keys[0], num_examples, count)
    if checkpointer is not None and (restored := checkpointer.restore(state)) is not None:
        state, keys, rng = restored
    stddev, noise_key, denominator = _noise_and_mean(plan, keys[0], num_examples)
    clip = jnp.float32(plan.clip_norm)
    place = placement(flags)
    batch_sizes = np.zeros(plan.steps, np.int64)
    params, opt_state, ema, start = state
    # Lists of arrays across the per-batch calls: an nnx.State argument or result costs
    # host time per call for its Variables (README, "The H100 again").
    structure = (jax.tree.structure(params), jax.tree.structure(rest))
    rest_leaves = jax.tree.leaves(rest)
    clock = StepClock()
    for step in range(start, plan.steps):
        batch = next(poisson_batches(num_examples, [plan.sampling_probability], [1], p, rng))
        batch_sizes[step] = batch.sizes[0]
        aug_key = jax.random.fold_in(keys[1], step)
        sums, leaves = None, jax.tree.leaves(params)
        for index, mask in local_batches(batch.index[:, 0], batch.mask[:, 0], first,
                                         stop + count, p):  # this process's rows
            own = index - first
            part = batch_sum(key, leaves, rest_leaves,
                             *place(batch_rows(images, own), labels[own],
                                    mask, index.astype(np.int32)),
                             clip, aug_key, spec=spec, flags=flags, canaries=static_canaries,
                             structure=structure)
            sums = add_float64(sums, part)  # float64 across physical batches (dp.accumulate)
        sums = jax.tree.unflatten(structure[0], sum_over_processes(sums))  # 1 process: as is
        params, opt_state, ema = dp_update(params, opt_state, ema, sums, step, stddev,
                                           noise_key, denominator, clip, spec=spec,
                                           steps=plan.steps, canaries=count, private=private)
        clock.step_done(params, last=step + 1 == plan.steps)
        if checkpointer is not None:
            checkpointer.save(TrainState(params, opt_state, ema, step + 1), keys, rng)
        if on_step is not None:
            on_step(TrainState(params, opt_state, ema, step + 1), rng)
        if progress is not None:
            progress(step + 1)
    projections = None
    if count:  # the tap's record (opt_state[1]: right after the privatizer), then the model's
        projections = np.asarray(opt_state[1].projections)
        params, ema = params[0], None if ema is None else ema[0]
    trained = wrap(nnx.merge(graphdef, params, rest))
    ema_model = None if ema is None else wrap(nnx.merge(graphdef, ema, rest))
    return FinetuneResult(trained, ema_model, plan.steps, batch_sizes, projections,
                          clock.compile_seconds, clock.images_per_second(float(denominator)))
