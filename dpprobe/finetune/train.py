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
     `jax_privacy.clipped_grad`), summed over the physical batches of the step in float64, in
     one compiled call for up to `FinetuneFlags.batches_per_call` of them
     (`finetune.batch_sums`);
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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpprobe.accounting import DpPlan
from dpprobe.dp.accumulate import x64_jit
from dpprobe.dp.canaries import GradientCanaries, canary_tap
from dpprobe.dp.canary_rows import coordinates_of
from dpprobe.dp.clipping import NULL_LABEL
from dpprobe.dp.distributed import local_batches, shared_generator, sum_over_processes
from dpprobe.dp.noise import make_keys, noise_stddev
from dpprobe.dp.optimizers import make_optimizer, private_optimizer
from dpprobe.dp.sampling import poisson_batches
from dpprobe.finetune.batch_sums import clipped_sum, gradient_sum, model_inputs, stacked_sums
from dpprobe.finetune.batches import batches_per_call, placement, stacked_rows
from dpprobe.finetune.fronts import cached_front
from dpprobe.finetune.graph_key import graph_key
from dpprobe.finetune.modes import count_params, trained_filter
from dpprobe.finetune.specs import FinetuneFlags, FinetuneResult, FinetuneSpec, TrainState
from dpprobe.finetune.timing import StepClock

__all__ = ["clipped_sum", "ema_decay_at", "gradient_sum", "init_state", "model_inputs",
           "split_trained", "train_finetune", "trained_sizes"]


def ema_decay_at(step: int | jax.Array, decay: float):
    """De et al.'s EMA decay at (0-based) step t: min(decay, (1 + t) / (10 + t))."""
    return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


# ------------------------------------------------------------------------------------------
# The DP update (the per-batch pieces: `finetune.batch_sums`).
# ------------------------------------------------------------------------------------------


def _transform(spec: FinetuneSpec, steps: int, stddev, key, denominator, clip,
               canaries: int = 0, private: bool = True, coordinates=None):
    """The run's DP update (`dp.private_optimizer`): noise, the mean over the expected batch,
    then the recipe's optimizer with its learning-rate schedule (post-processing); with
    `canaries` > 0, the auditor's tap records each step's noisy sum at the canaries'
    `coordinates` of the model's parameters (none needed to initialize its state).
    `private=False` (the non-private reference): the same without the noise."""
    optimizer = make_optimizer(spec.optimizer, spec.learning_rate_schedule(steps),
                               momentum=spec.momentum)
    if not private:
        return optax.chain(optax.scale(1.0 / denominator), optimizer)
    tap = (canary_tap(lambda sums: coordinates_of(sums, coordinates), steps=steps,
                      count=canaries, clip_norm=clip) if canaries else None)
    return private_optimizer(optimizer, stddev=stddev, key=key, expected_batch_size=denominator,
                             observer=tap)


@functools.partial(x64_jit, static_argnames=("spec", "steps", "canaries", "private", "trees"),
                   donate_argnums=(0,))
def dp_update(state, sums, step, stddev, key, denominator, clip, coordinates=None, *,
              spec: FinetuneSpec, steps: int, canaries: int = 0, private: bool = True,
              trees: tuple):
    """Noise, mean, optimizer (`_transform`), then the EMA at step `step`'s decay, on the
    leaves of (params, opt_state, ema) and of the step's sums (`trees`: their treedefs; lists
    of arrays, so that no `nnx.Variable` is built on the host per step); returns the new
    state's leaves. Not private: no noise to add in float64, so the sums go to the optimizer
    in float32."""
    params, opt_state, ema = jax.tree.unflatten(trees[0], state)
    sums = jax.tree.unflatten(trees[1], sums)
    if not private:
        sums = jax.tree.map(lambda v: v.astype(jnp.float32), sums)
    tx = _transform(spec, steps, stddev, key, denominator, clip, canaries, private, coordinates)
    updates, opt_state = tx.update(sums, opt_state, params)
    params = optax.apply_updates(params, updates)
    if spec.ema_decay is not None:
        decay = ema_decay_at(step, spec.ema_decay)
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)
    return jax.tree.leaves((params, opt_state, ema))


def init_state(params, spec: FinetuneSpec, plan: DpPlan, noise_key: jax.Array,
               num_examples: int, canaries: int = 0) -> TrainState:
    """Step 0: the model's parameters, the run's optimizer state (the transformation its
    updates use; with `canaries` > 0, the auditor's tap), the EMA at the parameters."""
    params = jax.tree.map(jnp.copy, params)  # the update donates them; the model keeps its own
    tx = _transform(spec, plan.steps, *_noise_and_mean(plan, noise_key, num_examples),
                    jnp.float32(plan.clip_norm), canaries, _clipped(plan))
    ema = jax.tree.map(jnp.copy, params) if spec.ema_decay is not None else None
    return TrainState(params, tx.init(params), ema, 0)


def trained_sizes(params) -> tuple[int, ...]:
    """The sizes of the trained parameters' leaves (`jax.tree.leaves` order): where gradient
    canaries may go (`dp.GradientCanaries.draw`)."""
    return tuple(int(np.prod(np.shape(v))) for v in jax.tree.leaves(params))


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
        clipped and noised with the real ones (`plan` is then of N + m rows), canary j's
        gradient a Dirac on coordinate `canaries.coordinates[j]` of the trained parameters
        (which it moves: the model is an audit artefact); each step's privatized sum at those
        coordinates is returned in `canary_projections`.
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
    if count:  # canary j's row: a zero image (its gradient is a Dirac), label 0 if in, else null
        labels = np.concatenate([labels, np.where(canaries.included, 0, NULL_LABEL)])
    static_canaries = (num_real, canaries.norm) if count else None
    private = _clipped(plan)
    if count and not private:
        raise ValueError("canaries audit a privacy claim; a non-private plan (clip_norm = inf) "
                         "has none")
    graphdef, params, rest = split_trained(model, spec)
    coordinates = None
    if count:
        canaries.check_sizes(trained_sizes(params))
        coordinates = jnp.asarray(canaries.coordinates, jnp.int32)
    key = graph_key(graphdef)  # a static jit argument hashed once, not per physical batch
    state = init_state(params, spec, plan, keys[0], num_examples, count)
    if checkpointer is not None and (restored := checkpointer.restore(state)) is not None:
        state, keys, rng = restored
    stddev, noise_key, denominator = _noise_and_mean(plan, keys[0], num_examples)
    clip, aug_base = jnp.float32(plan.clip_norm), keys[1]
    place = placement(flags, axis=1)  # the stacks' batch axis
    batch_sizes = np.zeros(plan.steps, np.int64)
    params, opt_state, ema, start = state
    # Lists of arrays across the compiled calls: an nnx.State argument or result costs
    # host time per call for its Variables (README, "The H100 again").
    structure = (jax.tree.structure(params), jax.tree.structure(rest))
    trees = (jax.tree.structure((params, opt_state, ema)), structure[0])
    leaves, rest_leaves = jax.tree.leaves((params, opt_state, ema)), jax.tree.leaves(rest)
    with jax.enable_x64(True):  # a step's first total: 0 + part is part, exactly
        zeros = jax.device_put([np.zeros(v.shape, np.float64) for v in jax.tree.leaves(params)])
    local = stop - first + count  # this process's rows
    stack = max(1, min(batches_per_call(flags, plan.sampling_probability * local,
                                        images[0].nbytes if len(images) else 1),
                       -(-local // p)))

    def state_after(step):  # the pytrees, rebuilt only when asked for
        return TrainState(*jax.tree.unflatten(trees[0], leaves), step + 1)

    clock = StepClock()
    for step in range(start, plan.steps):
        batch = next(poisson_batches(num_examples, [plan.sampling_probability], [1], p, rng))
        batch_sizes[step] = batch.sizes[0]
        sums = zeros
        batches = local_batches(batch.index[:, 0], batch.mask[:, 0], first, stop + count, p)
        for at in range(0, len(batches), stack):  # this process's rows, `stack` batches a call
            group = batches[at:at + stack]
            sums = stacked_sums(key, leaves[:len(zeros)], rest_leaves, sums,
                                *place(*stacked_rows(images, labels, group, first, stack)),
                                np.int32(len(group)), clip, aug_base, np.int32(step),
                                coordinates, spec=spec, flags=flags, canaries=static_canaries,
                                structure=structure, private=private)
        leaves = dp_update(leaves, sum_over_processes(sums), step, stddev, noise_key,
                           denominator, clip, coordinates, spec=spec, steps=plan.steps,
                           canaries=count, private=private, trees=trees)
        clock.step_done(leaves, last=step + 1 == plan.steps)
        if checkpointer is not None and checkpointer.due(step + 1):
            checkpointer.save(state_after(step), keys, rng)
        if on_step is not None:
            on_step(state_after(step), rng)
        if progress is not None:
            progress(step + 1)
    params, opt_state, ema, _ = state_after(plan.steps - 1)
    projections = None
    if count:  # the tap's record (opt_state[1]: right after the privatizer)
        projections = np.asarray(opt_state[1].projections)
    trained = wrap(nnx.merge(graphdef, params, rest))
    ema_model = None if ema is None else wrap(nnx.merge(graphdef, ema, rest))
    return FinetuneResult(trained, ema_model, plan.steps, batch_sizes, projections,
                          clock.compile_seconds, clock.images_per_second(float(denominator)),
                          batches_per_call=stack)
